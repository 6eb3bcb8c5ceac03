"""The target's side of speculative decoding: one forward over ragged rows, with feature capture.

The target keeps a :class:`.ragged_cache.RaggedCache`. Between iterations a
row holds every accepted token but the last one: that token's logits and features come
out of the next verify, in the same forward as the candidates that follow it.

The draft consumes the target's "aux" features (the outputs of three decoder layers,
``lyanna_train.target.capture``'s convention), so every target forward here also captures
them at each position it computes, with forward hooks, with the same :class:`LayerCapture` the feature extractor uses.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import torch

from ...target.capture import LayerCapture
from .grouped_attention import grouped, row_groups
from .masks import MaskForm, UnsupportedTarget, key_positions, ragged_mask
from .ragged_cache import RaggedCache


def draft_capture(target, draft, layer_ids=None) -> LayerCapture | None:
    """The hooks that give ``draft`` its features from ``target`` (None without a draft),
    refused when the captured layers do not give the width the draft's ``fc`` reads."""
    if draft is None:
        return None
    capture = LayerCapture(target, layer_ids or draft.cfg.aux_layer_ids or None)
    if capture.aux_size != draft.fc.in_features:
        raise ValueError(f"the draft's fc reads {draft.fc.in_features} features, "
                         f"layers {capture.layer_ids} of the target give {capture.aux_size}")
    return capture


def cache_kwarg(target) -> str:
    # transformers 5 renamed ``past_key_values`` to ``cache`` (the old name warns).
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


@contextlib.contextmanager
def _grouped_kv_heads(target):
    """On the CPU, let torch's SDPA read grouped KV heads itself (``enable_gqa``).

    With a custom mask and more than one new token per row, transformers' SDPA path copies
    every row's whole KV cache once per query group (``repeat_kv``) in every layer: at 16
    rows x 2 tokens after ~200 cached ones on SmolLM2 that copy was 60 % of the forward
    (265 ms against 98 ms with grouped heads, 2 cores). transformers reads the switch from
    the environment on each call; on CUDA it is left alone (a masked grouped SDPA there
    falls back to the math kernel)."""
    if target.device.type != "cpu" or os.environ.get(_FORCE_GQA) is not None:
        yield
        return
    os.environ[_FORCE_GQA] = "1"
    try:
        yield
    finally:
        del os.environ[_FORCE_GQA]


_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


def _run(target, capture: LayerCapture | None, **inputs):
    """The target's forward, with the aux features when a capture is given (else None)."""
    with _grouped_kv_heads(target):
        if capture is None:
            return target(**inputs).logits, None
        with capture:
            logits = target(**inputs).logits
        return logits, capture.aux()


def ragged_forward(target, capture: LayerCapture | None, cache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   mask: torch.Tensor, logits_at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of new tokens after a :class:`.ragged_cache.RaggedCache` (planned by its
    ``begin``): input_ids / position_ids [R, T], mask [R, 1, T, kv_length] bool (what each
    token may read, :func:`.masks.ragged_mask`) -> (logits [R, T, V], or [R, 1, V] at row r's
    position ``logits_at[r]`` when given; aux [R, T, k·H]). The mask reaches the model in the
    form its attention reads; rows of unlike lengths are attended in runs, each over its own
    keys (:mod:`.grouped_attention`)."""
    keys = key_positions(cache.plan.offsets, position_ids, mask.shape[-1])
    mask = MaskForm.of(target).build(mask, position_ids, keys)
    width = input_ids.shape[1]
    groups = row_groups([n + width for n in cache.plan.lengths], width) if len(cache.plan.lengths) > 1 else None
    with grouped(target, groups), _logits_only_at(target, logits_at):
        return _run(target, capture, input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                    use_cache=True, **{cache_kwarg(target): cache})


@contextlib.contextmanager
def _logits_only_at(target, positions: torch.Tensor | None):
    """The LM head reads one position per row (``positions`` [R]; None: every position).

    transformers' ``logits_to_keep`` keeps the same last columns of every row; rows padded
    to one width end at different columns. The head's input is cut to each row's own
    column before it runs, so whatever the model does to the head's output (Gemma2's
    soft-capping, a logit scale) still applies, over [R, 1, V] instead of [R, T, V]."""
    if positions is None:
        yield
        return

    def pick(_head, args):
        hidden = args[0]
        return (hidden[torch.arange(hidden.shape[0], device=hidden.device), positions.to(hidden.device)][:, None],
                *args[1:])

    handle = target.get_output_embeddings().register_forward_pre_hook(pick)
    try:
        yield
    finally:
        handle.remove()


def check_target_masks(target) -> None:
    """Refuse (one line) a target whose attention does not honour the runtime's masks.

    Runs a short sequence through the runtime's own path — two rows of a
    :class:`.ragged_cache.RaggedCache` at different lengths, a chunked prefill, then a
    fused forward over both rows — and compares every logit with the target's plain
    forward over the same tokens (transformers' own causal and sliding-window masks). An
    attention implementation that drops or misreads a custom mask, or a model that does
    not read its cache through ``cache.update``, fails here, before anything is decoded.
    Checked once per model object."""
    if getattr(target, "_lyanna_masks_checked", False):
        return
    form = MaskForm.of(target)  # refuses implementations that take no custom mask at all
    window = min((w for _, w in form.windows if w is not None), default=None)
    length = 2 * window + 3 if window is not None and window <= 32 else 12  # past a small window: it is exercised
    device = target.device
    ids = (torch.arange(length, device=device) * 7919 + 11) % target.config.vocab_size
    with torch.inference_mode():
        reference = target(input_ids=ids[None], use_cache=False).logits[0].float()
        cache = RaggedCache.for_model(target, 2, capacity=length)
        lengths, logits = (length - 4, length - 6), {}
        for row, n in enumerate(lengths):  # chunked prefill of each row alone
            offsets = cache.begin(slice(row, row + 1), n)
            positions = torch.arange(n, device=device)[None]
            out, _ = ragged_forward(target, None, cache, ids[None, :n], positions,
                                    ragged_mask(offsets, torch.arange(-1, n - 1)[None], n))
            cache.advance(row, n)
            logits[row] = [out[0]]
        width = length - min(lengths)  # then both rows at once, ragged: the shorter row is padded
        offsets = cache.begin(slice(0, 2), width)
        tokens = torch.zeros(2, width, dtype=torch.long, device=device)
        parents = torch.full((2, width), -1, dtype=torch.long)
        for row, n in enumerate(lengths):
            tokens[row, :length - n] = ids[n:]
            parents[row, :length - n] = torch.arange(-1, length - n - 1)
        out, _ = ragged_forward(target, None, cache, tokens, offsets[:, None] + torch.arange(width, device=device),
                                ragged_mask(offsets, parents, cache.plan.kv_length))
    for row, n in enumerate(lengths):
        ours = torch.cat([logits[row][0], out[row, :length - n]]).float()
        error = float((ours - reference).abs().max() / reference.abs().max().clamp(min=1e-6))
        if not error <= (1e-3 if target.dtype == torch.float32 else 3e-2):
            impl = getattr(target.config, "_attn_implementation", None)
            raise UnsupportedTarget(
                f"{type(target).__name__} (attn_implementation={impl!r}) does not give its own logits under the "
                f"runtime's attention masks (relative error {error:.2g}): decoding would not be lossless; load it "
                f"with attn_implementation='sdpa' or 'eager'")
    target._lyanna_masks_checked = True
