"""A run fitted to a time budget on this machine, and ``auto`` precision."""

from __future__ import annotations

import json

import pytest
import torch

from lyanna_train.errors import LyannaError
from lyanna_train.target import precision
from lyanna_train.training import budget
from lyanna_train.training.budget import Costs
from lyanna_train.training.loop import resolve_auto_precision, train
from lyanna_train.training.setup import build_parts, training_samples

from .conftest import compose, tiny_overrides

TINY = ("target.aux_layers=[0,1,2]",)


def _cfg(tmp_path, tiny_target_dir, tiny_corpus, *extra):
    return compose(tiny_overrides(tiny_target_dir, tiny_corpus, tmp_path / "run", *TINY, *extra))


@pytest.mark.slow
def test_fit_is_the_budget_arithmetic(tmp_path, tiny_target_dir, tiny_corpus):
    cfg = _cfg(tmp_path, tiny_target_dir, tiny_corpus, "train.time_budget_min=10", "train.epochs=3",
               "data.max_samples=1000", "eval.num_prompts=4", "eval.max_new_tokens=10", "eval.heldout_samples=8")
    costs = Costs(feature=0.01, train=0.002, decode=0.5)
    fit = budget.fit(cfg, costs, tokens_per_sample=100, heldout_tokens=800)
    # fixed: held-out 800 * 0.01 = 8 s, evaluation 4 * 10 * 0.5 * 2 = 40 s, loading 45 s
    per_sample = 100 * (0.01 + 3 * 0.002)  # 1.6 s
    evaluation = 4 * 10 * 0.5 * budget.EVAL_PER_DECODE
    assert fit.samples == int((600 - 8 - evaluation - budget.FIXED_S) / per_sample)
    assert sum(fit.minutes.values()) == pytest.approx((fit.samples * per_sample + 8 + evaluation + 45) / 60)
    assert fit.wanted_minutes == pytest.approx((1000 * per_sample + 8 + evaluation + 45) / 60)
    assert "of 1000 samples fit" in fit.describe(10, 1000)
    # what set-up already took (hot vocabulary, this measurement) comes out of the same budget
    later = budget.fit(cfg, costs, tokens_per_sample=100, heldout_tokens=800, spent=160)
    assert later.samples == int((600 - 160 - 8 - evaluation - budget.FIXED_S) / per_sample)
    assert later.minutes["set-up so far"] == pytest.approx(160 / 60)
    # a generous budget keeps the configured data, never more
    roomy = _cfg(tmp_path, tiny_target_dir, tiny_corpus, "train.time_budget_min=10000", "data.max_samples=50")
    assert budget.fit(roomy, costs, 100, 800).samples == 50
    # nothing fits: one line that says what to change
    tight = _cfg(tmp_path, tiny_target_dir, tiny_corpus, "train.time_budget_min=0.5", "data.max_samples=50",
                 "eval.num_prompts=4", "eval.max_new_tokens=10")
    with pytest.raises(LyannaError, match="not even one sample fits"):
        budget.fit(tight, costs, 100, 800)


@pytest.mark.slow
def test_measured_costs_and_the_decision_kept_for_a_resume(tmp_path, tiny_target_dir, tiny_corpus, monkeypatch):
    out = tmp_path / "run"
    cfg = _cfg(tmp_path, tiny_target_dir, tiny_corpus, "train.time_budget_min=2", "data.max_samples=5000",
               "eval.num_prompts=1")
    parts = build_parts(cfg, out, True)
    samples = training_samples(cfg, parts.tokenizer)
    lines = []
    n = budget.budgeted_samples(cfg, parts, samples, out, 0, lines.append)
    assert 1 <= n < 5000  # the tiny corpus at these speeds: far more than 2 minutes for 5,000 samples
    record = json.loads((out / "budget.json").read_text())
    assert record == {"time_budget_min": 2, "max_samples": 5000, "samples": n}
    assert "of 5000 samples fit" in lines[0] and "measured here: features" in lines[0]
    # a second start reuses the decision instead of measuring again
    monkeypatch.setattr(budget, "measure", lambda *a: pytest.fail("measured again"))
    assert budget.budgeted_samples(cfg, parts, samples, out, 0, lines.append) == n
    assert "as decided when this run started" in lines[-1]
    monkeypatch.undo()
    # the costs are real timings of this machine's parts
    batch = [s for _, s in zip(range(2), samples)]
    costs = budget.measure(parts, batch, cfg)
    assert all(0 < v < 10 for v in (costs.feature, costs.train, costs.decode))


