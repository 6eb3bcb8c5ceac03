"""Run the target once and keep, per token, what the draft head consumes.

EAGLE-3 feeds the draft a low, a middle and a high layer of the target (``aux``) and
trains it against the target's next-token distribution, which follows from the final
hidden state (``last``: ``lm_head(last)`` are the logits). Both come from one forward
pass of the base model: forward hooks grab the chosen layers' outputs as they pass, so
the other hidden states are freed as usual instead of all L+1 being kept as
``output_hidden_states=True`` does, and the ``lm_head`` (a vocabulary-wide matmul per
token: ~20% of SmolLM2-135M's forward FLOPs) is skipped; the trainer applies it to
``last`` only where it needs logits.

Layer ids mean "output of decoder layer i" (0-based), i.e. Hugging Face
``hidden_states[i + 1]``, for ``i < L - 1`` (HF's ``hidden_states[L]`` is ``last``, after
the final norm). The default is EAGLE-3's choice: SGLang and vLLM capture the *input* of
layers ``2, L // 2, L - 3``, which are the outputs of ``1, L // 2 - 1, L - 4``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import LyannaError

LAYER_CONVENTION = "output of decoder layer i (0-based) = HF hidden_states[i+1]"


@dataclass
class TargetFeatures:
    """One batch of target features, in the target's dtype, padded positions included."""

    aux: torch.Tensor  # [B, T, k*H]: the chosen layers' outputs, concatenated in the given order
    last: torch.Tensor  # [B, T, H]: after the final norm, so lm_head(last) == logits


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/middle/high layers for a target with ``num_layers`` decoder layers."""
    ids = (1, num_layers // 2 - 1, num_layers - 4)
    if not ids[0] < ids[1] < ids[2]:
        raise LyannaError(
            f"the target has only {num_layers} layers, too few for the default layers {ids}; pass layer ids explicitly"
        )
    return ids


def check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Validate user-given ids (distinct, each in ``[0, num_layers - 1)``) and return them as a tuple.

    The last layer is excluded: HF reports its output after the final norm, which is ``last``.
    """
    ids = tuple(int(i) for i in layer_ids)
    if not ids:
        raise LyannaError("at least one target layer id is needed")
    bad = [i for i in ids if not 0 <= i < num_layers - 1]
    if bad:
        raise LyannaError(f"layer ids {bad} are out of range: use 0..{num_layers - 2} "
                          f"(the last layer's output, after the final norm, is already the 'last' feature)")
    if len(set(ids)) != len(ids):
        raise LyannaError(f"layer ids must be distinct, got {list(ids)}")
    return ids


def parse_layer_ids(text: str) -> tuple[int, ...]:
    """``"1,14,26"`` -> ``(1, 14, 26)`` (range checks need the model: see :func:`check_layer_ids`)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise LyannaError(f"layer ids must be comma-separated integers, got {text!r}") from None


def _decoder_layers(model) -> Sequence[torch.nn.Module]:
    layers = getattr(model.base_model, "layers", None)
    if layers is None:
        raise LyannaError(f"{type(model).__name__}: cannot find its decoder layers (expected base_model.layers)")
    return layers


class LayerCapture:
    """Forward hooks on chosen decoder layers: ``with capture: model(...)``, then
    :meth:`aux` is [B, T, k·H] for the positions that forward computed. Shared by the
    feature extractor and the runtime, so both read exactly the same tensors."""

    def __init__(self, model, layer_ids: Sequence[int] | None = None):
        self.layers = _decoder_layers(model)
        n = len(self.layers)
        self.layer_ids = check_layer_ids(layer_ids, n) if layer_ids is not None else default_layer_ids(n)
        self.aux_size = len(self.layer_ids) * int(model.config.hidden_size)
        self._captured: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def _keep(self, i: int):
        def hook(_module, _inputs, output):
            self._captured[i] = output[0] if isinstance(output, tuple) else output

        return hook

    def __enter__(self) -> "LayerCapture":
        self._captured.clear()
        self._handles = [self.layers[i].register_forward_hook(self._keep(i)) for i in self.layer_ids]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def aux(self) -> torch.Tensor:
        return torch.cat([self._captured.pop(i) for i in self.layer_ids], dim=-1)


class FeatureExtractor:
    """Target features for batches of token ids; the "online" mode calls it inside a training step."""

    def __init__(self, model, layer_ids: Sequence[int] | None = None):
        self.model = model
        self.capture = LayerCapture(model, layer_ids)
        self.layers, self.layer_ids = self.capture.layers, self.capture.layer_ids
        self.hidden_size = int(model.config.hidden_size)

    @property
    def aux_size(self) -> int:
        return self.capture.aux_size

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> TargetFeatures:
        """Features for ``input_ids`` [B, T].

        Pad on the right and pass no mask: attention is causal, so real tokens never see
        the padding, and the mask-free path lets SDPA use its fast causal kernel.
        """
        with self.capture, torch.inference_mode():
            out = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            aux = self.capture.aux()
        return TargetFeatures(aux=aux, last=out.last_hidden_state)


def teacher_summary(last: torch.Tensor, lm_weight: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """last [N, H] -> (top-1 id [N] int64, logsumexp [N] fp32) of the full-vocabulary logits.

    All the loss needs from outside the hot vocabulary: whether the top-1 is hot, and the
    normaliser. Stored in the feature cache, it spares training the full LM head (most
    of a small draft's step); formed in chunks of positions, never kept whole. The matrix
    product runs in the LM head's own dtype (a bf16 target: a bf16 GEMM, 4x faster than
    fp32 on CPUs with AVX512-BF16, rounding logits by ~0.1 at worst); one max pass gives
    the top-1 and the shift of an fp32 logsumexp (torch.logsumexp would read the logits twice more)."""
    top1, lse = [], []
    for i in range(0, last.shape[0], chunk):
        logits = (last[i:i + chunk].to(lm_weight.dtype) @ lm_weight.T).float()
        best, index = logits.max(-1)
        top1.append(index)
        lse.append(best + (logits - best[:, None]).exp_().sum(-1).log_())
    if not top1:
        return last.new_zeros(0, dtype=torch.long), last.new_zeros(0, dtype=torch.float32)
    return torch.cat(top1), torch.cat(lse)
