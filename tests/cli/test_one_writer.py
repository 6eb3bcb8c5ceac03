"""One writer per output: a second command writing the same --out stops at once, naming the first."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import pytest

from ..conftest import write_jsonl

GOOD = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}] * 3

_HOLD = ("import sys, time\nfrom lyanna_train.locks import output_lock\n"
         "with output_lock(sys.argv[1], tag=sys.argv[2]):\n    print('holding', flush=True)\n    time.sleep(600)\n")


@contextlib.contextmanager
def another_writer(out, tag: str = ""):
    """A second process that holds ``out`` the way every writer does."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(out), tag], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "holding"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _refused(capsys, code: int, prog: str, out, pid: int) -> None:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith(f"{prog}: error: {out} "), err
    assert f"is in use by pid {pid} on " in err[0]


@pytest.mark.slow
def test_two_hotvocab_runs_on_one_out(tmp_path, capsys):
    """Both used to report success, the last writer winning."""
    from lyanna_train.cli.hotvocab import main

    corpus = write_jsonl(tmp_path / "c.jsonl", GOOD)
    out = tmp_path / "hot"
    args = ["--corpus", str(corpus), "--tokenizer", "smollm2", "--sizes", "8", "--out", str(out), "--no-progress"]
    with another_writer(out) as first:
        _refused(capsys, main(args), "lyanna-hotvocab", out, first.pid)
        _refused(capsys, main(["merge", str(tmp_path), "--sizes", "8", "--out", str(out)]), "lyanna-hotvocab", out,
                 first.pid)
    assert not out.exists()
    assert main(args) == 0 and (out / "manifest.json").is_file()  # free once the first is gone (killed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "hot"]  # no lock file left


def test_two_exports_imports_or_benches_on_one_out(tmp_path, capsys):
    from lyanna_train.cli.bench import main as bench
    from lyanna_train.cli.export import main as export

    out = tmp_path / "out"
    (tmp_path / "run").mkdir()
    with another_writer(out) as first:
        _refused(capsys, export([str(tmp_path / "run"), "--out", str(out)]), "lyanna-export", out, first.pid)
        _refused(capsys, export(["import", str(tmp_path / "run"), "--target", "smollm2", "--out", str(out)]),
                 "lyanna-export", out, first.pid)
        _refused(capsys, bench(["--target", "smollm2", "--methods", "target", "--out", str(out)]), "lyanna-bench",
                 out, first.pid)


@pytest.mark.parametrize("tool", ["build_feature_cache", "self_distill"])
def test_data_tools_have_one_writer(tmp_path, capsys, tool):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "data_tools" / f"{tool}.py"
    spec = importlib.util.spec_from_file_location(f"data_tools_{tool}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    corpus = write_jsonl(tmp_path / "c.jsonl", GOOD)
    out = tmp_path / ("cache" if tool == "build_feature_cache" else "distilled.jsonl")
    tag = ".shard-0of1" if tool == "build_feature_cache" else ""
    with another_writer(out, tag) as first:
        start = time.monotonic()
        code = module.main(["--corpus", str(corpus), "--target", "smollm2", "--out", str(out)])
        assert time.monotonic() - start < 120
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert code == 2 and len(err) == 1 and f"is in use by pid {first.pid} on " in err[0], err
