"""Regeneration's one pass: the feature cache written while decoding is the one the planned
build makes from the regenerated JSONL (the trainer's build finds every shard done), its
features equal a teacher-forced pass, with speculation on and off, at batch 1 and 3; a
run cut anywhere resumes to the same files, writing nothing twice."""

from __future__ import annotations

import json

import pytest
import torch

from lyanna_train.data.corpus import Corpus
from lyanna_train.data.distilled_output import DistilledOutput
from lyanna_train.data.feature_cache import FeatureCache
from lyanna_train.data.feature_cache_writer import CacheSettings, build_feature_cache
from lyanna_train.data.samples import CorpusSamples
from lyanna_train.data.self_distill import GenerationSettings, SelfDistiller, to_sharegpt
from lyanna_train.errors import LyannaError
from lyanna_train.runtime.scheduling.scheduler import BatchDecoder
from lyanna_train.runtime.settings import DecodeSettings, LookupSettings

LAYERS = (0,)  # the tiny target has two layers; the last is "last"
SETTINGS = CacheSettings(shard_tokens=96)  # several shards from a few conversations
CONVS = [(str(i), [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                   {"role": "assistant", "content": "old"},
                   {"role": "user", "content": "And twice that, please?"},
                   {"role": "assistant", "content": "old"}]) for i in range(9)]
CONVS.append(("9", [{"role": "user", "content": "no answer to this one"}]))  # skipped, never fatal


WORDS = " the cat sat on a mat and dog ran far away to see big red sun over hill".split()


