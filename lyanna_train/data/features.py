"""Run the target once and keep, per token, what the draft head consumes.

EAGLE-3 feeds the draft a low, a middle and a high layer of the target (``aux``) and
trains it against the target's next-token distribution, which follows from the final
hidden state (``last``: ``lm_head(last)`` are the logits). Both come from one forward
pass of the base model: forward hooks grab the chosen layers' outputs as they pass, so
the other hidden states are freed as usual instead of all L+1 being kept as
``output_hidden_states=True`` does, and the ``lm_head`` (a vocabulary-wide matmul per
token: ~20% of SmolLM2-135M's forward FLOPs) is skipped; the trainer applies it to
``last`` only where it needs logits. Which layers, and the hooks, are
:mod:`lyanna_train.target.capture`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..target.capture import LayerCapture, logits_summary


@dataclass
class TargetFeatures:
    """One batch of target features, in the target's dtype, padded positions included."""

    aux: torch.Tensor  # [B, T, k*H]: the chosen layers' outputs, concatenated in the given order
    last: torch.Tensor  # [B, T, H]: after the final norm, so lm_head(last) == logits


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
        the padding, and the mask-free path lets SDPA use its fast causal kernel. Ids made on
        the host go to the target's device; the features stay there.
        """
        device = self.model.device
        input_ids = input_ids.to(device)
        attention_mask = attention_mask.to(device) if attention_mask is not None else None
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
    parts = [logits_summary(last[i:i + chunk].to(lm_weight.dtype) @ lm_weight.T)
             for i in range(0, last.shape[0], chunk)]
    if not parts:
        return last.new_zeros(0, dtype=torch.long), last.new_zeros(0, dtype=torch.float32)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
