"""``lyanna-hotvocab`` on good and bad input: one-line errors, non-zero exit, nothing left behind."""

from __future__ import annotations

import json

import pytest

from lyanna_train.cli.hotvocab import main

from ..conftest import DAMAGED, write_damaged, write_jsonl

GOOD = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}] * 3


def _run(capsys, argv):
    code = main(argv + ["--no-progress"] if argv[:1] != ["merge"] else argv)
    out, err = capsys.readouterr()
    return code, out, err


def _assert_clean_failure(code, err, tmp_path, message):
    assert code == 2
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("lyanna-hotvocab: error:"), err
    assert message in lines[0]
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.slow
def test_cli_builds_and_prints_the_table(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", GOOD + ["not json"])
    (tmp_path / "c.jsonl").write_text((tmp_path / "c.jsonl").read_text().replace('"not json"', "{not json"))
    code, out, err = _run(capsys, ["--corpus", str(corpus), "--tokenizer", "smollm2", "--sizes", "8",
                                   "--out", str(tmp_path / "out"), "--num-proc", "1"])
    assert code == 0, err
    assert "| size 8 | 8 |" in out and "coverage" in out
    assert "skipped 1 records: 1 × malformed JSON" in out
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["skipped"]["total"] == 1
    code, _, err = _run(capsys, ["--corpus", str(corpus), "--sizes", "8", "--out", str(tmp_path / "out")])
    assert code == 2 and "already exists" in err


@pytest.mark.parametrize("case,message", [
    ("missing", "corpus not found"),
    ("format", "unknown corpus format"),
    ("empty", "empty corpus"),
    ("no-assistant", "no assistant turns"),
    ("ratio-high", "outside (0, 1]"),
    ("ratio-zero", "outside (0, 1]"),
    ("tokenizer", "cannot load tokenizer"),
    ("tokenizer-missing", "tokenizer not found"),
    ("strict", "malformed JSON"),
])
@pytest.mark.slow
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, capsys, case, message):
    good = write_jsonl(tmp_path / "good.jsonl", GOOD)
    args = {"corpus": str(good), "tokenizer": "smollm2", "extra": []}
    if case == "missing":
        args["corpus"] = str(tmp_path / "nope.jsonl")
    elif case == "format":
        (tmp_path / "data.csv").write_text("a,b\n")
        args["corpus"] = str(tmp_path / "data.csv")
    elif case == "empty":
        (tmp_path / "empty.jsonl").write_text("")
        args["corpus"] = str(tmp_path / "empty.jsonl")
    elif case == "no-assistant":
        args["corpus"] = str(write_jsonl(tmp_path / "users.jsonl", [{"messages": [{"role": "user", "content": "q"}]}]))
    elif case == "ratio-high":
        args["extra"] = ["--ratios", "1.5"]
    elif case == "ratio-zero":
        args["extra"] = ["--ratios", "0"]
    elif case == "tokenizer":
        (tmp_path / "tok").mkdir()
        (tmp_path / "tok" / "tokenizer_config.json").write_text("{broken")
        args["tokenizer"] = str(tmp_path / "tok")
    elif case == "tokenizer-missing":
        args["tokenizer"] = str(tmp_path / "no-such-tokenizer")
    elif case == "strict":
        (tmp_path / "good.jsonl").write_text((tmp_path / "good.jsonl").read_text() + "{oops\n")
        args["extra"] = ["--strict"]
    code, _, err = _run(capsys, ["--corpus", args["corpus"], "--tokenizer", args["tokenizer"],
                                 "--out", str(tmp_path / "out"), "--num-proc", "1", *args["extra"]])
    _assert_clean_failure(code, err, tmp_path, message)


def test_merge_cli_needs_out_and_existing_dirs(tmp_path, capsys):
    code, _, err = _run(capsys, ["merge", str(tmp_path / "nope"), "--out", str(tmp_path / "out")])
    _assert_clean_failure(code, err, tmp_path, "not found")
    code, _, err = _run(capsys, ["merge", str(tmp_path)])
    assert code == 2 and "needs --out" in err


@pytest.mark.parametrize("name", sorted(DAMAGED))
@pytest.mark.slow
def test_a_damaged_corpus_file_is_one_line_naming_it(tmp_path, capsys, name):
    """Issue 24: EOFError, BadGzipFile without the path, ArrowInvalid: tracebacks or a bare word."""
    bad = write_damaged(tmp_path, name, GOOD)
    code, _, err = _run(capsys, ["--corpus", str(bad), "--out", str(tmp_path / "out")])
    _assert_clean_failure(code, err, tmp_path, f"{bad} {DAMAGED[name]}")


@pytest.mark.slow
def test_binary_bytes_in_a_text_corpus_are_counted_and_warned_about(tmp_path, capsys):
    (tmp_path / "mixed.txt").write_bytes(b"plain text here\n\n" + bytes(range(128, 256)) * 4 + b"\n\x00\x01\n\nmore\n")
    code, out, err = _run(capsys, ["--corpus", str(tmp_path / "mixed.txt"), "--count", "all", "--sizes", "8",
                                   "--out", str(tmp_path / "out")])
    assert code == 0, err
    assert (f"warning: {tmp_path / 'mixed.txt'}: 2 lines hold bytes that are not UTF-8 text (binary data?)"
            in out + err)


def test_a_size_past_the_vocabulary_is_refused_before_counting(tmp_path, capsys, monkeypatch):
    """Issue 24: --sizes 999999999999 was refused only after the whole corpus was counted."""
    import lyanna_train.hotvocab.build as build

    monkeypatch.setattr(build, "count_corpus", lambda *a, **k: pytest.fail("the corpus was counted"))
    good = write_jsonl(tmp_path / "good.jsonl", GOOD)
    code, _, err = _run(capsys, ["--corpus", str(good), "--sizes", "8,999999999999", "--out", str(tmp_path / "out")])
    _assert_clean_failure(code, err, tmp_path, "--sizes: hot-vocabulary size 999999999999 exceeds the vocabulary "
                          "size 49152")
