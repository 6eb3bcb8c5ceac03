"""Pool candidates: what followed the most similar earlier state, proposed for free.

The state pool already holds the draft's step-0 state of every recent anchor. When the
current anchor's own step-0 state is close (cosine ≥ the pool's threshold) to the one of
an earlier anchor p, the text may be repeating itself in meaning, not only in surface
n-grams: the tokens that followed p (x_{p+2}, x_{p+3}, ...) are proposed as the
continuation, beside the draft's and prompt lookup's candidates, and verified in the
same forward. It costs one similarity row over the pool's kept unit vectors per iteration.
"""

from __future__ import annotations

import torch

from .state import RowView


def pool_continuation(state: RowView, context: torch.Tensor, length: int, max_tokens: int,
                      threshold: float) -> list[int]:
    """-> up to ``max_tokens`` ids following the pooled anchor most similar to the current
    anchor (its window is the training one, [t - size, t - 1]); [] when none reaches
    ``threshold``. context [≥ length]: the accepted ids x_0..x_{length-1}."""
    pool, query = state.pool, state.pending
    if pool is None or query is None or max_tokens < 1:
        return []
    sim, position = pool.most_similar(query.reshape(-1), state.anchor_pos)
    if sim < threshold:
        return []
    start = position + 2  # anchor p's state predicts x_{p+2}
    return context[start:min(start + max_tokens, length)].tolist()
