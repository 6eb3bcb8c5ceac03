"""Speculative decoding of one prompt: prefill, then propose → verify → accept until done.

Each iteration builds a token tree below the last accepted token from the draft head
(:mod:`.draft_tree`) and from prompt lookup (:mod:`.prompt_lookup`), scores every node
with ONE target forward under a tree attention mask, keeps the path the target agrees
with (greedy: its argmax; sampling: rejection, :mod:`.sampling`) plus the target's own
next token, and rolls both caches to that path. Greedy output is token for token what
``target.generate(do_sample=False)`` gives (floating-point ties aside: the target scores
many positions in one forward instead of one by one); sampled output has exactly the
target's distribution.

One sequence, on transformers' ``DynamicCache``; many at once (rows accepting different
numbers of tokens, so ragged caches) are :mod:`.scheduler`'s.

Positions: tokens x_0..x_{n-1} are accepted (prompt included). The target cache holds
0..n-2; the draft cache holds anchors 0..n-2 and drafting starts at anchor n-2.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from transformers import DynamicCache

from ..models.draft_head import DraftHead
from ..target.capture import LayerCapture
from .cost import POOL, AcceptanceEstimates, VerifyCost, best_count
from .draft_step import DraftState, draft_extend
from .draft_tree import TreeShape, draft_tree
from .pool_lookup import pool_continuation
from .prompt_lookup import lookup_continuations
from .sampling import SamplingParams, accept_tree_sampling, warp_probs
from .target_step import check_target_masks, draft_capture, keep_cache_positions, target_forward, verify_tree
from .tree import TokenTree, accept_greedy_tree, attention_mask


@dataclass(frozen=True)
class LookupSettings:
    """Prompt-lookup candidates beside the draft's (max_tokens 0 = off)."""

    max_tokens: int = 0  # continuation length proposed
    max_ngram: int = 3  # longest context suffix matched
    branches: int = 1  # distinct continuations (most recent matches first)
    pool_tokens: int = 0  # continuation after the most similar pooled draft state (0 = off; :mod:`.pool_lookup`)


@dataclass(frozen=True)
class FusionSettings:
    """How the batched runtime (:mod:`.scheduler`) fuses verification; batch 1 ignores it."""

    micro_batches: int = 1  # 1: verify every running row every iteration; k > 1: hold until k blocks are drafted
    shallow_first: bool = False  # under the fused token budget, admit nodes by depth before probability
    # after a fused verify that takes no candidate at all, skip the draft tree for 1, 2, 4 ...
    # iterations, at most this many (0: draft every iteration): :class:`.batch_step.DraftBackoff`
    draft_backoff: int = 8

    def __post_init__(self):
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {self.micro_batches}")
        if self.draft_backoff < 0:
            raise ValueError(f"draft_backoff must be 0 or more, got {self.draft_backoff}")


@dataclass(frozen=True)
class DecodeSettings:
    tree: TreeShape = TreeShape()
    lookup: LookupSettings = LookupSettings()
    sampling: SamplingParams = SamplingParams()
    seed: int = 0  # of the sampling generator
    # "auto": verify the candidates that maximise expected tokens per second of measured
    # target time (:mod:`.cost`); "all": verify every candidate
    verify: str = "auto"
    fusion: FusionSettings = FusionSettings()  # last: positional callers keep their meaning

    def __post_init__(self):
        if self.verify not in ("auto", "all"):
            raise ValueError(f"verify must be 'auto' or 'all', not {self.verify!r}")


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens, prompt excluded, cut at EOS / max_new_tokens
    accept_lengths: list[int] = field(default_factory=list)  # τ per verify: accepted candidates + 1
    target_forwards: int = 0  # prefill included (it yields one token, like plain decoding)
    wall_time: float = 0.0  # seconds
    tree_sizes: list[int] = field(default_factory=list)  # nodes verified per forward, root included

    @property
    def mean_acceptance(self) -> float:
        """Mean τ = new tokens / target forwards (1.0 for plain decoding)."""
        return len(self.tokens) / max(self.target_forwards, 1)


