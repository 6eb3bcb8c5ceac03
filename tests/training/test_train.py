"""Training end to end on a tiny random target: runs, resumes exactly, 2 ranks, bad inputs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from lyanna_train.errors import LyannaError
from lyanna_train.training.loop import train

from .conftest import compose, tiny_overrides

TINY = ("target.aux_layers=[0,1,2]",)


def _clean_env() -> dict:
    """This process's env minus the rendezvous variables an in-process run left behind."""
    return {k: v for k, v in os.environ.items()
            if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")}


def _losses(out) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss/total"] for r in rows if "loss/total" in r}


@pytest.mark.slow  # full train() runs
def test_resume_reproduces_the_uninterrupted_losses(tmp_path, tiny_target_dir, tiny_corpus):
    out = tmp_path / "run"
    cfg = compose(tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, "train.max_steps=6", "train.save_every=3",
                                 "train.keep_last=5", "eval.num_prompts=0"))
    train(cfg)
    full = _losses(out)
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000003", "step-00000006"]
    assert {"model.safetensors", "draft_config.json"} <= {p.name for p in (ckpts / "step-00000006").iterdir()}
    assert "max_steps: 6" in (out / "config.yaml").read_text()  # the resolved config, for exports
    # interrupt after step 3: the last checkpoint and later metrics are gone, and a save was cut short
    shutil.rmtree(ckpts / "step-00000006")
    (ckpts / ".partial-step-00000005").mkdir()
    (ckpts / ".partial-step-00000005" / "junk").write_text("half-written")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(l for l in lines if json.loads(l)["step"] <= 3) + "\n")
    train(cfg)
    resumed = _losses(out)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7), step
    assert not (ckpts / ".partial-step-00000005").exists()


@pytest.mark.slow  # the DeepSpeed launcher, 2 ranks
def test_two_ranks_under_the_deepspeed_launcher(tmp_path, tiny_target_dir, tiny_corpus):
    out = tmp_path / "ds"
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [deepspeed, "--num_gpus", "2", "--master_port", str(29700 + os.getpid() % 200), "--module",
           "lyanna_train.cli.train", *tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, "train.max_steps=3",
                                                      "eval.num_prompts=0")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "on 2 rank(s)" in proc.stdout
    assert sorted(_losses(out)) == [1, 2, 3]
    assert (out / "checkpoints" / "step-00000003" / "model.safetensors").exists()


def test_missing_target_is_one_line(tmp_path, tiny_corpus):
    cfg = compose(tiny_overrides(tmp_path / "no-such-model", tiny_corpus, tmp_path / "out", "eval.num_prompts=0"))
    with pytest.raises(LyannaError, match="no-such-model"):
        train(cfg)


@pytest.mark.slow
def test_mismatched_hot_vocabulary_is_refused(tmp_path, tiny_target_dir, tiny_corpus):
    from lyanna_train.hotvocab.selection import HotVocab
    from lyanna_train.hotvocab.artifact import save_hot_vocab

    save_hot_vocab(tmp_path, HotVocab.from_ids(list(range(100)), 49152), "sha256:" + "1" * 64)
    cfg = compose(tiny_overrides(tiny_target_dir, tiny_corpus, tmp_path / "out", *TINY,
                                 f"hotvocab.path={tmp_path / 'hot-100.safetensors'}", "eval.num_prompts=0"))
    with pytest.raises(LyannaError, match="another tokenizer"):
        train(cfg)


