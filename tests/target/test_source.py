"""Tokenizer resolution, GGUF caching and fingerprints."""

from __future__ import annotations

import pytest

from lyanna_train.errors import LyannaError
from lyanna_train.target.fingerprint import tokenizer_fingerprint, vocab_size
from lyanna_train.target.source import load_tokenizer, resolve_target


def test_embedded_smollm2_tokenizer(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.is_fast and vocab_size(tok) == 49152
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    ref = resolve_target("smollm2")
    assert ref.gguf_file.endswith(".gguf") and (ref.cache_dir / "tokenizer" / "tokenizer_config.json").exists()


@pytest.mark.slow
def test_fingerprint_is_stable_and_sensitive(smollm2_tokenizer, header_template_dir, tmp_path):
    from transformers import AutoTokenizer

    fp = tokenizer_fingerprint(smollm2_tokenizer)
    assert fp == tokenizer_fingerprint(load_tokenizer("smollm2"))
    # a different chat template does not change the vocabulary, hence not the fingerprint
    assert fp == tokenizer_fingerprint(AutoTokenizer.from_pretrained(header_template_dir))
    other = AutoTokenizer.from_pretrained(header_template_dir)
    assert tokenizer_fingerprint(other) == fp  # remembered for this object from here on
    other.add_tokens(["<brand-new-token>"])
    assert tokenizer_fingerprint(other) != fp
    renamed = AutoTokenizer.from_pretrained(header_template_dir)
    assert tokenizer_fingerprint(renamed) == fp
    renamed.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<x-special>"]})
    assert tokenizer_fingerprint(renamed) != fp  # a special token more: hashed again, not the remembered value


def test_the_remembered_fingerprint_is_the_one_computed_from_scratch():
    """The remembered value is the hash of the documented payload, twice in a row, with ids
    unique and with a shared id (the token breaks the tie)."""
    import hashlib
    import json

    class Tok:
        def __init__(self, vocab):
            self.vocab, self.added_tokens_decoder, self.all_special_tokens = vocab, {}, ["<s>"]

        def __len__(self):
            return len(self.vocab)

        def get_vocab(self):
            return dict(self.vocab)

    def by_hand(vocab):
        payload = json.dumps({"vocab": sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])), "special": [],
                              "named": ["<s>"]}, ensure_ascii=False)
        return "sha256:" + hashlib.sha256(payload.encode("utf-8")).hexdigest()

    unique = {"b": 1, "a": 2, "<s>": 0, "é": 3}
    shared = {"b": 1, "a": 1, "<s>": 0}  # the token breaks the tie
    for vocab in (unique, shared):
        tok = Tok(vocab)
        assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(tok) == by_hand(vocab)


@pytest.mark.parametrize("spec,message", [
    ("/no/such/dir", "tokenizer not found"),
    ("not-an-embedded-name", "tokenizer not found"),
])
def test_unresolvable_tokenizers(spec, message):
    with pytest.raises(LyannaError, match=message):
        resolve_target(spec)


def test_non_gguf_file_is_refused(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    with pytest.raises(LyannaError, match="must be a .gguf"):
        resolve_target(str(f))