@pytest.mark.slow  # a full train() run
def test_a_budgeted_run_trains_on_what_fits(tmp_path, tiny_target_dir, tiny_corpus, monkeypatch):
    monkeypatch.setattr(budget, "measure", lambda *a: Costs(feature=0.004, train=0.004, decode=0.001))
    out = tmp_path / "run"
    # 75 s minus 45 s of fixed costs and the set-up so far (a few seconds) leaves ~25 s; a sample
    # costs its ~128 tokens x 0.016 s: ~12 of the tiny corpus's ~25 samples
    cfg = _cfg(tmp_path, tiny_target_dir, tiny_corpus, "train.time_budget_min=1.25", "data.max_samples=400",
               "train.epochs=3", "eval.num_prompts=0", "eval.heldout_samples=0")
    result = train(cfg)
    samples = json.loads((out / "budget.json").read_text())["samples"]
    assert 3 <= samples <= 15  # of the tiny corpus's ~25
    manifest = json.loads((out / "features" / "manifest.json").read_text())
    assert manifest["totals"]["samples"] == samples  # the features cover exactly the samples that fit
    assert result["step"] >= 1
    assert cfg.data.max_samples == 400  # the count was passed on, the config left as it was
    record = json.loads((out / "checkpoints" / f"step-{result['step']:08d}" / "run.json").read_text())
    assert record["config"]["data"]["max_samples"] == samples  # run.json says what was trained


def test_the_sample_count_is_returned_and_the_config_left_alone(tmp_path, tiny_target_dir, tiny_corpus, monkeypatch):
    plain = _cfg(tmp_path, tiny_target_dir, tiny_corpus, "data.max_samples=50")
    assert budget.sample_count(plain, None, None, tmp_path, 0, print) == 50  # no budget: the configured count
    budgeted = _cfg(tmp_path, tiny_target_dir, tiny_corpus, "train.time_budget_min=10", "data.max_samples=50")
    monkeypatch.setattr(budget, "within_budget", lambda *a, **k: 7)
    assert budget.sample_count(budgeted, None, [], tmp_path, 0, print) == 7
    assert budgeted.data.max_samples == 50


def test_auto_precision_follows_the_machine(tmp_path, tiny_target_dir, tiny_corpus):
    native = precision.native_bf16("cpu")
    assert native == (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    assert precision.resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
    assert precision.resolve_autocast("auto", "cpu") == ("bfloat16" if native else None)
    assert precision.resolve_dtype("float16", "cpu") == "float16"  # explicit values are kept
    assert precision.resolve_autocast(None, "cpu") is None
    assert precision.describe("train.autocast", "bfloat16", "bfloat16") is None
    cfg = _cfg(tmp_path, tiny_target_dir, tiny_corpus, "target.dtype=auto", "train.autocast=auto")
    lines = []
    resolve_auto_precision(cfg, lines.append)
    assert cfg.target.dtype == precision.resolve_dtype("auto") and cfg.train.autocast == precision.resolve_autocast("auto")
    assert lines[0].startswith("target.dtype=auto -> ") and lines[1].startswith("train.autocast=auto -> ")
    if not native:
        assert "no native bf16 on this cpu" in lines[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_parts_and_the_measurement_run_there(tmp_path, tiny_target_dir, tiny_corpus):
    """build_parts puts the target and the draft on the rank's GPU (the draft's embeddings stay
    the target's own table), and the budget's measurement feeds them samples made on the host."""
    cfg = _cfg(tmp_path, tiny_target_dir, tiny_corpus, "draft.aux_scale=true", "draft.target_init.fc=top_layer")
    parts = build_parts(cfg, tmp_path / "run", True)
    device = parts.target.device
    assert device.type == "cuda" and parts.lm_weight.device == device
    assert all(t.device == device for t in (*parts.draft.parameters(), *parts.draft.buffers()))
    assert parts.draft.embed_weight.data_ptr() == parts.target.get_input_embeddings().weight.data_ptr()
    batch = [s for _, s in zip(range(2), training_samples(cfg, parts.tokenizer))]
    costs = budget.measure(parts, batch, cfg)
    assert all(0 < v < 10 for v in (costs.feature, costs.train, costs.decode))
