"""Fixtures for training tests: a tiny random target on disk and a composed config."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..conftest import write_jsonl


@pytest.fixture(scope="session")
def tiny_target_dir(smollm2_tokenizer, tmp_path_factory) -> Path:
    """A 4-layer random Llama over the SmolLM2 vocabulary, saved like any HF model directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    out = tmp_path_factory.mktemp("tiny-target")
    LlamaForCausalLM(config).save_pretrained(out)
    smollm2_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_corpus(sharegpt_records, tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "train.jsonl", sharegpt_records[:40])


def compose(overrides: list[str]):
    """The config lyanna-train would run with these overrides (recipes registered)."""
    from lyanna_train.cli.plan import compose as compose_config

    return compose_config(overrides)


def tiny_overrides(target: Path, corpus: Path, out: Path, *extra: str) -> list[str]:
    return [f"target.name={target}", f"data.corpus=[{corpus}]", f"train.out_dir={out}", "data.max_length=128",
            "data.batch_tokens=512", "data.shard_tokens=1024", "loss.ttt_steps=2", "draft.pool_size=128",
            "train.log_every=1", "train.warmup_steps=2", "eval.every=0", "eval.num_prompts=1",
            "eval.max_new_tokens=6", "eval.depth=2", "tracking.wandb.enabled=false", "train.threads=1", *extra]
