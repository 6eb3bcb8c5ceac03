"""Self-distillation: batched regeneration equals one-by-one greedy decoding; resume skips work."""

from __future__ import annotations

import json

import torch

from lyanna_train.data.self_distill import GenerationSettings, SelfDistiller, append_jsonl, done_ids, to_sharegpt

CONVS = [
    ("0", [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
           {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Red."}]),
    ("1", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A much longer question about many things?"},
           {"role": "assistant", "content": "old"}]),
    ("2", [{"role": "user", "content": "no answer here"}]),
]


def test_batched_regeneration_matches_single_greedy(tiny_llama_smollm2_vocab, smollm2_tokenizer):
    model, tok = tiny_llama_smollm2_vocab, smollm2_tokenizer
    distiller = SelfDistiller(model, tok, GenerationSettings(max_new_tokens=6, max_turns=2))
    rows = {cid: msgs for cid, msgs, _ in distiller.regenerate(CONVS)}
    assert set(rows) == {"0", "1"}  # a conversation without an assistant turn yields nothing
    assert [m["role"] for m in rows["0"]] == ["user", "assistant", "user", "assistant"]
    assert rows["0"][0] == CONVS[0][1][0] and rows["0"][2] == CONVS[0][1][2]  # user turns kept
    for cid, msgs in rows.items():
        for k, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            prompt = tok.apply_chat_template(msgs[:k], tokenize=True, add_generation_prompt=True, return_dict=False)
            out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                 eos_token_id=distiller.stop_ids, pad_token_id=distiller.pad_id)[0, len(prompt):].tolist()
            out = out[: next((i for i, t in enumerate(out) if t in distiller.stop_ids), len(out))]
            assert m["content"] == tok.decode(out), (cid, k)


def test_resume_skips_written_ids_and_cuts_a_torn_line(tmp_path):
    path = tmp_path / "out.jsonl"
    append_jsonl(path, [to_sharegpt("a", CONVS[0][1]), to_sharegpt("b", CONVS[1][1])])
    with open(path, "a") as fh:
        fh.write('{"id": "c", "conversa')  # interrupted mid-write
    assert done_ids(path) == {"a", "b"}
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["conversations"][0]["from"] == "system"
