"""The supported-architecture table, kept true: for each architecture in it, a tiny random
target goes through the whole pipeline — hot vocabulary, a few training steps, export —
and decodes greedily token for token as the target itself does, under eager and SDPA
attention, with the draft's chain really verified (drafted tokens accepted). Other
architectures are refused at the start in one line.

The corpus is the target's own greedy answers to four prompts, so a few dozen steps make
a head whose drafts the target accepts (what makes the lossless check bite). Sliding-
window architectures get a window of 8, shorter than prompt + answer: the windows are
exercised, not just declared.
"""

from __future__ import annotations

import json

import pytest
import torch

from lyanna_train.errors import LyannaError
from lyanna_train.target.support import TESTED

ANSWER = 32
QUESTIONS = ["Write a haiku about the sea.", "What is 17 times 3?", "Name three colours.", "Explain recursion."]
SHAPES = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
              eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
ARCHITECTURES = {  # model_type -> (config class, model class, what differs from SHAPES)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 32,
                                                            "shared_expert_intermediate_size": 32}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
NO_SDPA = {"gemma2"}  # transformers gives Gemma2 eager attention only (SDPA cannot softcap)
FAST = {"llama", "gemma2"}  # the fast tier keeps one plain and one sliding-window, eager-only architecture


def test_the_matrix_covers_the_table():
    assert set(ARCHITECTURES) == set(TESTED)


def _cases():
    for kind in ARCHITECTURES:
        for impl in ("eager", "sdpa"):
            if impl == "sdpa" and kind in NO_SDPA:
                continue
            marks = () if kind in FAST else (pytest.mark.slow,)
            yield pytest.param(kind, impl, id=f"{kind}-{impl}", marks=marks)


def _save_target(kind: str, root, tokenizer):
    import transformers

    config_cls, model_cls, extra = ARCHITECTURES[kind]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**SHAPES, **extra)).eval()
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    return root / "target"


def _prompts(tokenizer) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]) for q in QUESTIONS]


def _reference(target, prompts) -> list[list[int]]:
    with torch.inference_mode():
        return [target.generate(torch.tensor([p]), max_new_tokens=ANSWER, min_new_tokens=ANSWER,
                                do_sample=False)[0, len(p):].tolist() for p in prompts]


def _export(kind: str, tokenizer, tmp_path_factory):
    """The pipeline for one architecture, run once per test run and shared by its eager and
    SDPA cases, whichever pytest-xdist workers they land on."""
    from ..conftest import folder_once_per_run

    root = folder_once_per_run(tmp_path_factory, f"architecture-{kind}", lambda root: _pipeline(kind, tokenizer, root))
    return root / "target", root / "export", _prompts(tokenizer)


def _pipeline(kind: str, tokenizer, root) -> None:
    from lyanna_train.cli.plan import compose
    from lyanna_train.export.writer import export_checkpoint
    from lyanna_train.hotvocab.build import build
    from lyanna_train.hotvocab.counting import CountSettings
    from lyanna_train.hotvocab.selection import SelectionRequest
    from lyanna_train.target.model import load_target_model
    from lyanna_train.training.loop import train

    target_dir = _save_target(kind, root, tokenizer)
    prompts = _prompts(tokenizer)
    answers = _reference(load_target_model(target_dir), prompts)
    corpus = root / "answers.jsonl"
    corpus.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": q},
                                                             {"from": "gpt", "value": tokenizer.decode(a)}]}) + "\n"
                              for q, a in zip(QUESTIONS, answers)))
    build([str(corpus)], str(target_dir), root / "hotvocab", [SelectionRequest(size=512)], CountSettings(),
          progress=False, say=lambda *_: None)
    # 25 steps unrolled 5 deep (the chain preset's depth): 28 to 120 drafted tokens accepted per
    # architecture, 16 needed (40 steps unrolled 7 deep: 29 to 120, ~40 % longer)
    train(compose([f"target.name={target_dir}", f"data.corpus=[{corpus}]", f"train.out_dir={root / 'run'}",
                   f"hotvocab.path={root / 'hotvocab'}", "hotvocab.size=512", "target.aux_layers=[0,1,2]",
                   "data.max_length=128", "data.batch_tokens=512", "data.shard_tokens=1024", "draft.pool_size=128",
                   "train.max_steps=25", "train.epochs=1000", "train.lr=5e-3", "loss.ttt_steps=5", "train.warmup_steps=2",
                   "train.log_every=100", "train.save_every=1000", "train.threads=1", "eval.every=0",
                   "eval.num_prompts=0", "tracking.wandb.enabled=false"]))
    export_checkpoint(root / "run", root / "export", say=lambda *_: None)


@pytest.mark.parametrize("kind,impl", list(_cases()))
@pytest.mark.slow
def test_the_pipeline_decodes_losslessly_with_accepted_drafts(kind, impl, smollm2_tokenizer, tmp_path_factory,
                                                             one_thread):
    from lyanna_train.export.reader import load_exported
    from lyanna_train.runtime.scheduling.scheduler import generate
    from lyanna_train.runtime.scheduling.scheduler import generate_batch
    from lyanna_train.runtime.settings import load_decode_settings
    from lyanna_train.target.model import load_target_model

    target_dir, export, prompts = _export(kind, smollm2_tokenizer, tmp_path_factory)
    target = load_target_model(target_dir, attn_implementation=impl)
    assert target.config._attn_implementation == impl
    draft = load_exported(export, target, smollm2_tokenizer)[0]
    expected = _reference(target, prompts)
    chain = load_decode_settings("chain")  # every drafted token verified, no prompt lookup
    batched = generate_batch(target, draft, prompts, ANSWER, chain, max_batch=len(prompts), eos_ids=())
    assert [r.tokens for r in batched] == expected
    accepted = sum(a - 1 for r in batched for a in r.accept_lengths)
    assert accepted >= ANSWER // 2, f"only {accepted} drafted tokens accepted over {len(prompts)} prompts"
    alone = generate(target, draft, prompts[0], ANSWER, chain, eos_ids=())
    assert alone.tokens == expected[0] and max(alone.accept_lengths) > 1


def test_a_gpt2_target_is_refused_at_the_start_naming_what_it_lacks(tmp_path, smollm2_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    from lyanna_train.target.model import load_target_model
    from lyanna_train.training.plan import target_config

    GPT2LMHeadModel(GPT2Config(vocab_size=49152, n_embd=32, n_layer=2, n_head=2)).save_pretrained(tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    for load in (load_target_model, target_config):
        with pytest.raises(LyannaError) as err:
            load(str(tmp_path))
        message = str(err.value)
        assert "\n" not in message and "gpt2" in message and "rotary position embeddings" in message
        assert "intermediate_size" in message and "Llama" in message and "Gemma2" in message
