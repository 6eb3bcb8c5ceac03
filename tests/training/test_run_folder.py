"""A run folder: one run at a time, resumed only into the run it holds, cleaned of what dead runs left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from lyanna_train.errors import LyannaError
from lyanna_train.training.loop import train

from .conftest import compose, tiny_overrides
from .test_train import _clean_env, _losses

TINY = ("target.aux_layers=[0,1,2]", "eval.num_prompts=0")


def _cfg(target, corpus, out, *extra):
    return compose(tiny_overrides(target, corpus, out, *TINY, *extra))


def _steps(out) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(out) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def _last_step(out) -> int:
    """The step of the latest complete checkpoint (0: none yet)."""
    from lyanna_train.run_record import latest_checkpoint

    latest = latest_checkpoint(out / "checkpoints")
    return int(latest.name.split("-")[1]) if latest is not None else 0


def _wait_for(predicate, proc, log, stalled: float = 300, limit: float = 1200) -> None:
    """Until ``predicate`` holds. Fails, showing the first run's log, as soon as that run ends, or
    writes nothing for ``stalled`` seconds (a hang: say a build lock), or after ``limit`` seconds;
    a slow but progressing run (a busy machine) is waited for."""
    start = last_change = time.monotonic()
    size = -1
    while not predicate():
        now = time.monotonic()
        if proc.poll() is not None:
            raise AssertionError(f"the first run ended early:\n{log.read_text()[-3000:]}")
        if log.stat().st_size != size:
            size, last_change = log.stat().st_size, now
        if now - last_change > stalled or now - start > limit:
            why = f"wrote nothing for {stalled:.0f} s" if now - last_change > stalled else f"ran {limit:.0f} s"
            raise AssertionError(f"the first run {why} without reaching a checkpoint:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


@pytest.mark.slow
def test_a_second_run_in_a_busy_folder_stops_naming_the_first_and_resumes_once_it_is_killed(
        tmp_path, tiny_target_dir, tiny_corpus):
    """The issue's two runs in one folder: the second used to train from the first's checkpoints
    (or crash on its .partial-step-*); now it stops at once, naming the first. After kill -9 the
    folder is free again: what the dead run left half-written is removed and steps never repeat."""
    from lyanna_train.training.deepspeed_engine import init_distributed

    # DeepSpeed may JIT-build its CPU communication op on first use: done here, in this process,
    # so that the first run below is never killed mid-build (which would leave the build locked)
    init_distributed()
    out, log = tmp_path / "run", tmp_path / "first.log"
    with open(log, "w") as sink:  # (a pipe nobody reads would fill up and stall the run)
        first = subprocess.Popen(
            [sys.executable, "-m", "lyanna_train.cli.train",
             *tiny_overrides(tiny_target_dir, tiny_corpus, out, *TINY, "train.max_steps=100000", "train.save_every=1",
                             "train.lr=1e-3")],
            stdout=sink, stderr=subprocess.STDOUT, env=_clean_env())
    try:
        # any checkpoint from step 2 on: at ~20 steps/s with save_every=1 and keep_last=2, step-00000002
        # itself lives a tenth of a second (a poll for that one name missed it and waited to the deadline)
        _wait_for(lambda: _last_step(out) >= 2, first, log)
        with pytest.raises(LyannaError) as err:
            train(_cfg(tiny_target_dir, tiny_corpus, out, "train.max_steps=4", "train.save_every=1", "train.lr=1e-1"))
        message = str(err.value)
        assert f"run folder {out} is in use by pid {first.pid}" in message and "lyanna_train.cli.train" in message
        assert "lr: 0.001" in (out / "config.yaml").read_text()  # the first run's config stands
    finally:
        first.kill()  # kill -9: no clean-up of any kind
        first.wait()
    done = _last_step(out)
    result = train(_cfg(tiny_target_dir, tiny_corpus, out, f"train.max_steps={done + 1}", "train.save_every=1",
                        "train.lr=1e-3", "train.resume=force"))
    assert result["step"] == done + 1
    assert _steps(out) == list(range(1, done + 2))  # every step once, although the killed run logged beyond `done`
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    assert not (out / ".lock.holder").exists()


@pytest.mark.slow
def test_resume_refuses_a_changed_config_naming_the_fields_and_force_continues_with_it(
        tmp_path, tiny_target_dir, tiny_corpus):
    from lyanna_train.training.deepspeed_engine import lr_lambda

    out = tmp_path / "run"
    base = ("train.max_steps=2", "train.save_every=1", "train.lr=1e-3")
    train(_cfg(tiny_target_dir, tiny_corpus, out, *base))
    saved = (out / "config.yaml").read_text()
    with pytest.raises(LyannaError) as err:
        train(_cfg(tiny_target_dir, tiny_corpus, out, "train.max_steps=4", "train.save_every=1", "train.lr=0.1"))
    message = str(err.value)
    assert "train.lr 0.001 -> 0.1" in message and "train.max_steps 2 -> 4" in message
    assert "train.resume=force" in message and "\n" not in message
    with pytest.raises(LyannaError, match=r"data\.corpus .* -> "):
        train(_cfg(tiny_target_dir, tiny_corpus, out, *base, f"data.corpus=[{tiny_corpus},{tiny_corpus}]"))
    with pytest.raises(LyannaError, match=r"draft\.pool_size 128 -> 0"):
        train(_cfg(tiny_target_dir, tiny_corpus, out, *base, "draft.pool_size=0"))
    assert (out / "config.yaml").read_text() == saved and _checkpoints(out) == ["step-00000001", "step-00000002"]

    # how the run is watched may change freely; this one is complete, so nothing more is trained
    assert train(_cfg(tiny_target_dir, tiny_corpus, out, *base, "train.log_every=5", "eval.every=7"))["step"] == 2

    # an incompatible draft under force is one line, not a traceback about unexpected keys
    with pytest.raises(LyannaError, match="do not fit the configured draft"):
        train(_cfg(tiny_target_dir, tiny_corpus, out, *base, "draft.pool_size=0", "train.resume=force"))

    train(_cfg(tiny_target_dir, tiny_corpus, out, "train.max_steps=4", "train.save_every=1", "train.lr=0.1",
               "train.resume=force"))
    rows = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [1, 2, 3, 4]
    old, new = lr_lambda(2, 2, 0.1), lr_lambda(2, 4, 0.1)  # warm-up 2, min_lr_ratio 0.1
    assert rows[2]["lr"] == pytest.approx(1e-3 * old(2))
    assert rows[3]["lr"] == pytest.approx(0.1 * new(3)) and rows[4]["lr"] == pytest.approx(0.1 * new(4))
    assert "lr: 0.1" in (out / "config.yaml").read_text()
    record = json.loads((out / "checkpoints" / "step-00000004" / "run.json").read_text())
    assert record["config"]["train"]["lr"] == 0.1 and record["metrics"]["step"] == 4


@pytest.mark.slow
def test_metrics_never_repeat_a_step_after_a_resume(tmp_path, tiny_target_dir, tiny_corpus):
    out = tmp_path / "run"
    cfg = _cfg(tiny_target_dir, tiny_corpus, out, "train.max_steps=4", "train.save_every=2", "train.keep_last=5")
    train(cfg)
    full = _losses(out)
    # a crash after step 4 was logged but before its checkpoint was complete
    import shutil

    shutil.rmtree(out / "checkpoints" / "step-00000004")
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 5, "loss/to')  # and a line torn by the crash
    train(cfg)
    assert _steps(out) == [1, 2, 3, 4]
    assert _losses(out)[4] == pytest.approx(full[4], rel=1e-6, abs=1e-7)


@pytest.mark.slow
def test_resume_never_refuses_a_folder_with_checkpoints(tmp_path, tiny_target_dir, tiny_corpus):
    out = tmp_path / "run"
    train(_cfg(tiny_target_dir, tiny_corpus, out, "train.max_steps=1"))
    with pytest.raises(LyannaError, match="train.resume=never, but .* holds checkpoints"):
        train(_cfg(tiny_target_dir, tiny_corpus, out, "train.max_steps=1", "train.resume=never"))


@pytest.mark.slow
def test_what_dead_runs_left_half_written_is_removed_and_live_writers_are_left_alone(
        tmp_path, tiny_target_dir, tiny_corpus):
    out = tmp_path / "run"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out.mkdir()
    (out / "checkpoints" / ".partial-step-00000007").mkdir(parents=True)
    (out / "checkpoints" / ".partial-step-00000007" / "mp_rank_00_model_states.pt").write_bytes(b"half")
    (out / f".hotvocab.partial-{dead.pid}").mkdir()
    (out / f".hotvocab.partial-{dead.pid}" / "counts.safetensors").write_bytes(b"half")
    (out / f".config.yaml.tmp-{dead.pid}").write_text("half")
    live = out / f".notes.partial-{os.getpid()}"  # a process that is still running owns this one
    live.mkdir()
    train(_cfg(tiny_target_dir, tiny_corpus, out, "train.max_steps=1"))
    left = sorted(p.name for p in out.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock"))
    assert left == [live.name]
    assert _checkpoints(out) == ["step-00000001"]