@pytest.fixture(scope="module")
def word_target(smollm2_tokenizer):
    """A tiny random Llama over SmolLM2's vocabulary that only says space-led whole words
    (and sometimes stops): its answers, decoded to text, tokenize back to the same ids, as
    a real target's mostly do (a random one's newlines and word pieces do not)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         initializer_range=0.2)  # varied continuations
    model = LlamaForCausalLM(config).eval()
    ids = [smollm2_tokenizer.backend_tokenizer.encode(" " + w, add_special_tokens=False).ids[0] for w in WORDS]
    with torch.no_grad():
        weight = model.lm_head.weight
        weight.zero_()
        directions = torch.randn(len(ids) // 2, 32)
        for k, token in enumerate(ids):  # each direction and its opposite: some word always wins
            weight[token] = 50 * directions[k // 2] * (1 if k % 2 == 0 else -1)
        weight[2] = 40 * directions[3]  # the end of turn, now and then
    return model


def regenerate(model, tok, jsonl, root, batch: int, speculate: bool = True, convs=CONVS, stop_after=None):
    # no draft: the shipped default speculates with prompt lookup alone
    decode = DecodeSettings() if speculate else DecodeSettings(lookup=LookupSettings(0, pool_tokens=0))
    decoder = BatchDecoder(model, None, decode, max_batch=batch, layer_ids=LAYERS, record_features=True)
    settings = GenerationSettings(max_new_tokens=5, max_turns=2, batch_size=batch, max_prompt_tokens=200)
    distiller = SelfDistiller(decoder, tok, settings, record_features=True)
    out = DistilledOutput(jsonl, root, model, tok, LAYERS, SETTINGS, {"corpus": [str(jsonl)]})
    for n, r in enumerate(distiller.regenerate(convs)):
        if stop_after is not None and n == stop_after:
            return out  # "killed": nothing closed
        out.add(to_sharegpt(r.cid, r.messages), r.features)
    out.close()
    return out


def planned_build(model, tok, jsonl, root):
    samples = CorpusSamples(Corpus.resolve([str(jsonl)]), tok)
    return build_feature_cache(samples, model, tok, root, layer_ids=LAYERS, settings=SETTINGS, progress=False,
                               say=lambda *_: None)


def one_pass_equals_two(tmp_path, model, tok, batch, speculate):
    """Regenerate with features recorded, then check the cache against the trainer's build."""
    jsonl, root = tmp_path / "regen.jsonl", tmp_path / "features"
    out = regenerate(model, tok, jsonl, root, batch, speculate)
    lines = jsonl.read_text().splitlines()
    assert len(lines) == 9 and len({json.loads(x)["id"] for x in lines}) == 9
    assert len(out.plan) >= 3
    assert out.recomputed == 0  # every sample keeps what the decoder recorded

    again = planned_build(model, tok, jsonl, root)  # what lyanna-train runs over data.cache_dir
    assert again.shards_written == 0 and again.shards_reused == again.shards_total == len(out.plan)

    planned_build(model, tok, jsonl, tmp_path / "reference")  # a second, teacher-forced pass
    ours, reference = FeatureCache(root), FeatureCache(tmp_path / "reference")
    pairs = list(zip(ours.iter_samples(), reference.iter_samples(), strict=True))
    assert len(pairs) == 9
    for a, b in pairs:
        assert a["index"] == b["index"] and torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"]) and torch.equal(a["teacher_top1"], b["teacher_top1"])
        for key in ("aux", "last"):  # both stored in bf16: one rounding step apart at most
            torch.testing.assert_close(a[key].float(), b[key].float(), atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(a["teacher_lse"], b["teacher_lse"], atol=1e-4, rtol=1e-5)
    return [json.loads(x) for x in lines]


@pytest.mark.parametrize(("batch", "speculate"), [(1, True), (3, True), (3, False)])
@pytest.mark.slow
def test_the_trainer_finds_the_cache_complete_and_equal_to_a_teacher_forced_build(
        tmp_path, word_target, smollm2_tokenizer, batch, speculate):
    one_pass_equals_two(tmp_path, word_target, smollm2_tokenizer, batch, speculate)


@pytest.mark.slow
def test_answers_that_tokenize_otherwise_as_text_keep_the_ids_the_target_emitted(tmp_path, smollm2_tokenizer):
    """A random target's word pieces and newlines do not survive decoding to text and
    tokenizing again: the regenerated line keeps the emitted ids, the sample is built from
    them, and the recorded features are used as they are."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         initializer_range=0.2)
    model, tok = LlamaForCausalLM(config).eval(), smollm2_tokenizer
    records = one_pass_equals_two(tmp_path, model, tok, 3, True)
    answers = [r["conversations"][-1] for r in records]
    assert all("token_ids" in a for a in answers)
    assert all("token_ids" not in t for r in records for t in r["conversations"][:-1])  # history is text
    otherwise = [a for a in answers if tok.encode(a["value"], add_special_tokens=False) != a["token_ids"]]
    assert len(otherwise) >= 3  # the case this test is for, not a target whose text round-trips


@pytest.mark.slow
def test_a_run_cut_after_any_conversation_resumes_to_the_same_files(tmp_path, word_target,
                                                                   smollm2_tokenizer):
    model, tok = word_target, smollm2_tokenizer
    whole = tmp_path / "whole.jsonl"
    regenerate(model, tok, whole, tmp_path / "whole", 3)
    jsonl, root = tmp_path / "cut.jsonl", tmp_path / "cut"
    first = regenerate(model, tok, jsonl, root, 3, stop_after=5)
    assert 0 < first.done < 5  # some conversations on disk, the latest ones only in memory
    with open(jsonl, "a") as fh:  # killed between a shard's lines and its shard: lines past the manifest
        fh.write(json.dumps(to_sharegpt("x", CONVS[0][1])) + "\n" + '{"id": "y", "conv')
    (root / "shards" / "shard-00099.safetensors").write_bytes(b"partial")
    done = {json.loads(x)["id"] for x in jsonl.read_text().splitlines()[:first.done]}
    rest = [c for c in CONVS if c[0] not in done]
    regenerate(model, tok, jsonl, root, 3, convs=rest)
    assert not (root / "shards" / "shard-00099.safetensors").exists()
    ids = [json.loads(x)["id"] for x in jsonl.read_text().splitlines()]
    assert sorted(ids) == sorted(json.loads(x)["id"] for x in whole.read_text().splitlines())  # nothing twice
    again = planned_build(model, tok, jsonl, root)
    assert again.shards_written == 0  # the resumed cache still matches its JSONL, shard for shard


def test_conversations_without_their_features_are_refused(tmp_path, word_target, smollm2_tokenizer):
    jsonl = tmp_path / "regen.jsonl"
    jsonl.write_text(json.dumps(to_sharegpt("0", CONVS[0][1])) + "\n")
    with pytest.raises(LyannaError, match="holds no features of them"):
        DistilledOutput(jsonl, tmp_path / "features", word_target, smollm2_tokenizer, LAYERS, SETTINGS)
    assert jsonl.read_text().count("\n") == 1  # nothing lost


@pytest.mark.slow
def test_the_command_writes_the_conversations_and_their_cache(tmp_path, word_target, smollm2_tokenizer):
    import subprocess
    import sys
    from pathlib import Path

    from ..conftest import write_jsonl

    target = tmp_path / "target"
    word_target.save_pretrained(target)
    smollm2_tokenizer.save_pretrained(target)
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for _, m in CONVS])
    script = Path(__file__).resolve().parents[2] / "data_tools" / "self_distill.py"
    out, features = tmp_path / "regen.jsonl", tmp_path / "features"
    done = subprocess.run([sys.executable, str(script), "--corpus", str(corpus), "--target", str(target), "--out",
                           str(out), "--features", str(features), "--layers", "0", "--shard-tokens", "96",
                           "--max-new-tokens", "5", "--max-turns", "2", "--batch-size", "3", "--threads", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "wrote 9 conversations" in done.stdout and f"features: {features} (" in done.stdout
    again = planned_build(word_target, smollm2_tokenizer, out, features)
    assert again.shards_written == 0 and again.shards_total >= 3
