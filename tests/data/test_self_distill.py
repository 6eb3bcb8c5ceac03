"""Self-distillation on the runtime: every regenerated turn is what the target says alone,
whatever the batch; sampled turns follow their own seeds; bad conversations are counted,
never fatal; resume skips work."""

from __future__ import annotations

import json

import pytest
import torch

from lyanna_train.data.self_distill import (GenerationSettings, SelfDistiller, append_jsonl, by_length, done_ids,
                                            to_sharegpt, turn_seed)
from lyanna_train.errors import LyannaError
from lyanna_train.runtime.scheduling.scheduler import BatchDecoder
from lyanna_train.runtime.settings import DecodeSettings, SamplingParams

CONVS = [
    ("0", [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
           {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Red."}]),
    ("1", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A much longer question about many things?"},
           {"role": "assistant", "content": "old"}]),
    ("2", [{"role": "user", "content": "no answer here"}]),
    ("3", [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "1 2 3"},
           {"role": "user", "content": "   "}, {"role": "assistant", "content": "?"}]),
    ("4", [{"role": "user", "content": "Say something long " * 40}, {"role": "assistant", "content": "x"}]),
]


def _distill(model, tok, batch_size, **kw):
    settings = GenerationSettings(max_new_tokens=6, max_turns=2, batch_size=batch_size, max_prompt_tokens=120, **kw)
    sampling = SamplingParams(temperature=settings.temperature, top_p=settings.top_p)
    decoder = BatchDecoder(model, None, DecodeSettings(), max_batch=batch_size)
    distiller = SelfDistiller(decoder, tok, settings, sampling)
    return distiller, {r.cid: r.messages for r in distiller.regenerate(CONVS)}


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.slow
def test_every_turn_is_what_the_target_says_alone(tiny_llama_smollm2_vocab, smollm2_tokenizer, batch_size):
    model, tok = tiny_llama_smollm2_vocab, smollm2_tokenizer
    distiller, rows = _distill(model, tok, batch_size)
    assert set(rows) == {"0", "1", "3"}
    assert distiller.skipped == {"no assistant turn": 1, "prompt over max_prompt_tokens": 1}
    assert distiller.cut == {"empty turn": 1}  # "3" keeps its first turn, its empty second question ends it
    assert [m["role"] for m in rows["0"]] == ["user", "assistant", "user", "assistant"]
    assert rows["0"][0] == CONVS[0][1][0] and rows["0"][2] == CONVS[0][1][2]  # user turns kept
    assert [m["role"] for m in rows["3"]] == ["user", "assistant"]
    for cid, msgs in rows.items():
        for k, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            assert m["content"] != CONVS[int(cid)][1][k]["content"]
            prompt = tok.apply_chat_template(msgs[:k], tokenize=True, add_generation_prompt=True, return_dict=False)
            out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                 eos_token_id=distiller.stop_ids, pad_token_id=distiller.stop_ids[0])[0, len(prompt):].tolist()
            out = out[: next((i for i, t in enumerate(out) if t in distiller.stop_ids), len(out))]
            assert m["content"] == tok.decode(out), (cid, k)


@pytest.mark.slow
def test_sampled_turns_follow_their_own_seeds(tiny_llama_smollm2_vocab, smollm2_tokenizer):
    model, tok = tiny_llama_smollm2_vocab, smollm2_tokenizer
    _, a = _distill(model, tok, 3, temperature=1.0, seed=7)
    _, b = _distill(model, tok, 3, temperature=1.0, seed=7)
    _, c = _distill(model, tok, 3, temperature=1.0, seed=8)
    assert a == b and a != c
    assert turn_seed(7, "0", 0) != turn_seed(7, "0", 1) != turn_seed(7, "1", 1)


def test_resume_skips_written_ids_and_cuts_a_torn_line(tmp_path):
    path = tmp_path / "out.jsonl"
    append_jsonl(path, [to_sharegpt("a", CONVS[0][1]), to_sharegpt("b", CONVS[1][1])])
    with open(path, "a") as fh:
        fh.write('{"id": "c", "conversa')  # interrupted mid-write
    assert done_ids(path) == {"a", "b"}
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["conversations"][0]["from"] == "system"


