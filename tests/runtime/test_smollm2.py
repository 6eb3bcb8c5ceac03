"""Lossless speculative decoding on the embedded SmolLM2 through every CPU linear form,
against target.generate with torch's own linears, with a head whose draft tokens are
accepted (``smollm2_fitted``): draft nodes are verified and kept, not only proposed.

The forms are set by hand, every form at some row count the decoding meets (with padding
at some), rather than timed: timing picks whichever is fastest on the machine and may leave
a form unused, and takes ~30 s (the tuning itself: test_cpu_tuning.py)."""

from __future__ import annotations

import pytest
import torch

from lyanna_train.runtime.cpu.small_linear import FORMS, LARGE, MAX_ROWS, settle_packing, use_small_batch_linears
from lyanna_train.runtime.pricing.cost import Costs, DraftCost, VerifyCost
from lyanna_train.runtime.scheduling.scheduler import generate
from lyanna_train.runtime.settings import DecodeSettings, LookupSettings, TreeShape


def _every_form(model) -> set[str]:
    """Row count r (1..9, a decode's counts) takes the r-th form in turn, padded to r + 1 at
    every third count, 10..MAX_ROWS F.linear (MKL's packed form keeps a copy of the weights
    per count); past MAX_ROWS (a prefill) the last form that is not MKL's packed one -> the
    forms rows 1..9 use."""
    names = list(FORMS)
    large = next(n for n in reversed(names) if n != "mkl_packed")  # MKL packs per count: never past MAX_ROWS
    forms = use_small_batch_linears(model)
    forms[:] = [("linear", 0)] + [(names[r % len(names)], min(MAX_ROWS, r + (r % 3 == 0))) if r < 10 else
                                  ("linear", r) for r in range(1, MAX_ROWS + 1)] + [(large, 0)]
    assert len(forms) == LARGE + 1
    settle_packing(model)
    return {forms[r][0] for r in range(1, 10)}


@pytest.mark.slow
def test_lossless_on_smollm2_with_accepted_draft_tokens(smollm2_fitted):
    target, draft = smollm2_fitted.target, smollm2_fitted.draft
    assert _every_form(target) == _every_form(draft) == set(FORMS)
    off = LookupSettings(0, pool_tokens=0)
    chain = DecodeSettings(TreeShape(4, 1, 1, 4), off, verify="all")  # draft nodes only, every one verified
    tree = DecodeSettings(TreeShape(3, 3, 3, 8), LookupSettings(5, pool_tokens=0))  # verify: auto
    steep = Costs(VerifyCost([1, 4, 8, 16], [1.0, 1.2, 2.0, 4.0]), DraftCost([1, 4], [0.1, 0.3]))  # widths vary
    widths = set()
    try:
        for prompt, ref in zip(smollm2_fitted.prompts, smollm2_fitted.refs):
            out = generate(target, draft, prompt, len(ref), chain, eos_ids=())
            assert out.tokens == ref
            assert out.target_forwards == 1 + len(out.accept_lengths)
            drafted = sum(n - 1 for n in out.accept_lengths)  # draft tokens the target accepted
            assert drafted >= len(ref) // 2, out.accept_lengths  # most tokens came from the draft
            out = generate(target, draft, prompt, len(ref), tree, eos_ids=(), cost=steep)
            assert out.tokens == ref
            widths |= set(out.tree_sizes)
        # over the two prompts the steep costs chose more than one width (a prompt whose draft
        # accepts every node may keep one width throughout: the fit differs a little per CPU)
        assert len(widths) > 1, widths
    finally:  # the fitted target is shared: later tests get torch's own linears back
        use_small_batch_linears(target, enabled=False)
        use_small_batch_linears(draft, enabled=False)
