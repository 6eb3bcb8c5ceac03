"""Fingerprints that let each stage refuse an artifact made for another tokenizer."""

from __future__ import annotations

import hashlib
import json


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the vocabulary (token -> id, added tokens included) and special tokens.

    Two tokenizers with the same fingerprint map every string to the same ids, which
    is what counts, hot-vocab maps and feature caches depend on.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    specials = sorted(
        (tid, tok.content) for tid, tok in tokenizer.added_tokens_decoder.items() if tok.special
    )
    payload = json.dumps(
        {"vocab": vocab, "special": specials, "named": sorted(map(str, tokenizer.all_special_tokens))},
        ensure_ascii=False,
    )
    return "sha256:" + hashlib.sha256(payload.encode("utf-8")).hexdigest()


def vocab_size(tokenizer) -> int:
    """The id range a counts vector must cover (added tokens may lie past the base vocab)."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
