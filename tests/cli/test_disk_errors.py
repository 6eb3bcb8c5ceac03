"""A read-only, full or missing disk is one line naming the path and the cause, found before long work,
and leaves nothing half-written behind."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from ..conftest import write_jsonl

GOOD = [{"messages": [{"role": "user", "content": f"question {i}"},
                      {"role": "assistant", "content": f"answer number {i} " * 20}]} for i in range(20)]


def _one_error_line(err: str, prog: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error:") and "Traceback" not in err, err
    return lines[0]


def test_bench_checks_out_before_running_the_benchmark(read_only_dir, monkeypatch, capsys):
    """lyanna-bench used to find an unwritable --out only after the whole benchmark had run."""
    import lyanna_train.cli.bench as bench

    def started(*args, **kwargs):
        raise AssertionError("the benchmark started although its results could not be written")

    monkeypatch.setattr(bench, "load_and_tune", started)
    out = read_only_dir / "bench"
    code = bench.main(["--target", "smollm2", "--methods", "target", "--num-prompts", "1", "--out", str(out)])
    line = _one_error_line(capsys.readouterr().err, "lyanna-bench")
    assert code == 2 and str(out) in line
    assert any(cause in line for cause in ("Read-only file system", "Permission denied", "is not a directory")), line


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs a mounted /proc")
def test_an_output_on_a_pseudo_filesystem_names_the_right_cause(monkeypatch, capsys):
    """Issue 24: --out /proc/bench said "/proc: No such file or directory" of a folder that exists."""
    import lyanna_train.cli.bench as bench

    monkeypatch.setattr(bench, "load_and_tune", lambda *a, **k: pytest.fail("the benchmark started"))
    code = bench.main(["--target", "smollm2", "--methods", "target", "--num-prompts", "1", "--out", "/proc/bench"])
    line = _one_error_line(capsys.readouterr().err, "lyanna-bench")
    assert code == 2 and line == ("lyanna-bench: error: cannot write output /proc/bench: /proc: files cannot be "
                                  "created there (proc filesystem)")


@pytest.mark.slow
def test_hotvocab_on_a_full_disk_is_one_line_and_leaves_nothing(small_disk, tmp_path, monkeypatch, capsys):
    from lyanna_train.cli.hotvocab import main

    corpus = write_jsonl(tmp_path / "c.jsonl", GOOD)
    disk = small_disk
    if disk is None:  # no tmpfs here: make the first safetensors write fail as a full disk does
        import lyanna_train.hotvocab.artifact as artifact

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(artifact, "save_file", full)
        disk = tmp_path / "disk"
        disk.mkdir()
    out = disk / "hot"
    code = main(["--corpus", str(corpus), "--tokenizer", "smollm2", "--out", str(out), "--no-progress"])
    line = _one_error_line(capsys.readouterr().err, "lyanna-hotvocab")
    assert code == 2 and f"cannot write {out}: No space left on device" in line
    assert list(disk.iterdir()) == []  # no partial directory, no lock file


@pytest.mark.slow
def test_an_output_left_half_written_by_a_killed_run_is_cleaned_by_the_next(tmp_path, capsys):
    """kill -9 mid-write leaves the hidden ``.<out>.partial-<pid>`` sibling an output is built in;
    the next writer there removes those of dead processes and leaves a live writer's alone."""
    import os
    import subprocess
    import sys

    from lyanna_train.cli.hotvocab import main

    corpus = write_jsonl(tmp_path / "c.jsonl", GOOD)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    disk = tmp_path / "disk"
    disk.mkdir()
    for left in (f".hot.partial-{dead.pid}", f".other.partial-{dead.pid}"):
        (disk / left).mkdir()
        (disk / left / "counts.safetensors").write_bytes(b"half")
    (disk / f".hot.old-{dead.pid}").write_bytes(b"half")
    live = disk / f".busy.partial-{os.getpid()}"  # a process that is still running owns this one
    live.mkdir()
    out = disk / "hot"
    assert main(["--corpus", str(corpus), "--tokenizer", "smollm2", "--sizes", "8", "--out", str(out),
                 "--no-progress"]) == 0
    assert sorted(p.name for p in disk.iterdir()) == [live.name, "hot"]
