"""Sampling stays lossless: warping as transformers does, and rejection of point-mass
candidates that leaves the target's distribution exactly as it was (statistical tests)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from lyanna_train.runtime.scheduling.scheduler import BatchDecoder, generate
from lyanna_train.runtime.settings import DecodeSettings, LookupSettings, TreeShape, SamplingParams
from lyanna_train.runtime.verification.sampling import accept_tree_sampling, warp_probs
from lyanna_train.runtime.token_tree import TokenTree

from .conftest import LAYER_IDS, make_draft


@pytest.mark.parametrize("params", [SamplingParams(0.7), SamplingParams(1.3, top_k=5), SamplingParams(0.9, top_p=0.8),
                                    SamplingParams(1.0, top_k=20, top_p=0.5)])
def test_warping_equals_transformers(params):
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    scores = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    torch.testing.assert_close(warp_probs(logits, params), scores.double().softmax(-1), atol=1e-6, rtol=1e-5)


def _within_noise(counts: torch.Tensor, probs: torch.Tensor, trials: int) -> None:
    """Every empirical frequency within 5 standard deviations of its exact probability
    (accepting candidates greedily instead would put ~0.4 of p(x1)'s mass on token 1)."""
    sd = (probs * (1 - probs) / trials).sqrt()
    assert ((counts / trials - probs).abs() <= 5 * sd + 1e-3).all(), (counts / trials, probs)


@pytest.mark.slow  # 40,000 trials
def test_rejection_keeps_the_target_distribution_for_any_candidates():
    """Two levels of candidates, some likely, some not: the first two emitted tokens are
    distributed exactly as the target's p(x1) p(x2 | x1)."""
    torch.manual_seed(1)
    v = 6
    p1 = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04], dtype=torch.float64)
    p2 = torch.softmax(torch.randn(v, v, dtype=torch.float64) * 1.5, dim=-1)  # p2[x1] = p(x2 | x1)
    tree = TokenTree.rooted_at(0)
    for path in ([1, 0], [1, 3], [5], [0, 4, 2], [2]):  # a poor first choice (1 is not the mode), a rare one (5)
        tree.add_path(path)
    probs = torch.stack([p1 if node == 0 else p2[tree.tokens[node]] for node in range(len(tree))])
    # what the target would give after each node: p(· | path); depth-2 nodes reuse p2 of their token
    trials, gen = 40000, torch.Generator().manual_seed(0)
    joint = torch.zeros(v, v, dtype=torch.float64)
    first = torch.zeros(v, dtype=torch.float64)
    for _ in range(trials):
        path, nxt = accept_tree_sampling(tree, probs, gen)
        emitted = tree.path_tokens(path[1:]) + [nxt]
        first[emitted[0]] += 1
        if len(emitted) > 1:  # x1 was an accepted node: x2 then follows p(x2 | x1)
            joint[emitted[0], emitted[1]] += 1
    _within_noise(first, p1, trials)
    # given x1, the second token follows p2[x1] (checked where enough samples landed)
    for x1 in range(v):
        n = int(joint[x1].sum())
        if n > 2000:
            _within_noise(joint[x1], p2[x1], n)


def test_all_mass_on_a_candidate_always_accepts_it():
    tree = TokenTree.rooted_at(0)
    tree.add_path([3])
    probs = torch.zeros(2, 5, dtype=torch.float64)
    probs[0, 3] = 1.0
    probs[1, 2] = 1.0
    assert accept_tree_sampling(tree, probs) == ([0, 1], 2)


@pytest.mark.slow  # 1,500 sampled requests
@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no-pool"])
def test_speculative_sampling_matches_the_targets_next_two_tokens(tiny_target, pool):
    """End to end on the tiny Llama: the first two sampled tokens of speculative decoding
    (a draft tree plus lookup candidates, every node verified) against the exact target
    distribution; requests decoded 16 rows at a time, each with its own seed, as
    ``generate`` decodes one (a batch of one through the same scheduler)."""
    prompt = [1, 17, 200, 5, 99, 42, 7, 130, 17, 200]
    params = SamplingParams(temperature=1.0, top_k=8)
    with torch.inference_mode():
        logits = tiny_target(torch.tensor([prompt])).logits[0, -1]
    p1 = warp_probs(logits, params)
    settings = DecodeSettings(TreeShape(2, 2, 2, 4), LookupSettings(3, pool_tokens=0), params, verify="all")
    decoder = BatchDecoder(tiny_target, make_draft(tiny_target, pool), settings, max_batch=16, eos_ids=(),
                           layer_ids=LAYER_IDS)
    trials = 1500
    requests = [decoder.submit(prompt, 2, params, seed=s) for s in range(trials)]
    for _ in decoder.run():
        pass
    first = torch.zeros_like(p1)
    for r in requests:
        first[r.tokens[0]] += 1
    _within_noise(first, p1, trials)
    # the second token, given the first, for the most common first token
    top = int(p1.argmax())
    with torch.inference_mode():
        p2 = warp_probs(tiny_target(torch.tensor([prompt + [top]])).logits[0, -1], params)
    second = torch.zeros_like(p2)
    for r in requests:
        if r.tokens[0] == top:
            second[r.tokens[1]] += 1
    n = int(second.sum())
    assert n > 100
    _within_noise(second, p2, n)
    assert sum(a > 1 for r in requests for a in r.accept_lengths) > 0  # candidates were accepted, not only roots


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sampling_on_a_gpu_target_draws_with_generators_on_the_gpu(tiny_target):
    """Each row's seeded generator is made on the target's device: torch samples CUDA tensors
    with CUDA generators only (a host one raises)."""
    import copy

    target = copy.deepcopy(tiny_target).cuda()
    draft = make_draft(target, pool=True).cuda()
    settings = DecodeSettings(TreeShape(2, 2, 2, 4), LookupSettings(3, pool_tokens=2), SamplingParams(1.0, top_k=8),
                              seed=7, verify="all")
    prompt = [1, 17, 200, 5, 99, 42, 7, 130, 17, 200]
    runs = [generate(target, draft, prompt, 12, settings, eos_ids=(), layer_ids=LAYER_IDS).tokens for _ in range(2)]
    assert len(runs[0]) == 12 and runs[0] == runs[1]  # the request's seed fixes its tokens
    tree = TokenTree.rooted_at(0)
    tree.add_path([3])
    probs = torch.full((2, 5), 0.2, dtype=torch.float64, device="cuda")
    path, token = accept_tree_sampling(tree, probs, torch.Generator("cuda").manual_seed(0))
    assert path[0] == 0 and 0 <= token < 5
