"""Fingerprints that let each stage refuse an artifact made for another tokenizer."""

from __future__ import annotations

import hashlib
import json
import weakref
from operator import itemgetter

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
    added = tuple((tid, tok.content, tok.special) for tid, tok in tokenizer.added_tokens_decoder.items())
    guard = (len(tokenizer), added, tuple(map(str, tokenizer.all_special_tokens)))
    try:
        known = _KNOWN.get(tokenizer)
    except TypeError:  # an unhashable stand-in
        known = None
    if known is not None and known[0] == guard:
        return known[1]
    vocab = tokenizer.get_vocab()
    if len(set(vocab.values())) == len(vocab):  # ids unique (the usual case): the same order, 2x faster
        ordered = sorted(vocab.items(), key=itemgetter(1))
    else:
        ordered = sorted(vocab.items(), key=lambda kv: (kv[1], kv[0]))
    specials = sorted(
        (tid, tok.content) for tid, tok in tokenizer.added_tokens_decoder.items() if tok.special
    )
    payload = json.dumps(
        {"vocab": ordered, "special": specials, "named": sorted(map(str, tokenizer.all_special_tokens))},
        ensure_ascii=False,
    )
    fingerprint = "sha256:" + hashlib.sha256(payload.encode("utf-8")).hexdigest()
    try:
        _KNOWN[tokenizer] = (guard, fingerprint)
    except TypeError:
        pass
    return fingerprint


def vocab_size(tokenizer) -> int:
    """The id range a counts vector must cover (added tokens may lie past the base vocab)."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
