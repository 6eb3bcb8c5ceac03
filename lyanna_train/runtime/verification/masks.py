"""Attention masks in the form the loaded target's attention reads them.

The runtime decides which keys each new token sees (a tree node: the row's cache and
its ancestors) and hands transformers a 4-D mask, which transformers passes to the
attention function untouched. The functions disagree on what such a mask means: SDPA
reads a boolean mask as "may attend", while eager and flex attention *add* the mask to
the scores, so a boolean mask there masks nothing and decoding silently stops being
lossless. A custom mask also replaces the one transformers would have built, sliding
windows included, so the window of each layer type is applied here.

:class:`MaskForm` is read off a model once; every forward the runtime makes (prefill,
fused verify) builds its mask through :meth:`MaskForm.build`. :func:`check_target_masks`
runs the target once through the runtime's own path and against its plain forward, and
refuses a target whose attention does not honour the mask, rather than decode wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import LyannaError
from ...target.support import LAYER_KINDS, text_config

BOOLEAN = ("sdpa",)  # a bool mask: True = may attend
ADDITIVE = ("eager", "flex_attention")  # the mask is added to the scores: 0 or the dtype's minimum


class UnsupportedTarget(LyannaError):
    """A target the runtime cannot decode losslessly, named in one line."""


def layer_windows(config) -> dict[str, int | None]:
    """Layer kind -> its attention window (None: the whole context), for the kinds the model has.

    transformers 5 names each layer's kind in ``config.layer_types``; older-style configs
    (Mistral, Mixtral) give one ``sliding_window`` for every layer."""
    config = text_config(config)
    window = getattr(config, "sliding_window", None) or None
    kinds = list(getattr(config, "layer_types", None) or [])
    if not kinds:
        return {"sliding_attention": int(window)} if window else {"full_attention": None}
    other = sorted(set(kinds) - set(LAYER_KINDS))
    if other:
        raise UnsupportedTarget(f"{getattr(config, 'model_type', 'this target')}: layers of kind {', '.join(other)} "
                                f"cannot be verified with a tree mask (supported kinds: {', '.join(LAYER_KINDS)})")
    return {kind: (int(window) if kind == "sliding_attention" and window else None) for kind in dict.fromkeys(kinds)}


@dataclass(frozen=True)
class MaskForm:
    """How one target reads a custom attention mask."""

    additive: bool  # eager / flex: a float mask added to the scores; SDPA: a bool mask
    dtype: torch.dtype  # of an additive mask (the model's)
    windows: tuple[tuple[str, int | None], ...]  # (layer kind, window) for each kind the model has
    by_kind: bool  # the model takes a {kind: mask} mapping (layers of several kinds)

    @classmethod
    def of(cls, model) -> "MaskForm":
        config = text_config(model.config)
        impl = getattr(config, "_attn_implementation", None) or getattr(model.config, "_attn_implementation", None)
        impl = impl or "eager"
        if impl not in BOOLEAN + ADDITIVE:
            raise UnsupportedTarget(
                f"{getattr(config, 'model_type', 'this target')} runs attn_implementation={impl!r}, which cannot take "
                f"the tree mask speculative decoding verifies with; load it with attn_implementation='sdpa' (or "
                f"{', '.join(repr(i) for i in BOOLEAN + ADDITIVE if i != 'sdpa')})")
        if impl == "flex_attention" and model.device.type == "cpu":
            # torch's CPU flex kernel fails to compile (seen with torch 2.13): refuse before a crash
            raise UnsupportedTarget("attn_implementation='flex_attention' does not run on the CPU with this torch; "
                                    "load the target with attn_implementation='sdpa' or 'eager'")
        windows = layer_windows(config)
        return cls(impl in ADDITIVE, model.dtype, tuple(windows.items()), len(windows) > 1)

    def build(self, allowed: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor):
        """allowed [R, 1, T, S] bool (what each new token may read), query_positions [R, T]
        and key_positions [R, S] (the position each key slot holds) -> the mask to pass as
        ``attention_mask``: one tensor, or {layer kind: tensor} for a model with several."""
        masks = {}
        for kind, window in self.windows:
            mask = allowed
            if window is not None:  # transformers' sliding window: key k is seen from q when q - k < window
                mask = allowed & ((query_positions[:, None, :, None] - key_positions[:, None, None, :]) < window)
            masks[kind] = self._form(mask)
        return masks if self.by_kind else next(iter(masks.values()))

    def _form(self, mask: torch.Tensor) -> torch.Tensor:
        if not self.additive:
            return mask
        return torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill(~mask,
                                                                                         torch.finfo(self.dtype).min)


def ragged_mask(offsets: torch.Tensor, parents: torch.Tensor, kv_length: int) -> torch.Tensor:
    """[rows, 1, width, kv_length] bool for a forward over ``rows`` token trees (or chunks).

    parents [rows, width] (int64, -1 for a root and for padding): row i's entry j, written
    at slot offsets[i] + j, sees that row's cached slots 0..offsets[i]-1, itself and its
    ancestors (a chain ``[-1, 0, 1, ...]`` is a causal chunk). A padding entry sees
    the row's cache and itself (a row of False would make attention NaN), and nobody sees it."""
    rows, width = parents.shape
    device = offsets.device
    parents = parents.to(device)
    tree = torch.eye(width, dtype=torch.bool, device=device).repeat(rows, 1, 1)
    ancestor = parents
    while bool((ancestor >= 0).any()):  # one level up per pass: as many passes as the deepest node
        at = ancestor.clamp(min=0)[..., None]
        tree.scatter_(2, at, (ancestor >= 0)[..., None] | tree.gather(2, at))  # a root's pass rewrites what was there
        ancestor = torch.where(ancestor >= 0, parents.gather(1, ancestor.clamp(min=0)), ancestor)
    cached = torch.arange(kv_length, device=device)[None, None, :] < offsets[:, None, None]
    mask = cached.expand(rows, width, kv_length).clone()
    columns = (offsets[:, None, None] + torch.arange(width, device=device)).expand(rows, width, width)
    mask.scatter_(2, columns, tree)
    return mask[:, None]


def key_positions(offsets: torch.Tensor, positions: torch.Tensor, kv_length: int) -> torch.Tensor:
    """[rows, kv_length]: the position each key slot holds during a ragged forward. A row's
    cached slots hold positions 0..offsets-1 in order; its new entries, written at slots
    offsets .. offsets+width-1, hold ``positions`` [rows, width] (a tree node's depth past
    the offset, not its slot)."""
    rows, width = positions.shape
    keys = torch.arange(kv_length, device=offsets.device).repeat(rows, 1)
    columns = offsets[:, None] + torch.arange(width, device=offsets.device)
    return keys.scatter(1, columns, positions.to(keys.device))
