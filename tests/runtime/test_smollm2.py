"""Lossless speculative decoding on the embedded SmolLM2 through the measured linear forms,
against target.generate with torch's own linears, with a head whose draft tokens are
accepted (``smollm2_fitted``): draft nodes are verified and kept, not only proposed."""

from __future__ import annotations

import pytest
import torch

from lyanna_train.runtime.cpu.tuning import tune
from lyanna_train.runtime.scheduling.scheduler import generate
from lyanna_train.runtime.settings import DecodeSettings, LookupSettings, TreeShape


@pytest.mark.slow
def test_lossless_on_smollm2_with_accepted_draft_tokens(smollm2_fitted):
    target, draft = smollm2_fitted.target, smollm2_fitted.draft
    off = LookupSettings(0, pool_tokens=0)
    chain = DecodeSettings(TreeShape(4, 1, 1, 4), off, verify="all")  # draft nodes only, every one verified
    tree = DecodeSettings(TreeShape(3, 3, 3, 8), LookupSettings(5, pool_tokens=0))  # verify: auto, measured costs
    cost = tune(target, draft, shape=tree.tree, cache=False)  # as the CLIs run it
    for prompt, ref in zip(smollm2_fitted.prompts, smollm2_fitted.refs):
        out = generate(target, draft, prompt, len(ref), chain, eos_ids=())
        assert out.tokens == ref
        assert out.target_forwards == 1 + len(out.accept_lengths)
        drafted = sum(n - 1 for n in out.accept_lengths)  # draft tokens the target accepted
        assert drafted >= len(ref) // 2, out.accept_lengths  # most tokens came from the draft
        assert generate(target, draft, prompt, len(ref), tree, eos_ids=(), cost=cost).tokens == ref
