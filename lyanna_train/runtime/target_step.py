"""The target's side of chain speculative decoding: prefill, verify, roll back.

The target keeps a transformers ``DynamicCache``. Between iterations it holds every
accepted token but the last one: that token's logits and features come out of the next
:func:`verify`, in the same forward as the drafted tokens that follow it.

The draft consumes the target's "aux" features (the outputs of three decoder layers,
``lyanna_train.data.features``' convention), so every target forward here also captures
them at each position it computes, with forward hooks, with the same :class:`LayerCapture` the feature extractor uses.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch
from transformers import DynamicCache

from ..data.features import LayerCapture


def _cache_kwarg(target) -> str:
    # transformers 5 renamed ``past_key_values`` to ``cache`` (the old name warns).
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def target_forward(target, capture: LayerCapture, cache: DynamicCache, input_ids: torch.Tensor,
                   logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] appended after ``cache`` -> (logits [B, T or logits_to_keep, V],
    aux [B, T, k·H]); the cache grows by T."""
    with capture:
        out = target(input_ids=input_ids, use_cache=True, logits_to_keep=logits_to_keep,
                     **{_cache_kwarg(target): cache})
    return out.logits, capture.aux()


def target_prefill(target, capture: LayerCapture, prompt_ids: torch.Tensor):
    """prompt_ids [B, P] -> (cache holding P positions, next token [B, 1], aux [B, P, k·H]).

    Only the last position's logits are needed: the lm_head over the whole prompt is skipped."""
    cache = DynamicCache(config=target.config)
    logits, aux = target_forward(target, capture, cache, prompt_ids, logits_to_keep=1)
    return cache, logits[:, -1:].argmax(-1), aux


def verify(target, capture: LayerCapture, cache: DynamicCache, last_token: torch.Tensor,
           draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ONE target forward over [last accepted token, d drafted tokens].

    last_token [B, 1], draft_tokens [B, d] (target ids) -> (target argmax [B, d+1],
    aux [B, d+1, k·H]). argmax[:, i] is the target's greedy token after input i, so it
    is compared with drafted token i+1; the cache grows by d+1 (see :func:`crop_cache`)."""
    ids = torch.cat([last_token, draft_tokens], dim=1)
    logits, aux = target_forward(target, capture, cache, ids)
    return logits.argmax(-1), aux


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Drop cached positions >= ``length`` (the rejected drafted tokens)."""
    excess = cache.get_seq_length() - length
    if excess < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
    if excess:
        cache.crop(-excess)  # a negative count removes that many (the only form transformers 5 accepts)


def verify_tree(target, capture: LayerCapture, cache: DynamicCache, tokens: torch.Tensor, depths: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ONE target forward over a token tree appended after ``cache``.

    tokens, depths [1, N] (node 0 is the last accepted token, depth 0), mask
    [1, 1, N, past + N] bool (``tree.attention_mask``) -> (logits [1, N, V], aux [1, N, k·H]):
    each node is scored after the path to it. The cache grows by N in node order (see
    :func:`keep_cache_positions`)."""
    past = cache.get_seq_length()
    with capture:
        out = target(input_ids=tokens, position_ids=past + depths, attention_mask=mask, use_cache=True,
                     **{_cache_kwarg(target): cache})
    return out.logits, capture.aux()


def keep_cache_positions(cache: DynamicCache, past: int, kept: list[int]) -> None:
    """After a tree verify: keep positions 0..past-1 and then tree nodes ``kept`` (offsets
    from ``past``, increasing), so the cache holds the accepted path in order."""
    if kept == list(range(len(kept))):  # a prefix (always the case for chains): a crop is enough
        crop_cache(cache, past + len(kept))
        return
    index = torch.cat([torch.arange(past), past + torch.tensor(kept)])
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, index.to(layer.keys.device))
        layer.values = layer.values.index_select(-2, index.to(layer.values.device))
