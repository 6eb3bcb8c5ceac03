"""Lossless speculative decoding on the embedded SmolLM2 with a random draft head, through
the measured linear forms, against target.generate with torch's own linears."""

from __future__ import annotations

import pytest
import torch

from lyanna_train.models.config import DraftConfig
from lyanna_train.models.draft_head import DraftHead
from lyanna_train.runtime.cpu_tuning import tune
from lyanna_train.runtime.decode import DecodeSettings, LookupSettings, generate
from lyanna_train.runtime.draft_tree import TreeShape


@pytest.mark.slow
def test_lossless_on_smollm2(smollm2_tokenizer):
    from lyanna_train.target.model import load_target_model

    target = load_target_model("smollm2")
    torch.manual_seed(0)
    cfg = DraftConfig.from_target(target.config, draft_vocab_size=2048, pool_size=128, pool_threshold=0.0)
    draft = DraftHead(cfg, torch.randperm(target.config.vocab_size)[:2048], target.get_input_embeddings().weight).eval()
    prompts = [smollm2_tokenizer(text)["input_ids"] for text in ("The capital of France is", "def fibonacci(n):")]
    with torch.inference_mode():  # torch's own linears: what an unmodified transformers gives
        refs = [target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    cost = tune(target, draft, cache=False)  # as the CLIs run it
    for prompt, ref in zip(prompts, refs):
        for settings in (DecodeSettings(TreeShape(4, 1, 1, 4)), DecodeSettings(TreeShape(3, 3, 3, 8), LookupSettings(5))):
            out = generate(target, draft, prompt, 16, settings, cost=cost)  # EOS from the target's generation_config, as generate
            assert out.tokens == ref
            assert out.target_forwards == 1 + len(out.accept_lengths)
