"""No command writes its output over what it reads, whatever --overwrite says (issue 24):
``lyanna-export RUN --out RUN --overwrite`` replaced the run (checkpoints, features,
metrics) with the export, exit 0. Every folder-writing command refuses an output that is,
contains or lies inside one of its inputs, in one line, and leaves the input as it was."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from ..conftest import write_jsonl
from ..tiny_models import byte_level_tokenizer, export_random_draft, tiny_llama

ROOT = Path(__file__).resolve().parents[2]
RECORD = {"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello! How are you?"}]}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """run/ (a run with one checkpoint), export/, target/, corpus/c.jsonl; every test leaves it as it was."""
    root = tmp_path_factory.mktemp("apart")
    tokenizer = byte_level_tokenizer()
    export_random_draft(root, tiny_llama(tokenizer), tokenizer)
    (root / "corpus").mkdir()
    write_jsonl(root / "corpus" / "c.jsonl", [RECORD] * 8)
    return root


def _snapshot(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"data_tools_{name}", ROOT / "data_tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _command(name: str):
    from lyanna_train.cli import bench, export, hotvocab

    return {"lyanna-export": export.main, "lyanna-hotvocab": hotvocab.main, "lyanna-bench": bench.main}.get(name) \
        or _tool(name)


STEP = "run/checkpoints/step-00000001"
CASES = [  # (command, argv with {t} for the tree, the input named, how the output relates to it)
    ("lyanna-export", ["{t}/run", "--out", "{t}/run", "--overwrite"], "run", "is"),
    ("lyanna-export", ["{t}/run", "--out", "{t}/run/checkpoints", "--overwrite"], STEP, "contains"),
    ("lyanna-export", ["{t}/" + STEP, "--out", "{t}/" + STEP, "--overwrite"], STEP, "is"),
    ("lyanna-export", ["{t}/run", "--out", "{t}/run/features", "--overwrite"], "run", "lies inside"),
    ("lyanna-export", ["import", "{t}/export", "--target", "{t}/target", "--out", "{t}", "--overwrite"], "export",
     "contains"),
    ("lyanna-hotvocab", ["--corpus", "{t}/corpus", "--tokenizer", "{t}/target", "--count", "all", "--out",
                         "{t}/corpus/hot", "--overwrite", "--no-progress"], "corpus", "lies inside"),
    ("lyanna-hotvocab", ["merge", "{t}/export", "--out", "{t}/export", "--overwrite"], "export", "is"),
    ("lyanna-bench", ["--draft", "{t}/export", "--out", "{t}/export", "--num-prompts", "1"], "export", "is"),
    ("lyanna-bench", ["--draft", "{t}/export", "--out", "{t}/export", "--batch-size", "1", "--num-prompts", "1"],
     "export", "is"),
    ("build_feature_cache", ["--corpus", "{t}/corpus", "--target", "{t}/target", "--out", "{t}/corpus",
                             "--overwrite", "--no-progress"], "corpus", "is"),
    ("self_distill", ["--corpus", "{t}/corpus/c.jsonl", "--target", "{t}/target", "--out", "{t}/corpus/c.jsonl"],
     "corpus/c.jsonl", "is"),
]


@pytest.mark.parametrize("name, argv, source, relation", CASES,
                         ids=[f"{c[0]}-{c[3].replace(' ', '-')}-{i}" for i, c in enumerate(CASES)])
def test_an_output_over_an_input_is_refused_and_the_input_is_left_alone(tree, capsys, name, argv, source, relation):
    before = _snapshot(tree)
    assert _command(name)([a.format(t=tree) for a in argv]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert err[0].startswith(f"{name}: error: --out ") and f" {relation} the input {tree}/{source}" in err[0], err[0]
    assert "choose an output outside it" in err[0]
    assert _snapshot(tree) == before


def test_a_symlink_or_a_relative_path_to_the_input_is_the_input(tmp_path, capsys, monkeypatch):
    from lyanna_train.cli.export import main

    tokenizer = byte_level_tokenizer()
    export_random_draft(tmp_path, tiny_llama(tokenizer), tokenizer)
    tree = tmp_path
    os.symlink(tree / "run", tree / "alias")
    monkeypatch.chdir(tree / "run" / "checkpoints")
    before = _snapshot(tree / "run")
    capsys.readouterr()
    assert main([str(tree / "run"), "--out", str(tree / "alias"), "--overwrite"]) == 2
    assert main([str(tree / "run"), "--out", "..", "--overwrite"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert f"--out {tree / 'alias'} is the input {tree / 'run'}" in err[0] and "--out .. is the input" in err[1]
    assert _snapshot(tree / "run") == before
    assert main([str(tree / "run"), "--out", str(tree / "exported")]) == 0  # beside the run: fine
