"""The target's hooks: which decoder layers the draft reads, and forward hooks that capture them.

Layer ids mean "output of decoder layer i" (0-based), i.e. Hugging Face
``hidden_states[i + 1]``, for ``i < L - 1`` (HF's ``hidden_states[L]`` is ``last``, after
the final norm). The default is EAGLE-3's choice: SGLang and vLLM capture the *input* of
layers ``2, L // 2, L - 3``, which are the outputs of ``1, L // 2 - 1, L - 4``.

The feature extractor (training) and the runtime (serving) both capture through
:class:`LayerCapture`, so they read exactly the same tensors, and both summarise the
target's logits for the feature cache through :func:`logits_summary`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import LyannaError

LAYER_CONVENTION = "output of decoder layer i (0-based) = HF hidden_states[i+1]"


def logits_summary(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (top-1 [N] int64, logsumexp [N] fp32): what the feature cache keeps of
    the target's distribution. One max pass gives the top-1 and the shift of the logsumexp
    (``torch.logsumexp`` reads the logits twice more)."""
    logits = logits.float()
    best, index = logits.max(-1)
    return index, best + (logits - best[:, None]).exp_().sum(-1).log_()  # a new tensor: the input is untouched


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
