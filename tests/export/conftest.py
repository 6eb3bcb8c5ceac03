"""The export tests' shared target (a tiny random Llama, built once per module) and the
embedded tokenizer's fingerprint."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def target():
    from .test_export import _target

    return _target(0)


@pytest.fixture(scope="module")
def tok_fp(smollm2_tokenizer):
    from lyanna_train.target.fingerprint import tokenizer_fingerprint

    return tokenizer_fingerprint(smollm2_tokenizer)
