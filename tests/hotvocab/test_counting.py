"""Counts equal an independent count (direct tokenizer calls), in both modes and two templates."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from transformers import AutoTokenizer

from lyanna_train.data.conversations import to_document
from lyanna_train.hotvocab.build import build
from lyanna_train.hotvocab.artifact import load_counts
from lyanna_train.hotvocab.counting import CountSettings, is_heldout
from lyanna_train.hotvocab.selection import SelectionRequest

from ..conftest import write_jsonl


def _reference_counts(tok, records, mode: str, eot: str) -> Counter:
    """Count with public tokenizer calls: the direct chat-template tokenization, and for
    assistant mode the tokens whose offsets start inside each turn's rendered text."""
    counts: Counter = Counter()
    for i, rec in enumerate(records):
        doc = to_document(i, rec)
        if doc.text is not None:
            counts.update(tok(doc.text, add_special_tokens=False)["input_ids"])
            continue
        msgs = doc.messages
        direct = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
        if mode == "all":
            counts.update(direct)
            continue
        full = tok.apply_chat_template(msgs, tokenize=False)
        enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        assert enc["input_ids"] == direct
        for k, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before = tok.apply_chat_template(msgs[:k], tokenize=False, add_generation_prompt=True)
            upto = tok.apply_chat_template(msgs[: k + 1], tokenize=False)
            assert upto.startswith(before) and full.startswith(upto)
            start = len(before)
            end = start + upto[start:].rfind(eot) + len(eot)
            counts.update(t for t, (a, _) in zip(enc["input_ids"], enc["offset_mapping"]) if start <= a < end)
    return counts


def _counted(out) -> Counter:
    _, train, heldout = load_counts(out)
    total = train + heldout
    return Counter({int(i): int(total[i]) for i in np.nonzero(total)[0]})


@pytest.mark.parametrize("template", ["chatml", "header"])
@pytest.mark.parametrize("mode", ["assistant", "all"])
@pytest.mark.slow
def test_counts_equal_direct_tokenizer_calls(tmp_path, smollm2_tokenizer, header_template_dir, sharegpt_records,
                                             mode, template):
    tok_spec = "smollm2" if template == "chatml" else str(header_template_dir)
    tok = smollm2_tokenizer if template == "chatml" else AutoTokenizer.from_pretrained(header_template_dir)
    records = sharegpt_records + [{"text": "Plain text counts whole, ünïcode and all."}]
    corpus = write_jsonl(tmp_path / "corpus.jsonl", records)
    out = tmp_path / "out"
    manifest = build([str(corpus)], tok_spec, out, [SelectionRequest(size=64)],
                     CountSettings(mode=mode, heldout=0.2), progress=False, say=lambda *_: None)
    expected = _reference_counts(tok, records, mode, "<|im_end|>")
    assert _counted(out) == expected
    assert sum(manifest["tokens"].values()) == sum(expected.values())
    assert manifest["documents"]["heldout"] > 0 and manifest["documents"]["train"] > 0


@pytest.mark.slow
def test_two_processes_count_like_one(tmp_path, sharegpt_records):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", sharegpt_records)
    quiet = dict(progress=False, say=lambda *_: None)
    build([str(corpus)], "smollm2", tmp_path / "one", [SelectionRequest(size=100)], CountSettings(), num_proc=1, **quiet)
    build([str(corpus)], "smollm2", tmp_path / "two", [SelectionRequest(size=100)], CountSettings(), num_proc=2, **quiet)
    _, a_train, a_held = load_counts(tmp_path / "one")
    _, b_train, b_held = load_counts(tmp_path / "two")
    np.testing.assert_array_equal(a_train, b_train)
    np.testing.assert_array_equal(a_held, b_held)


def test_heldout_split_is_seeded_and_sized():
    picks = [is_heldout(i, 0.05, seed=0) for i in range(20000)]
    assert picks == [is_heldout(i, 0.05, seed=0) for i in range(20000)]
    assert picks != [is_heldout(i, 0.05, seed=1) for i in range(20000)]
    assert 0.045 < np.mean(picks) < 0.055
    assert not any(is_heldout(i, 0.0, seed=0) for i in range(1000))
