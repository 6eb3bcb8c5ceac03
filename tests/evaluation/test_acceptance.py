"""mean_acceptance: figures consistent with the runs behind them."""

from __future__ import annotations

import math

import pytest

from lyanna_train.evaluation import acceptance
from lyanna_train.evaluation.acceptance import mean_acceptance
from lyanna_train.runtime.drafting import propose

from ..runtime.conftest import LAYER_IDS, greedy_reference, make_draft, oracle_trees

PROMPTS = [[1, 5, 9, 200, 31], [1, 77, 78]]


def test_random_draft_gives_consistent_figures(tiny_target):
    stats = mean_acceptance(tiny_target, make_draft(tiny_target, True), PROMPTS, depth=3, max_new_tokens=12,
                            layer_ids=LAYER_IDS)
    assert stats["tokens"] == 24
    assert stats["target_forwards"] == stats["iterations"] + len(PROMPTS)
    assert stats["mean_tau"] == pytest.approx(24 / stats["target_forwards"])
    assert 1.0 <= stats["mean_tau_verify"] <= 4.0
    rates = stats["accept_rate"]
    assert len(rates) == 3 and all(0.0 <= r <= 1.0 for r in rates)
    assert all(a >= b for a, b in zip(rates, rates[1:]))
    assert stats["mean_tau_verify"] == pytest.approx(1 + sum(rates))  # E[accepted] = sum_k P(accepted >= k)
    assert stats["wall_time"] > 0


def test_oracle_draft_is_accepted_at_every_depth(tiny_target, monkeypatch):
    depth, new = 3, 13
    fulls = {tuple(p): p + greedy_reference(tiny_target, p, new + depth + 1) for p in PROMPTS}
    current = {}  # the continuation of the prompt being decoded
    real_generate = acceptance.generate

    def generate(target, draft, prompt, *args, **kwargs):
        current["full"] = fulls[tuple(prompt)]
        return real_generate(target, draft, prompt, *args, **kwargs)

    monkeypatch.setattr(propose, "draft_trees", oracle_trees(lambda slot: (current["full"], 0)))
    monkeypatch.setattr(acceptance, "generate", generate)
    stats = mean_acceptance(tiny_target, make_draft(tiny_target, False), PROMPTS, depth, new, layer_ids=LAYER_IDS)
    iterations = math.ceil((new - 1) / (depth + 1))  # 3 per prompt
    assert stats["accept_rate"] == [1.0] * depth and stats["mean_tau_verify"] == depth + 1
    assert stats["target_forwards"] == len(PROMPTS) * (1 + iterations)
    assert stats["mean_tau"] == pytest.approx(len(PROMPTS) * new / stats["target_forwards"])
