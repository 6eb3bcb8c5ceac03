"""Prompt-lookup candidates: continuations that cost nothing to propose.

The last few tokens of the context (prompt + text so far) are looked up earlier in the
context; what followed there is proposed as the continuation (Saxena's prompt-lookup
decoding, which transformers ships as ``prompt_lookup_num_tokens``). Chat answers quote
the question, code repeats identifiers, small models loop: all of it is free to draft.
"""

from __future__ import annotations

import torch


def lookup_continuations(context: torch.Tensor, max_tokens: int, max_ngram: int = 3, min_ngram: int = 1,
                         branches: int = 1) -> tuple[int, list[list[int]]]:
    """context [T] (1-D ids) -> (n, up to ``branches`` distinct continuations of ≤ ``max_tokens``).

    The longest suffix n-gram (max_ngram down to min_ngram) that occurred before wins (n
    is its length, 0 when nothing matched); its most recent occurrences come first
    (recent text predicts the next better than old).
    """
    t = context.shape[0]
    if max_tokens < 1 or branches < 1:
        return 0, []
    for n in range(min(max_ngram, t - 1), min_ngram - 1, -1):
        suffix = context[t - n:]
        windows = context[: t - 1].unfold(0, n, 1)  # every n-gram that ends before the last token
        starts = torch.nonzero((windows == suffix).all(dim=1)).flatten().tolist()
        found: list[list[int]] = []
        for start in reversed(starts):
            follow = context[start + n: start + n + max_tokens].tolist()
            if follow and follow not in found:
                found.append(follow)
                if len(found) == branches:
                    break
        if found:
            return n, found
    return 0, []
