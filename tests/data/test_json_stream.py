"""Truncation-tolerant JSON array streaming and JSONL error reporting."""

from __future__ import annotations

import gzip
import json

import pytest

from lyanna_train.data import json_stream
from lyanna_train.data.json_stream import Malformed, Truncated, iter_json_array, iter_jsonl
from lyanna_train.embedded import EMBEDDED_CORPORA

RECORDS = [{"id": i, "text": "ü" * i + f"record {i}", "n": [1, 2.5, None]} for i in range(40)]


def _split(events):
    return [e for e in events if not isinstance(e, (Malformed, Truncated))], [
        e for e in events if isinstance(e, (Malformed, Truncated))]


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_complete_array_streams_every_record(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(json_stream, "_CHUNK", chunk)
    path = tmp_path / "a.json"
    path.write_text(json.dumps(RECORDS, indent=2, ensure_ascii=False), encoding="utf-8")
    records, events = _split(list(iter_json_array(path)))
    assert records == RECORDS and events == []


@pytest.mark.parametrize("cut", [0.13, 0.5, 0.97])
def test_truncated_array_yields_complete_records_and_offset(tmp_path, monkeypatch, cut):
    monkeypatch.setattr(json_stream, "_CHUNK", 50)
    parts = [json.dumps(r, ensure_ascii=False).encode("utf-8") for r in RECORDS]
    full = b"[\n  " + b",\n  ".join(parts) + b"\n]"
    data = full[: int(len(full) * cut)]
    path = tmp_path / "t.json"
    path.write_bytes(data)
    records, events = _split(list(iter_json_array(path)))
    assert records == RECORDS[: len(records)]
    # every record whose closing brace survived is recovered
    complete = sum(1 for p in parts if p in data)
    assert len(records) == complete
    (trunc,) = events
    assert isinstance(trunc, Truncated) and trunc.records == len(records)
    tail = data[trunc.byte_offset:]
    assert tail.strip(b" \n,") == b"" or tail.startswith(b"{")  # where the damaged record starts
    assert data[: trunc.byte_offset].rstrip(b" \n,").endswith(parts[len(records) - 1])


def test_syntax_error_mid_array_is_malformed_not_truncated(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"a": 1}, {"a": 2,, "b": 3}, {"a": 4}]')
    records, events = _split(list(iter_json_array(path)))
    assert records == [{"a": 1}]
    assert isinstance(events[0], Malformed) and events[0].where.endswith("@11")


def test_jsonl_reports_bad_lines_and_reads_gzip(tmp_path):
    lines = '{"a": 1}\n{broken\n\n{"a": 3}\n'
    path = tmp_path / "x.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write(lines)
    events = list(iter_jsonl(path))
    assert events[0] == {"a": 1} and events[2] == {"a": 3}
    assert isinstance(events[1], Malformed) and events[1].where.endswith(":2")


@pytest.mark.slow
def test_embedded_sharegpt_recovers_all_17671_conversations():
    n, truncs = 0, []
    for e in iter_json_array(EMBEDDED_CORPORA["sharegpt"].path()):
        if isinstance(e, Truncated):
            truncs.append(e)
        elif isinstance(e, dict):
            n += 1
    assert n == 17671
    assert len(truncs) == 1 and truncs[0].records == 17671 and truncs[0].byte_offset > 100_000_000
