"""Fingerprints that let each stage refuse an artifact made for another tokenizer."""

from __future__ import annotations

import hashlib
import json
import weakref

# tokenizer -> (what would change its fingerprint, the fingerprint). A training run asks for
# its tokenizer's fingerprint five times (hot vocabulary, feature cache, manifest, run
# record), ~0.1 s each on a 49k vocabulary; a tokenizer that gains or renames a token is
# hashed again.
_KNOWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the vocabulary (token -> id, added tokens included) and special tokens.

    Two tokenizers with the same fingerprint map every string to the same ids, which
    is what counts, hot-vocab maps and feature caches depend on.
    """
    added = sorted((tid, tok.content, tok.special) for tid, tok in tokenizer.added_tokens_decoder.items())
    named = sorted(map(str, tokenizer.all_special_tokens))
    guard = (len(tokenizer), added, named)
    known = _KNOWN.get(tokenizer)
    if known is not None and known[0] == guard:
        return known[1]
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    specials = [(tid, content) for tid, content, special in added if special]
    payload = json.dumps({"vocab": vocab, "special": specials, "named": named}, ensure_ascii=False)
    fingerprint = "sha256:" + hashlib.sha256(payload.encode("utf-8")).hexdigest()
    _KNOWN[tokenizer] = (guard, fingerprint)
    return fingerprint


def vocab_size(tokenizer) -> int:
    """The id range a counts vector must cover (added tokens may lie past the base vocab)."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
