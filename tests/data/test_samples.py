"""Samples: loss masks equal the assistant spans exactly, truncation policy, refusals, batching."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from lyanna_train.data.batching import collate, length_grouped_batches
from lyanna_train.data.conversations import to_document
from lyanna_train.data.corpus import Corpus
from lyanna_train.data.samples import Sample, SampleBuilder, SampleSettings, SampleStats, iter_samples
from lyanna_train.errors import LyannaError

from ..conftest import write_jsonl


@pytest.fixture(params=["chatml", "header"])
def tokenizer(request, smollm2_tokenizer, header_template_dir):
    return smollm2_tokenizer if request.param == "chatml" else AutoTokenizer.from_pretrained(header_template_dir)


def _segments(mask: torch.Tensor) -> list[tuple[int, int]]:
    out, start = [], None
    for t, m in enumerate(mask.tolist() + [False]):
        if m and start is None:
            start = t
        if not m and start is not None:
            out.append((start, t))
            start = None
    return out


@pytest.mark.slow
def test_mask_is_exactly_each_assistant_turn(tokenizer, sharegpt_records):
    builder = SampleBuilder(tokenizer, SampleSettings(max_length=100_000))
    for i, rec in enumerate(sharegpt_records):
        doc = to_document(i, rec)
        sample = builder.build(doc, SampleStats())
        assert sample.input_ids.tolist() == tokenizer.apply_chat_template(doc.messages, tokenize=True, return_dict=False)
        # exact: the masked tokens are those whose offsets start inside a rendered assistant turn
        full = tokenizer.apply_chat_template(doc.messages, tokenize=False)
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        expected = torch.zeros(len(enc["input_ids"]), dtype=torch.bool)
        for k, m in enumerate(doc.messages):
            if m["role"] == "assistant":
                start = len(tokenizer.apply_chat_template(doc.messages[:k], tokenize=False, add_generation_prompt=True)) if k else 0
                upto = tokenizer.apply_chat_template(doc.messages[: k + 1], tokenize=False)
                end = start + upto[start:].rfind("<|im_end|>") + len("<|im_end|>")
                for t, (a, _) in enumerate(enc["offset_mapping"]):
                    expected[t] |= start <= a < end
        assert torch.equal(sample.loss_mask, expected)
        # readable: each masked run decodes to one answer and its end-of-turn token; a leading
        # space may sit in the token that also holds the header's newline, which is not masked
        answers = [m["content"] for m in doc.messages if m["role"] == "assistant"]
        if "trim" in tokenizer.chat_template:
            answers = [a.strip() for a in answers]
        decoded = [tokenizer.decode(sample.input_ids[a:b]) for a, b in _segments(sample.loss_mask)]
        assert len(decoded) == len(answers)
        for d, answer in zip(decoded, answers):
            body = d.removesuffix("<|im_end|>")
            assert d.endswith("<|im_end|>") and answer.endswith(body)
            assert answer[: len(answer) - len(body)] in ("", " ")


def test_truncation_keeps_the_head_and_drop_drops(smollm2_tokenizer):
    doc = to_document(0, {"messages": [{"role": "user", "content": "q " * 50}, {"role": "assistant", "content": "a " * 50}]})
    stats = SampleStats()
    full = SampleBuilder(smollm2_tokenizer, SampleSettings(max_length=10_000)).build(doc, stats)
    cut = SampleBuilder(smollm2_tokenizer, SampleSettings(max_length=len(full) - 7)).build(doc, stats)
    assert torch.equal(cut.input_ids, full.input_ids[: len(full) - 7]) and stats.truncated == 1
    assert SampleBuilder(smollm2_tokenizer, SampleSettings(max_length=len(full) - 7, overflow="drop")).build(doc, stats) is None
    assert SampleBuilder(smollm2_tokenizer, SampleSettings(max_length=20)).build(doc, stats) is None  # no answer left
    assert any("dropped" in r for r in stats.skipped) and any("within max_length" in r for r in stats.skipped)


def test_no_assistant_anywhere_is_an_error_and_partial_is_counted(tmp_path, smollm2_tokenizer):
    users = write_jsonl(tmp_path / "u.jsonl", [{"messages": [{"role": "user", "content": "q"}]}] * 3)
    with pytest.raises(LyannaError, match="no training sample"):
        list(iter_samples(Corpus.resolve([str(users)]), smollm2_tokenizer))
    mixed = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "q"}]},
                                               {"messages": [{"role": "user", "content": "q"},
                                                             {"role": "assistant", "content": "a"}]}])
    stats = SampleStats()
    assert len(list(iter_samples(Corpus.resolve([str(mixed)]), smollm2_tokenizer, stats=stats))) == 1
    assert stats.skipped == {"no assistant tokens in the rendered conversation": 1}


@pytest.mark.parametrize("name,label", [("mtbench", "MT-Bench"), ("tasks", "tasks-unlike-chat")])
def test_evaluation_sets_are_refused_as_training_data(smollm2_tokenizer, name, label):
    with pytest.raises(LyannaError, match=f"{label} evaluation set"):
        next(iter_samples(Corpus.resolve([name]), smollm2_tokenizer))


def test_length_grouped_batches_are_seeded_bounded_and_complete():
    samples = [Sample(i, torch.arange(n), torch.ones(n, dtype=torch.bool)) for i, n in
               enumerate([5, 50, 7, 300, 12, 49, 51, 8, 100, 6] * 5)]
    a = [[s.index for s in b] for b in length_grouped_batches(samples, max_tokens=320, seed=3, buffer_size=16)]
    b = [[s.index for s in b] for b in length_grouped_batches(samples, max_tokens=320, seed=3, buffer_size=16)]
    c = [[s.index for s in b] for b in length_grouped_batches(samples, max_tokens=320, seed=4, buffer_size=16)]
    assert a == b and a != c
    assert sorted(i for batch in a for i in batch) == list(range(50))
    for batch in length_grouped_batches(samples, max_tokens=320, seed=3, buffer_size=16):
        assert len(batch) == 1 or len(batch) * max(map(len, batch)) <= 320
    padded = collate(samples[:3], pad_id=0)
    assert padded["input_ids"].shape == (3, 50)
    assert padded["attention_mask"].sum().item() == 5 + 50 + 7 and padded["loss_mask"].sum().item() == 62


def test_bad_records_are_counted_never_lost(tmp_path, smollm2_tokenizer):
    long_answer = "word " * 400
    records = [
        {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]},  # empty strings
        {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},  # unknown role
        {"messages": [{"role": "user", "content": "only a question"}]},  # no assistant turn
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": long_answer}]},  # over-long
        {"text": "raw text"},
    ]
    corpus = Corpus.resolve([str(write_jsonl(tmp_path / "bad.jsonl", records))])
    stats = SampleStats()
    samples = list(iter_samples(corpus, smollm2_tokenizer, SampleSettings(max_length=128), stats))
    assert [s.index for s in samples] == [0, 3]
    empty = samples[0]
    assert smollm2_tokenizer.decode(empty.input_ids[empty.loss_mask]) == "<|im_end|>"  # only the end of turn
    assert len(samples[1]) == 128 and stats.truncated == 1
    assert stats.skipped == {"unknown role 'wizard'": 1, "no assistant tokens in the rendered conversation": 1,
                             "raw text (no assistant turn to learn)": 1}
    stats = SampleStats()
    kept = list(iter_samples(corpus, smollm2_tokenizer, SampleSettings(max_length=128, overflow="drop"), stats))
    assert [s.index for s in kept] == [0] and stats.skipped["longer than max_length 128 (dropped)"] == 1


def test_an_answer_with_the_targets_own_ids_keeps_them(smollm2_tokenizer):
    """A target may write "\\n\\n" as one token and "1" after it, where the decoded text
    tokenizes as the header's newline merged with the answer's first: the sample holds the
    prompt as regeneration tokenized it and then the ids the target emitted."""
    tok = smollm2_tokenizer
    own = [tok.convert_tokens_to_ids("ĊĊ")] + tok.encode("1. yes", add_special_tokens=False)
    text = tok.decode(own)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a\n\n1. b"},
                {"role": "user", "content": "and?"}, {"role": "assistant", "content": text}]
    plain = SampleBuilder(tok).build(to_document(0, {"messages": messages}), SampleStats())
    assert own not in [plain.input_ids[i:i + 4].tolist() for i in range(len(plain))]  # re-tokenized otherwise

    messages[3] = {**messages[3], "token_ids": own}
    stats = SampleStats()
    sample = SampleBuilder(tok).build(to_document(0, {"messages": messages}), stats)
    prompt = tok.apply_chat_template(messages[:3], add_generation_prompt=True, tokenize=True, return_dict=False)
    closing = tok.encode("<|im_end|>\n", add_special_tokens=False)
    assert sample.input_ids.tolist() == prompt + own + closing
    assert _segments(sample.loss_mask)[-1] == (len(prompt), len(prompt) + len(own) + 1)  # answer + end of turn
    assert _segments(sample.loss_mask)[0] == _segments(plain.loss_mask)[0]  # the earlier turn as before

    bad = [*messages[:3], {**messages[3], "token_ids": [len(tok) + 5]}]
    assert SampleBuilder(tok).build(to_document(0, {"messages": bad}), stats) is None
    assert stats.skipped == {"'token_ids' outside the tokenizer's vocabulary": 1}
    for wrong in ([], ["7"], [-1], 3):
        skip = to_document(0, {"messages": [*messages[:3], {**messages[3], "token_ids": wrong}]})
        assert "'token_ids' must be a non-empty list of token ids" in skip.reason
