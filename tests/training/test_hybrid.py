"""data.features=hybrid: the first epoch's steps compute and write the cache, later epochs read
it, a run killed with SIGKILL resumes correctly, and the cache is cached mode's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lyanna_train.data.feature_cache import FeatureCache, read_entry
from lyanna_train.data.features import FeatureExtractor
from lyanna_train.errors import LyannaError
from lyanna_train.training import loop
from lyanna_train.training.loop import train

from .conftest import compose, tiny_overrides
from .test_train import _clean_env, _losses

pytestmark = pytest.mark.slow  # full train() runs
TINY = ("target.aux_layers=[0,1,2]", "eval.num_prompts=0", "train.epochs=2")
FEATURES = ("aux", "last", "teacher_lse")


def _overrides(target, corpus, out, mode: str, *extra: str) -> list[str]:
    return tiny_overrides(target, corpus, out, *TINY, f"data.features={mode}", *extra)


@pytest.fixture(scope="module")
def cached_run(tmp_path_factory, tiny_target_dir, tiny_corpus):
    out = tmp_path_factory.mktemp("cached") / "run"
    train(compose(_overrides(tiny_target_dir, tiny_corpus, out, "cached")))
    return out


def _events(monkeypatch) -> list[str]:
    """'forward' for each target forward of feature extraction, 'step' for each training step, in order."""
    events: list[str] = []
    call, loss = FeatureExtractor.__call__, loop.distill_loss

    def counted_call(self, *args, **kwargs):
        events.append("forward")
        return call(self, *args, **kwargs)

    def counted_loss(*args, **kwargs):
        events.append("step")
        return loss(*args, **kwargs)

    monkeypatch.setattr(FeatureExtractor, "__call__", counted_call)
    monkeypatch.setattr(loop, "distill_loss", counted_loss)
    return events


def _assert_same_cache(hybrid, cached) -> None:
    """Same manifest and samples; features equal up to the storage dtype's rounding (each was
    computed in batches of other shapes, which moves fp32 sums by an ulp)."""
    ours, theirs = FeatureCache(hybrid), FeatureCache(cached)
    ours.verify()
    assert ours.manifest == theirs.manifest
    for k in range(len(theirs)):
        a, b = ours.load_shard(k), theirs.load_shard(k)
        assert a.keys() == b.keys()
        for key in b:
            if key in FEATURES:
                torch.testing.assert_close(a[key].float(), b[key].float(), rtol=2 ** -7, atol=1e-5)
            else:
                assert torch.equal(a[key], b[key]), (k, key)
        assert read_entry(hybrid, k)["inputs_sha256"] == read_entry(cached, k)["inputs_sha256"]


def test_epoch_one_writes_the_cache_that_epoch_two_reads(tmp_path, tiny_target_dir, tiny_corpus, cached_run,
                                                         monkeypatch):
    out = tmp_path / "hybrid"
    events = _events(monkeypatch)
    train(compose(_overrides(tiny_target_dir, tiny_corpus, out, "hybrid")))
    steps = events.count("step")
    assert steps == len(_losses(cached_run)) and steps % 2 == 0
    second_epoch = [i for i, e in enumerate(events) if e == "step"][steps // 2]
    assert events[:second_epoch].count("forward") == steps // 2  # each of the first epoch's steps ran the target once
    assert "forward" not in events[second_epoch:]  # the second read the cache
    _assert_same_cache(out / "features", cached_run / "features")
    # the same plan over the same (rounded alike) features: the same training, step for step
    hybrid, cached = _losses(out), _losses(cached_run)
    assert sorted(hybrid) == sorted(cached)
    for step in hybrid:
        assert hybrid[step] == pytest.approx(cached[step], rel=1e-3), step


KILL_AT_SECOND_ENTRY = """
import os, signal, sys
from lyanna_train.data import feature_cache_writer as writer
from lyanna_train.training.loop import train
from tests.training.conftest import compose
entries = []
def write_json_atomic(path, obj):  # SIGKILL once the 2nd shard file is in place, before its index entry
    if path.parent.name == "shards":
        if entries:
            os.kill(os.getpid(), signal.SIGKILL)
        entries.append(path)
    return real(path, obj)
real, writer.write_json_atomic = writer.write_json_atomic, write_json_atomic
train(compose(sys.argv[1:]))
"""


def test_a_run_killed_in_the_first_epoch_resumes_to_the_same_cache(tmp_path, tiny_target_dir, tiny_corpus,
                                                                    cached_run, monkeypatch):
    from pathlib import Path

    out = tmp_path / "killed"
    overrides = _overrides(tiny_target_dir, tiny_corpus, out, "hybrid", "train.save_every=1", "train.keep_last=20")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", KILL_AT_SECOND_ENTRY, *overrides], cwd=root, env=_clean_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr[-2000:]
    shards = out / "features" / "shards"
    assert len(list(shards.glob("*.json"))) == 1  # one shard complete ...
    assert len(list(shards.glob("*.safetensors"))) == 2  # ... and one file without its index entry
    with pytest.raises(LyannaError, match="incomplete"):
        FeatureCache(out / "features")  # never taken for complete
    killed_at = max(int(p.name.split("-")[1]) for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    events = _events(monkeypatch)
    train(compose(overrides))
    steps = events.count("step")
    total = len(_losses(cached_run))
    assert steps == total - killed_at  # it resumed from its last checkpoint, not from step 0
    assert "forward" not in events[[i for i, e in enumerate(events) if e == "step"][total // 2 - killed_at]:]
    _assert_same_cache(out / "features", cached_run / "features")
    resumed, cached = _losses(out), _losses(cached_run)
    assert sorted(resumed) == sorted(cached)
    for step in resumed:
        assert resumed[step] == pytest.approx(cached[step], rel=1e-3), step


def test_hybrid_refuses_a_cache_of_another_feature_dtype(tmp_path, tiny_target_dir, tiny_corpus, cached_run):
    cfg = compose(_overrides(tiny_target_dir, tiny_corpus, tmp_path / "run", "hybrid", "train.max_steps=1",
                             f"data.cache_dir={cached_run / 'features'}", "data.feature_dtype=float8_e4m3fn"))
    with pytest.raises(LyannaError, match="data.feature_dtype = float8_e4m3fn, but the feature cache .* holds "
                                          "bfloat16 features") as err:
        train(cfg)
    assert "\n" not in str(err.value)
    assert json.loads((cached_run / "features" / "manifest.json").read_text())["dtype"] == "bfloat16"