@dataclass
class Session:
    """Everything one sequence's decoding carries between iterations."""

    capture: LayerCapture | None  # None without a draft: no features needed
    target_cache: DynamicCache  # positions 0..n-2
    draft_state: DraftState | None
    context: torch.Tensor  # [capacity] ids x_0..x_{n-1} in the first n slots (prompt lookup reads it)
    length: int  # n
    generator: torch.Generator
    cost: VerifyCost
    estimates: AcceptanceEstimates = field(default_factory=AcceptanceEstimates)

    @property
    def last_token(self) -> int:
        return int(self.context[self.length - 1])

    def append(self, tokens: list[int]) -> None:
        while self.length + len(tokens) > self.context.shape[0]:
            self.context = torch.cat([self.context, torch.zeros_like(self.context)])
        self.context[self.length:self.length + len(tokens)] = torch.tensor(tokens)
        self.length += len(tokens)


def _as_prompt(prompt_ids, device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"one non-empty prompt is supported (batch 1), got shape {tuple(ids.shape)}")
    return ids


def _next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(warp_probs(logits, params), 1, generator=generator))


def prefill(target, draft: DraftHead | None, prompt_ids, settings: DecodeSettings,
            layer_ids: Sequence[int] | None = None, cost: VerifyCost | None = None) -> Session:
    """Run the target over the prompt [1, P] (-> its next token x_P) and the draft's step 0
    over anchors 0..P-1 (tokens x_1..x_P), filling both caches and the pool."""
    prompt = _as_prompt(prompt_ids, target.device)
    check_target_masks(target)
    capture = draft_capture(target, draft, layer_ids)
    cache = DynamicCache(config=target.config)
    logits, aux = target_forward(target, capture, cache, prompt, logits_to_keep=1)
    generator = torch.Generator().manual_seed(settings.seed)
    first = _next_token(logits[0, -1], settings.sampling, generator)
    state = None
    if draft is not None:
        state = DraftState(draft, capacity=2 * prompt.shape[1] + 64)
        draft_extend(draft, state, aux, torch.cat([prompt[:, 1:], torch.tensor([[first]], device=prompt.device)], 1),
                     start=0)
    cost = cost if settings.verify == "auto" and cost is not None else VerifyCost.flat()
    session = Session(capture, cache, state, torch.zeros(2 * prompt.shape[1] + 64, dtype=torch.long),
                      0, generator, cost)
    session.append(prompt[0].tolist() + [first])
    return session


def propose(draft: DraftHead | None, session: Session, settings: DecodeSettings) -> TokenTree:
    """The candidates of one iteration, as a tree below the last accepted token."""
    tree = TokenTree.rooted_at(session.last_token)
    estimates = session.estimates
    if draft is not None:
        estimates.calibrate_draft(tree, draft_tree(draft, session.draft_state, tree, settings.tree))
    add_free_candidates(tree, session.context, session.length, settings.lookup, estimates,
                        session.draft_state if draft is not None else None,
                        draft.cfg.pool_threshold if draft is not None else 0.0)
    if settings.verify == "auto":
        tree = tree.best(best_count(sorted(tree.probs[1:], reverse=True), session.cost))
    return tree


def add_free_candidates(tree: TokenTree, context: torch.Tensor, length: int, lookup: LookupSettings,
                        estimates: AcceptanceEstimates, draft_state=None, pool_threshold: float = 0.0) -> None:
    """Add prompt-lookup and pool continuations below the root of ``tree``, each with its
    learned acceptance estimate. context [≥ length]: the accepted ids; ``draft_state``
    (a :class:`.draft_step.DraftState`, or one row of a batch's) gives the pool, None: no
    pool candidates."""
    if lookup.max_tokens:
        n, found = lookup_continuations(context[:length], lookup.max_tokens, lookup.max_ngram,
                                        branches=lookup.branches)
        for follow in found:
            tree.add_path(follow, estimates.lookup_probs(n, len(follow)))
        estimates.proposed_lookup(n, found[0] if found else [])
    if lookup.pool_tokens and draft_state is not None:
        follow = pool_continuation(draft_state, context, length, lookup.pool_tokens, pool_threshold)
        if follow:
            tree.add_path(follow, estimates.lookup_probs(POOL, len(follow)))
        estimates.proposed_lookup(POOL, follow)


