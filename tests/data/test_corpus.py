"""Every corpus form the loaders accept, and the records they refuse (with reasons)."""

from __future__ import annotations

import json

import pytest

from lyanna_train.data.conversations import Document, Skip, to_document
from lyanna_train.data.corpus import Corpus, ReadNotes, iter_documents
from lyanna_train.errors import LyannaError

from ..conftest import write_jsonl


def _docs(specs):
    notes = ReadNotes()
    return [d for d in iter_documents(Corpus.resolve(specs), notes) if isinstance(d, Document)], notes


def test_schemas_normalise_to_messages_or_text():
    share = to_document(0, {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]})
    openai = to_document(1, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    pair = to_document(2, {"prompt": "q", "canonical_solution": "a"})
    assert share.messages == openai.messages == pair.messages == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert to_document(3, {"text": "t"}).text == "t"
    assert to_document(4, {"conversations": [{"from": "alien", "value": "x"}]}) == Skip(4, "unknown role 'alien'")
    assert to_document(5, {"conversations": []}).reason == "empty conversation"
    assert "no 'conversations'" in to_document(6, {"foo": 1}).reason


@pytest.mark.slow
def test_file_dir_glob_txt_parquet_and_saved_dataset(tmp_path):
    import datasets

    rows = [{"text": f"doc {i}"} for i in range(5)]
    write_jsonl(tmp_path / "a.jsonl", rows[:2])
    (tmp_path / "b.json").write_text(json.dumps(rows[2:3]))
    (tmp_path / "c.txt").write_text("para one\nline two\n\n\npara two\n")
    datasets.Dataset.from_list(rows[3:]).to_parquet(str(tmp_path / "d.parquet"))
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))

    docs, _ = _docs([str(tmp_path / "a.jsonl"), str(tmp_path / "b.json"), str(tmp_path / "c.txt"),
                     str(tmp_path / "d.parquet")])
    assert [d.text for d in docs] == ["doc 0", "doc 1", "doc 2", "para one\nline two", "para two", "doc 3", "doc 4"]
    assert [d.index for d in docs] == list(range(7))
    assert [d.text for d in _docs([str(saved)])[0]] == [r["text"] for r in rows]
    assert len(_docs([str(tmp_path / "*.jsonl")])[0]) == 2
    by_dir, _ = _docs([str(tmp_path)])  # recursive; the saved dataset's own files are not corpus files
    assert len(by_dir) >= 7


def test_malformed_and_unusable_records_are_counted_with_reasons(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "ok"}\nnot json\n{"foo": 1}\n{"text": "ok2"}\n')
    notes = ReadNotes()
    items = list(iter_documents(Corpus.resolve([str(path)]), notes))
    assert [type(i).__name__ for i in items] == ["Document", "Skip", "Skip", "Document"]
    assert items[1].malformed and not items[2].malformed
    assert notes.n_skipped == 2 and notes.first_skip["malformed JSON"].startswith(f"{path}:2")


@pytest.mark.parametrize("spec,message", [
    ("/no/such/file.jsonl", "corpus not found"),
    ("/no/such/*.jsonl", "glob matches no files"),
])
def test_missing_inputs_name_the_problem(spec, message):
    with pytest.raises(LyannaError, match=message):
        Corpus.resolve([spec])


def test_unknown_format_names_the_file(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(LyannaError, match="unknown corpus format: .*data.csv"):
        Corpus.resolve([str(tmp_path / "data.csv")])
    with pytest.raises(LyannaError, match="no supported files"):
        Corpus.resolve([str(tmp_path)])


def test_embedded_names_resolve():
    corpus = Corpus.resolve(["sharegpt", "humaneval"])
    assert [s.origin for s in corpus.sources] == ["sharegpt", "humaneval"]
    docs, _ = _docs(["humaneval"])
    assert len(docs) == 164 and docs[0].messages[1]["role"] == "assistant"
