"""The α-gating network: how much of a retrieved state to fuse into the current one.

``α = alpha_max · sigmoid(MLP([rms(h_cur); rms(h_ret); sim]))`` and
``h = α · h_ret + (1 − α) · h_cur``, with α forced to 0 where the retrieval missed the
threshold. Inputs are RMS-normalised so the gate sees directions, not magnitudes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class AlphaGate(nn.Module):
    def __init__(self, hidden: int, width: int = 64, alpha_max: float = 0.3):
        super().__init__()
        self.alpha_max = alpha_max
        self.proj = nn.Linear(2 * hidden + 1, width)
        self.out = nn.Linear(width, 1)

    def forward(self, current: torch.Tensor, retrieved: torch.Tensor, similarity: torch.Tensor) -> torch.Tensor:
        """current, retrieved [..., H]; similarity [...] -> α [...] in [0, alpha_max]."""
        x = torch.cat([_rms(current), _rms(retrieved), similarity.unsqueeze(-1).to(current.dtype)], dim=-1)
        return self.alpha_max * torch.sigmoid(self.out(F.silu(self.proj(x)))).squeeze(-1)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def fuse(current: torch.Tensor, retrieved: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """h = α·h_retrieved + (1−α)·h_current; α [...] broadcast over the hidden dimension."""
    a = alpha.unsqueeze(-1).to(current.dtype)
    return a * retrieved + (1 - a) * current