@pytest.mark.slow
def test_the_command_resumes_after_kill_9_and_writes_nothing_twice(tmp_path, tiny_llama_smollm2_vocab,
                                                                   smollm2_tokenizer):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from ..conftest import write_jsonl

    target = tmp_path / "target"
    tiny_llama_smollm2_vocab.save_pretrained(target)
    smollm2_tokenizer.save_pretrained(target)
    convs = [[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}, {"role": "assistant", "content": "old"},
              {"role": "user", "content": "And twice that?"}, {"role": "assistant", "content": "old"}] for i in range(40)]
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in convs])
    script = Path(__file__).resolve().parents[2] / "data_tools" / "self_distill.py"

    def command(out):
        return [sys.executable, str(script), "--corpus", str(corpus), "--target", str(target), "--out", str(out),
                "--batch-size", "3", "--max-new-tokens", "12", "--max-turns", "2", "--threads", "1"]

    whole = tmp_path / "whole.jsonl"
    done = subprocess.run(command(whole), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "wrote 40 conversations" in done.stdout and "skipped: none" in done.stdout
    killed = tmp_path / "killed.jsonl"
    proc = subprocess.Popen(command(killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and (not killed.exists() or killed.read_text().count("\n") < 5):
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 0 < killed.read_text().count("\n") < 40, "killed too late to test the resume"
    again = subprocess.run(command(killed), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "resuming:" in again.stdout, again.stderr
    lines = killed.read_text().splitlines()
    ids = [json.loads(line)["id"] for line in lines]
    assert len(ids) == len(set(ids)) == 40  # nothing written twice, nothing lost
    assert sorted(lines) == sorted(whole.read_text().splitlines())  # greedy: the same answers either way


def test_conversations_come_by_length_a_window_at_a_time():
    def conv(cid, chars):
        return cid, [{"role": "system", "content": "s"}, {"role": "user", "content": "x" * chars},
                     {"role": "assistant", "content": "y" * (1000 - chars)}]  # the answer's length is not counted

    items = [conv(str(i), n) for i, n in enumerate([50, 10, 40, 30, 20, 5, 60])]
    order = [cid for cid, _ in by_length(items, 3)]
    assert order == ["1", "2", "0", "3", "4", "5", "6"]  # [10 40 50] ascending, [30 20 5] descending, [60]
    assert [cid for cid, _ in by_length(items, 1)] == [str(i) for i in range(7)]  # window 1: the corpus order
    assert sorted(order) == sorted(cid for cid, _ in items)


def test_every_generation_setting_is_checked_against_its_declared_range():
    """Each field declares its range (a field without one fails ``rules``); every value just
    outside it is refused in one line naming the field, the value and what is allowed."""
    from lyanna_train.ranges import rules

    for name, rule in rules(GenerationSettings).items():
        assert rule.ok(getattr(GenerationSettings(), name)) and rule.outside, name
        for value in rule.outside:
            with pytest.raises(LyannaError, match=rf"^GenerationSettings\.{name} = .* is not allowed \(allowed: "):
                GenerationSettings(**{name: value})


def test_the_command_decodes_with_the_settings_defaults_unless_told_otherwise(tmp_path, monkeypatch):
    """Each default is declared once, on GenerationSettings; the command's flags read it."""
    import importlib.util
    from pathlib import Path

    from ..conftest import write_jsonl

    script = Path(__file__).resolve().parents[2] / "data_tools" / "self_distill.py"
    spec = importlib.util.spec_from_file_location("self_distill_command", script)
    command = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(command)
    seen = []
    monkeypatch.setattr(command, "_run", lambda args, corpus, settings: seen.append(settings) or 0)
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVS[0][1]}])
    assert command.main(["--corpus", str(corpus), "--out", str(tmp_path / "a.jsonl")]) == 0
    assert command.main(["--corpus", str(corpus), "--out", str(tmp_path / "b.jsonl"), "--batch-size", "5"]) == 0
    assert seen[0] == GenerationSettings() and seen[0].batch_size == 32
    assert seen[1] == GenerationSettings(batch_size=5)