def verify(target, session: Session, tree: TokenTree) -> tuple[torch.Tensor, torch.Tensor]:
    """Score every node of ``tree`` in one target forward -> (logits [N, V], aux [1, N, k·H])."""
    device = target.device
    past = session.target_cache.get_seq_length()
    # one node sees everything cached: no mask (SDPA's mask-free path is ~1 ms faster here)
    mask = attention_mask(tree.parents, past, device) if len(tree) > 1 else None
    logits, aux = verify_tree(target, session.capture, session.target_cache,
                              torch.tensor([tree.tokens], device=device), torch.tensor([tree.depths], device=device), mask)
    return logits[0], aux


def accept(draft: DraftHead | None, session: Session, tree: TokenTree, logits: torch.Tensor, aux: torch.Tensor,
           params: SamplingParams) -> list[int]:
    """Choose the accepted path and the next token, roll both caches to it -> new tokens."""
    if params.greedy:
        path, bonus = accept_greedy_tree(tree, logits.argmax(-1).tolist())
    else:
        path, bonus = accept_tree_sampling(tree, warp_probs(logits, params), session.generator)
    new = tree.path_tokens(path[1:]) + [bonus]
    session.estimates.update(tree, new)
    start = session.length - 1  # position of the root
    keep_cache_positions(session.target_cache, start, path)
    if draft is not None:
        draft_extend(draft, session.draft_state, aux[:, path], torch.tensor([new], device=aux.device), start)
    session.append(new)
    return new


def stop_ids(target, eos_ids) -> set[int]:
    if eos_ids is None:  # what target.generate would stop at
        eos_ids = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos_ids is None:
        return set()
    return {int(eos_ids)} if isinstance(eos_ids, int) else {int(e) for e in eos_ids}


def cut(tokens: list[int], eos: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut after the first EOS and at max_new_tokens; True when generation is over."""
    for i, tok in enumerate(tokens[:max_new_tokens]):
        if tok in eos:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


def generate(target, draft: DraftHead | None, prompt_ids, max_new_tokens: int, settings: DecodeSettings = DecodeSettings(),
             eos_ids: int | Sequence[int] | None = None, layer_ids: Sequence[int] | None = None,
             on_tokens: Callable[[list[int]], None] | None = None, cost: VerifyCost | None = None) -> GenerationResult:
    """Speculative decoding of one prompt ([P] or [1, P] ids).

    ``draft`` None: prompt lookup only (or plain decoding). ``eos_ids``: stop after any of
    these (None: the target's ``generation_config``, as ``target.generate`` does; ``()``:
    never). ``layer_ids``: the target layers the draft was trained on (None: the draft's
    ``aux_layer_ids``, else ``default_layer_ids``). ``on_tokens`` receives each
    iteration's new tokens (streaming). ``cost``: the target's forward time per token
    count, which ``verify: auto`` weighs candidates against (:func:`.cpu_tuning.tune`
    measures it); None counts every size alike, so every likely candidate is verified
    (an accelerator's regime). The last iteration may accept past ``max_new_tokens``; the
    surplus is cut."""
    if max_new_tokens < 1:
        raise ValueError(f"need max_new_tokens >= 1, got {max_new_tokens}")
    eos = stop_ids(target, eos_ids)
    begin = time.perf_counter()
    with torch.inference_mode():
        session = prefill(target, draft, prompt_ids, settings, layer_ids, cost)
        result = GenerationResult(tokens=[session.last_token], target_forwards=1)
        result.tokens, done = cut(result.tokens, eos, max_new_tokens)
        _emit(on_tokens, result.tokens)
        while not done:
            tree = propose(draft, session, settings)
            logits, aux = verify(target, session, tree)
            new = accept(draft, session, tree, logits, aux, settings.sampling)
            result.target_forwards += 1
            result.accept_lengths.append(len(new))
            result.tree_sizes.append(len(tree))
            before = len(result.tokens)
            result.tokens, done = cut(result.tokens + new, eos, max_new_tokens)
            _emit(on_tokens, result.tokens[before:])
    result.wall_time = time.perf_counter() - begin
    return result


def _emit(on_tokens, tokens: list[int]) -> None:
    if on_tokens is not None and tokens:
        on_tokens(tokens)
