"""Greedy chain speculative decoding: prefill, then draft → verify → accept until done.

Each iteration drafts ``depth`` tokens with the draft head, checks them with ONE target
forward, keeps the longest agreeing prefix plus the target's own next token (the bonus),
and rolls both caches back to what was accepted. The output is token for token what
``target.generate(do_sample=False)`` gives: every kept token is the target's argmax
after the accepted prefix (floating-point ties aside: the target scores d+1 positions in
one forward instead of one by one).

Batch size 1 only, for now: rows accept different numbers of tokens, so batched decoding
needs ragged caches (per-row lengths, position ids and attention masks for the target,
per-row anchors for the draft), and ``DynamicCache.crop`` cuts every row alike.

Positions: tokens x_0..x_{n-1} are accepted (prompt included). The target cache holds
0..n-2; the draft cache holds anchors 0..n-2 and the chain starts at anchor t = n-2.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import DynamicCache

from ..models.draft_head import DraftHead
from .accept import accept_greedy
from .draft_step import DraftState, draft_chain, draft_extend
from ..data.features import LayerCapture
from .target_step import crop_cache, target_prefill, verify

__all__ = ["GenerationResult", "Session", "prefill", "draft_chain", "verify", "accept", "generate"]


@dataclass
class Session:
    """Everything one sequence's decoding carries between iterations."""

    capture: LayerCapture
    target_cache: DynamicCache  # positions 0..length-2
    draft_state: DraftState
    last_token: torch.Tensor  # [1, 1] x_{n-1}: accepted, not yet run through the target
    length: int  # n, accepted tokens including the prompt


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens, prompt excluded, cut at EOS / max_new_tokens
    accept_lengths: list[int] = field(default_factory=list)  # τ per verify: accepted drafts + 1
    target_forwards: int = 0  # prefill included (it yields one token, like plain decoding)
    wall_time: float = 0.0  # seconds

    @property
    def mean_acceptance(self) -> float:
        """Mean τ = new tokens / target forwards (1.0 for plain greedy decoding)."""
        return len(self.tokens) / max(self.target_forwards, 1)


def _as_prompt(prompt_ids, device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"one non-empty prompt is supported (batch 1), got shape {tuple(ids.shape)}")
    return ids


def prefill(target, draft: DraftHead, prompt_ids, layer_ids: Sequence[int] | None = None) -> Session:
    """Run the target over the prompt [1, P] (-> its next token x_P) and the draft's step 0
    over anchors 0..P-1 (tokens x_1..x_P), filling both caches and the pool."""
    prompt = _as_prompt(prompt_ids, draft.fc.weight.device)
    capture = LayerCapture(target, layer_ids or draft.cfg.aux_layer_ids or None)
    if capture.aux_size != draft.fc.in_features:
        raise ValueError(f"the draft's fc reads {draft.fc.in_features} features, "
                         f"layers {capture.layer_ids} of the target give {capture.aux_size}")
    cache, next_token, aux = target_prefill(target, capture, prompt)
    state = DraftState(draft, capacity=2 * prompt.shape[1] + 64)
    draft_extend(draft, state, aux, torch.cat([prompt[:, 1:], next_token], dim=1), start=0)
    return Session(capture, cache, state, next_token, prompt.shape[1] + 1)


def accept(draft: DraftHead, session: Session, draft_tokens: torch.Tensor, target_argmax: torch.Tensor,
           aux: torch.Tensor) -> torch.Tensor:
    """Keep the agreeing prefix + bonus -> new tokens [1, k+1]; crop the target cache to
    the accepted positions and run draft step 0 on them with the target's own features."""
    k, bonus = accept_greedy(draft_tokens, target_argmax)
    k = int(k[0])
    new = torch.cat([draft_tokens[:, :k], bonus[:, None]], dim=1)
    start = session.length - 1  # position of the token verify started from
    crop_cache(session.target_cache, start + k + 1)  # that token and the k accepted drafts
    draft_extend(draft, session.draft_state, aux[:, : k + 1], new, start)
    session.last_token, session.length = bonus[:, None], session.length + k + 1
    return new


def _eos_ids(target, eos_ids) -> set[int]:
    if eos_ids is None:  # what target.generate would stop at
        eos_ids = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos_ids is None:
        return set()
    return {int(eos_ids)} if isinstance(eos_ids, int) else {int(e) for e in eos_ids}


def _finish(tokens: list[int], eos: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut after the first EOS and at max_new_tokens; True when generation is over."""
    for i, tok in enumerate(tokens[:max_new_tokens]):
        if tok in eos:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


def generate(target, draft: DraftHead, prompt_ids, max_new_tokens: int, depth: int,
             eos_ids: int | Sequence[int] | None = None, layer_ids: Sequence[int] | None = None) -> GenerationResult:
    """Greedy speculative decoding of one prompt ([P] or [1, P] ids).

    ``eos_ids``: stop after any of these (None: the target's ``generation_config``, as
    ``target.generate`` does; ``()``: never). ``layer_ids``: the target layers the draft
    was trained on (None: ``draft.cfg.aux_layer_ids``, else ``default_layer_ids``). The
    last iteration may accept past ``max_new_tokens``; the surplus is cut."""
    if max_new_tokens < 1 or depth < 0:
        raise ValueError(f"need max_new_tokens >= 1 and depth >= 0, got {max_new_tokens}, {depth}")
    eos = _eos_ids(target, eos_ids)
    begin = time.perf_counter()
    with torch.inference_mode():
        session = prefill(target, draft, prompt_ids, layer_ids)
        result = GenerationResult(tokens=[int(session.last_token)], target_forwards=1)
        result.tokens, done = _finish(result.tokens, eos, max_new_tokens)
        while not done:
            drafted, _ = draft_chain(draft, session.draft_state, depth)
            argmax, aux = verify(target, session.capture, session.target_cache, session.last_token, drafted)
            new = accept(draft, session, drafted, argmax, aux)
            result.target_forwards += 1
            result.accept_lengths.append(new.shape[1])
            result.tokens, done = _finish(result.tokens + new[0].tolist(), eos, max_new_tokens)
    result.wall_time = time.perf_counter() - begin
    return result