@pytest.mark.slow
def test_data_without_assistant_turns_is_refused(tmp_path, tiny_target_dir):
    from ..conftest import write_jsonl

    corpus = write_jsonl(tmp_path / "users.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 4)
    cfg = compose(tiny_overrides(tiny_target_dir, corpus, tmp_path / "out", *TINY, "hotvocab.full_vocab=true",
                                 "eval.num_prompts=0"))
    with pytest.raises(LyannaError, match="no training sample"):
        train(cfg)


@pytest.mark.slow  # a CLI subprocess
def test_cli_turns_errors_into_one_line(tmp_path, tiny_corpus):
    proc = subprocess.run([sys.executable, "-m", "lyanna_train.cli.train", f"target.name={tmp_path / 'nope'}",
                           f"data.corpus=[{tiny_corpus}]", f"train.out_dir={tmp_path / 'o'}",
                           "tracking.wandb.enabled=false"], capture_output=True, text=True, timeout=300,
                          env=_clean_env())
    assert proc.returncode == 2
    errors = [l for l in proc.stderr.splitlines() if l.startswith("lyanna-train: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr


@pytest.mark.slow  # a full train() run
def test_in_loop_evaluation_logs_acceptance_with_the_runtime(tmp_path, tiny_target_dir, tiny_corpus):
    out = tmp_path / "eval"
    result = train(compose(tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, "train.max_steps=3", "eval.every=2",
                                          "eval.num_prompts=2", "eval.depth=3", "eval.max_new_tokens=8")))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/mean_tau" in r]
    assert [r["step"] for r in evals] == [2, 3]  # every 2 steps, and at the end
    for r in evals:
        assert r["eval/mean_tau"] >= 1.0 and r["eval/tokens"] == 16
        assert [k for k in r if k.startswith("eval/accept_rate_d")] == [f"eval/accept_rate_d{d}" for d in (1, 2, 3)]
    assert result["eval/mean_tau"] == evals[-1]["eval/mean_tau"]


@pytest.mark.slow  # a full train() run
def test_online_features_train_like_cached(tmp_path, tiny_target_dir, tiny_corpus):
    """The online mode runs the target inside the step and sees the same first batch as the cache."""
    losses = {}
    for mode in ("cached", "online"):
        out = tmp_path / mode
        train(compose(tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, "train.max_steps=2", "eval.num_prompts=0",
                                     f"data.features={mode}", f"hotvocab.path={tmp_path / 'cached' / 'hotvocab'}"
                                     if mode == "online" else "hotvocab.path=null")))
        losses[mode] = _losses(out)
    assert not (tmp_path / "online" / "features").exists()
    assert sorted(losses["online"]) == [1, 2]
    # bf16 cached features vs fp32 online features: close, not equal
    assert losses["online"][1] == pytest.approx(losses["cached"][1], rel=0.05)


@pytest.mark.slow  # full train() runs
def test_fp8_features_train_close_to_bf16(tmp_path, tiny_target_dir, tiny_corpus):
    """data.feature_dtype=float8_e4m3fn: the cache holds fp8 (half the bytes), training reads it
    decoded, and the first losses stay within fp8's rounding of bf16's."""
    losses, sizes = {}, {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        out = tmp_path / dtype
        train(compose(tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, "train.max_steps=2", "eval.num_prompts=0",
                                     f"data.feature_dtype={dtype}")))
        losses[dtype] = _losses(out)
        assert json.loads((out / "features" / "manifest.json").read_text())["dtype"] == dtype
        sizes[dtype] = sum(p.stat().st_size for p in (out / "features" / "shards").glob("*.safetensors"))
    assert sizes["float8_e4m3fn"] < 0.56 * sizes["bfloat16"]  # a 64-wide target: 285 against 525 bytes per token
    assert losses["float8_e4m3fn"][1] == pytest.approx(losses["bfloat16"][1], rel=0.02)
    assert losses["float8_e4m3fn"][1] != losses["bfloat16"][1]  # it did read fp8


@pytest.mark.slow  # a full train() run
def test_bf16_target_and_autocast_train_close_to_fp32(tmp_path, tiny_target_dir, tiny_corpus):
    """The CPU recipe's fast path: features from a bf16 target, the draft under bf16 autocast
    (fp32 weights). Same first loss as fp32 up to bf16 rounding; the eval decodes with it."""
    losses = {}
    for name, extra in (("fp32", ()), ("bf16", ("target.dtype=bfloat16", "train.autocast=bfloat16"))):
        out = tmp_path / name
        result = train(compose(tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, "train.max_steps=2",
                                              "eval.num_prompts=1", *extra)))
        losses[name] = _losses(out)
        assert result["eval/mean_tau"] >= 1.0
    assert sorted(losses["bf16"]) == [1, 2]
    assert losses["bf16"][1] == pytest.approx(losses["fp32"][1], rel=0.05)
    assert losses["bf16"][1] != losses["fp32"][1]  # it did run in bf16


def test_unknown_autocast_dtype_is_one_line(tmp_path, tiny_target_dir, tiny_corpus):
    cfg = compose(tiny_overrides(tiny_target_dir, tiny_corpus, tmp_path / "out", *TINY, "train.autocast=int8"))
    with pytest.raises(LyannaError, match=re.escape("train.autocast = 'int8' is not allowed (allowed: one of null")):
        train(cfg)


@pytest.mark.slow  # a full train() run
def test_heldout_agreement_and_the_issue_11_levers_in_a_run(tmp_path, tiny_target_dir, tiny_corpus):
    """Samples after the training range are cached apart and scored teacher-forced; the
    initialisation from the target, TV loss, all-position training and feature noise run end to end."""
    out = tmp_path / "levers"
    result = train(compose(tiny_overrides(
        tiny_target_dir, tiny_corpus, out, *TINY, "train.max_steps=2", "eval.num_prompts=0", "data.max_samples=18",
        "eval.heldout_samples=6", "eval.agreement_steps=2", "draft.target_init.lm_head=true",
        "draft.target_init.layer=3", "draft.target_init.fc=top_layer", "draft.freeze_lm_head=true",
        "loss.tv_weight=0.5", "loss.positions=all", "loss.feature_noise=0.2")))
    held = json.loads((out / "features-heldout" / "manifest.json").read_text())
    train_cache = json.loads((out / "features" / "manifest.json").read_text())
    assert held["totals"]["samples"] == 6 and held["source"]["heldout_from"] == 18
    assert train_cache["totals"]["samples"] <= 18
    for key in ("eval/heldout_top1_step0", "eval/heldout_top1_step1", "eval/train_top1_step0", "eval/top1_gap",
                "eval/heldout_in_hot"):
        assert key in result and 0 <= abs(result[key]) <= 1, key
    assert result["eval/top1_gap"] == pytest.approx(result["eval/train_top1_step0"] - result["eval/heldout_top1_step0"])
    assert (out / "training.png").read_bytes()[:4] == b"\x89PNG"  # the curves, drawn at the end of the run
    from safetensors.torch import load_file

    from lyanna_train.run_record import latest_checkpoint

    weights = load_file(latest_checkpoint(out / "checkpoints") / "model.safetensors")
    target = load_file(next(tiny_target_dir.glob("*.safetensors")))
    emb = target.get("model.embed_tokens.weight")
    hot = weights["d2t"] + torch.arange(len(weights["d2t"]))
    torch.testing.assert_close(weights["lm_head.weight"], emb[hot])  # frozen at its initialisation


def test_a_rank_trains_on_its_local_gpu_where_there_is_cuda(monkeypatch):
    """The target and the draft go where DeepSpeed puts the draft: GPU ``LOCAL_RANK``, else the CPU."""
    from lyanna_train.training import deepspeed_engine

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(deepspeed_engine, "_on_gpu", lambda: True)
    assert deepspeed_engine.rank_device() == torch.device("cuda", 3)
    monkeypatch.setattr(deepspeed_engine, "_on_gpu", lambda: False)
    assert deepspeed_engine.rank_device() == torch.device("cpu")
