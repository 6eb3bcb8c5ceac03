"""Sampling through the batched runtime stays exact per row: rows with different
temperatures (and greedy rows) share every fused verify forward, and each row's first two
tokens follow its own warped target distribution (statistical test, as test_sampling.py)."""

from __future__ import annotations

import pytest
import torch

from lyanna_train.runtime.drafting import propose
from lyanna_train.runtime.scheduling.scheduler import BatchDecoder
from lyanna_train.runtime.settings import DecodeSettings, LookupSettings, SamplingParams, TreeShape
from lyanna_train.runtime.verification.sampling import warp_probs

from .conftest import LAYER_IDS, greedy_reference, make_draft
from .test_sampling import _within_noise

PROMPT = [1, 17, 200, 5, 99, 42, 7, 130, 17, 200]
K = 8  # top_k: the support of every row's first token, so p(x2 | x1) is needed for K prefixes only
GROUPS = {"cold": SamplingParams(0.6, top_k=K), "hot": SamplingParams(1.5, top_k=K)}
NO_LOOKUP = LookupSettings(max_tokens=0, pool_tokens=0)  # the defaults propose lookup and pool candidates


def _next_logits(target, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return target(torch.tensor([ids])).logits[0, -1]


def _likely_oracle(decoder, follow: dict[int, list[int]]):
    """A stand-in for the batched draft: below each row's first token x1, the target's most
    likely next tokens in a poor order (2nd, 1st, 4th), one of them with a child, so
    candidates are accepted often, rejected often, and accepted two deep."""

    def draft_trees(draft, state, rows, trees, shape):
        for row, tree in zip(decoder.rows[rows], trees):
            if tree is None:  # not drafting this iteration
                continue
            likely = follow[row.last_token]
            nodes = [tree.add(0, likely[i], 0.3) for i in (1, 0, 3)]  # the chances a verify weighs
            tree.add(nodes[1], likely[2], 0.1)
        return [[] for _ in trees]

    return draft_trees


@pytest.mark.slow  # ~3,000 sampled requests
@pytest.mark.parametrize("policy", ["all", "every-other-row"])
def test_rows_with_different_temperatures_keep_their_own_distributions(tiny_target, monkeypatch, policy):
    """``every-other-row``: the speculation policy drafts for every other row (the others
    verify their own token only), rows of both kinds in every fused forward."""
    logits1 = _next_logits(tiny_target, PROMPT)
    support = torch.topk(logits1, K).indices.tolist()
    logits2 = {x1: _next_logits(tiny_target, PROMPT + [x1]) for x1 in support}
    follow = {x1: torch.topk(l, 4).indices.tolist() for x1, l in logits2.items()}
    # exact joint law of (x1, x2) per temperature: p(x1) p(x2 | x1)
    joint = {}
    for name, params in GROUPS.items():
        p1 = warp_probs(logits1, params)
        joint[name] = torch.stack([p1[x1] * warp_probs(logits2[x1], params) if x1 in logits2 else
                                   torch.zeros_like(p1) for x1 in range(p1.shape[0])])

    settings = DecodeSettings(TreeShape(1, 1, 1, 1), NO_LOOKUP, verify="all" if policy == "all" else "auto")
    decoder = BatchDecoder(tiny_target, make_draft(tiny_target, True), settings, max_batch=12, eos_ids=(),
                           layer_ids=LAYER_IDS)
    monkeypatch.setattr(propose, "draft_trees", _likely_oracle(decoder, follow))
    monkeypatch.setattr(propose, "choose_drafting", lambda free, *_, **__: [i % 2 == 0 for i in range(len(free))])
    trials = 1500
    requests = {name: [] for name in (*GROUPS, "greedy")}
    for i in range(trials):  # interleaved: every fused forward mixes both temperatures and a greedy row
        for name, params in GROUPS.items():
            requests[name].append(decoder.submit(PROMPT, 2, params, seed=i))
        if i % 25 == 0:
            requests["greedy"].append(decoder.submit(PROMPT, 2, SamplingParams(), seed=i))
    accepted = 0
    for _ in decoder.run():
        pass
    greedy = greedy_reference(tiny_target, PROMPT, 2)
    assert all(r.tokens == greedy for r in requests["greedy"])
    for name in GROUPS:
        counts = torch.zeros_like(joint[name])
        for r in requests[name]:
            assert len(r.tokens) == 2 and r.tree_sizes[0] in ((5,) if policy == "all" else (1, 5))
            counts[r.tokens[0], r.tokens[1]] += 1
            accepted += r.accept_lengths[0] > 1
        _within_noise(counts.flatten(), joint[name].flatten(), trials)
    share = 1.0 if policy == "all" else 0.5  # the rows whose candidates were verified
    assert 0.2 * share * len(GROUPS) * trials < accepted < 0.9 * share * len(GROUPS) * trials  # taken and refused


def test_requests_sampled_with_the_same_seed_agree_and_other_seeds_differ(tiny_target):
    """A request's draws come from its own generator (seeded per request), whatever shares its batch."""
    decoder = BatchDecoder(tiny_target, make_draft(tiny_target, True), DecodeSettings(TreeShape(2, 2, 2, 4),
                           NO_LOOKUP, verify="all"), max_batch=4, eos_ids=(), layer_ids=LAYER_IDS)
    params = SamplingParams(1.0)
    first = [decoder.submit(PROMPT, 12, params, seed=s) for s in (3, 4, 5)]
    for _ in decoder.run():
        pass
    again = decoder.submit(PROMPT, 12, params, seed=3)  # alone this time
    for _ in decoder.run():
        pass
    assert again.tokens == first[0].tokens
    assert len({tuple(r.tokens) for r in first}) == 3
