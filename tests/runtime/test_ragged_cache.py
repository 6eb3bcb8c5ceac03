"""The ragged KV cache: rows of different lengths in one forward, each scored as if alone,
rolled back to any accepted path, moved and reused; its masks against the batch-1 ones."""

from __future__ import annotations

import pytest
import torch

from lyanna_train.runtime.drafting.state import chunk_mask
from lyanna_train.runtime.verification.masks import ragged_mask
from lyanna_train.runtime.verification.ragged_cache import RaggedCache
from lyanna_train.runtime.verification.target_step import ragged_forward
from lyanna_train.runtime.token_tree import TokenTree

PROMPTS = [[1, 5, 7, 9, 11, 13, 15, 17, 19], [1, 2], [1, 100, 101, 102, 103]]


def _tree(paths) -> TokenTree:
    tree = TokenTree.rooted_at(paths[0][0])
    for path in paths:
        tree.add_path(path[1:])
    return tree


TREES = [_tree([[20, 21, 22], [20, 23, 24], [20, 25]]), _tree([[30]]), _tree([[40, 41], [40, 42, 43]])]


def _alone(target, seq: list[int]) -> torch.Tensor:
    return target(torch.tensor([seq]), use_cache=False).logits[0, -1]


def _prefill(target, cache: RaggedCache, slot: int, prompt: list[int]) -> torch.Tensor:
    offsets = cache.begin(slice(slot, slot + 1), len(prompt))
    logits, _ = ragged_forward(target, None, cache, torch.tensor([prompt]), torch.arange(len(prompt))[None],
                               chunk_mask(offsets, len(prompt), len(prompt)))
    cache.advance(slot, len(prompt))
    return logits[0]


def _verify(target, cache: RaggedCache, rows: slice, trees: list[TokenTree]) -> torch.Tensor:
    width = max(len(t) for t in trees)
    pad = lambda values, fill: [v + [fill] * (width - len(v)) for v in values]  # noqa: E731
    parents = torch.tensor(pad([t.parents for t in trees], -1))
    offsets = cache.begin(rows, width)
    logits, _ = ragged_forward(target, None, cache, torch.tensor(pad([t.tokens for t in trees], 0)),
                               offsets[:, None] + torch.tensor(pad([t.depths for t in trees], 0)),
                               ragged_mask(offsets, parents, cache.plan.kv_length))
    return logits


def test_rows_of_any_length_are_scored_as_if_alone_and_roll_back_to_any_path(tiny_target):
    """Prefill rows one by one (the buffer grows past its first capacity), verify three
    trees of different sizes in one forward, keep a non-prefix path per row, continue:
    every logit equals a cache-free forward over that row's own sequence."""
    cache = RaggedCache.for_model(tiny_target, slots=3, capacity=4)
    with torch.inference_mode():
        for slot, prompt in enumerate(PROMPTS):
            torch.testing.assert_close(_prefill(tiny_target, cache, slot, prompt)[-1], _alone(tiny_target, prompt),
                                       atol=1e-4, rtol=1e-4)
        logits = _verify(tiny_target, cache, slice(0, 3), TREES)
        for i, tree in enumerate(TREES):
            for node in range(len(tree)):
                seq = PROMPTS[i] + tree.path_tokens(tree.ancestors(node))
                torch.testing.assert_close(logits[i, node], _alone(tiny_target, seq), atol=1e-4, rtol=1e-4)
        kept = [TREES[0].ancestors(4), [0], TREES[2].ancestors(3)]  # 20 -> 23 -> 24; root only; 40 -> 42 -> 43
        assert kept[0] != list(range(len(kept[0])))
        cache.keep(slice(0, 3), kept)
        assert cache.lengths == [len(p) + len(k) for p, k in zip(PROMPTS, kept)]
        after = _verify(tiny_target, cache, slice(0, 3), [_tree([[50, 51]]), _tree([[60]]), _tree([[70]])])
        for i, (k, nxt) in enumerate(zip(kept, ([50, 51], [60], [70]))):
            seq = PROMPTS[i] + TREES[i].path_tokens(k) + nxt
            torch.testing.assert_close(after[i, len(nxt) - 1], _alone(tiny_target, seq), atol=1e-4, rtol=1e-4)


def test_a_moved_row_and_a_reused_slot_decode_as_if_alone(tiny_target):
    cache = RaggedCache.for_model(tiny_target, slots=2)
    with torch.inference_mode():
        _prefill(tiny_target, cache, 0, PROMPTS[0])
        _prefill(tiny_target, cache, 1, PROMPTS[2])
        cache.move_row(1, 0)  # row 0 finished: the last row takes its slot
        assert cache.lengths == [len(PROMPTS[2]), 0]
        _prefill(tiny_target, cache, 1, PROMPTS[1])  # the freed slot, reused
        logits = _verify(tiny_target, cache, slice(0, 2), [_tree([[40, 41]]), _tree([[30, 31]])])
        torch.testing.assert_close(logits[0, 1], _alone(tiny_target, PROMPTS[2] + [40, 41]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[1, 1], _alone(tiny_target, PROMPTS[1] + [30, 31]), atol=1e-4, rtol=1e-4)


def test_ragged_mask_lets_each_node_see_its_rows_cache_and_its_own_path():
    trees = TREES + [TokenTree.rooted_at(3)]
    width = max(len(t) for t in trees)
    parents = torch.tensor([t.parents + [-1] * (width - len(t)) for t in trees])
    offsets = torch.tensor([4, 0, 7, 2])
    mask = ragged_mask(offsets, parents, 7 + width)
    for i, tree in enumerate(trees):
        n, past = len(tree), int(offsets[i])
        assert mask[i, 0, :n, :past].all()
        for node in range(n):
            assert mask[i, 0, node, past:past + n].nonzero().flatten().tolist() == tree.ancestors(node)
        assert not mask[i, 0, :n, past + n:].any()  # nothing past the row's own nodes
        for j in range(n, width):  # padding: the row's cache and itself, seen by nobody
            assert mask[i, 0, j].nonzero().flatten().tolist() == list(range(past)) + [past + j]
            assert not mask[i, 0, :, past + j][:n].any()


def test_a_decoders_caches_are_freed_when_it_is_dropped_without_the_collector(tiny_target, tiny_fitted):
    """No reference cycle keeps a finished decoder's KV buffers (hundreds of MB at 16 rows)
    alive until the cyclic collector runs: dropping the decoder frees them at once."""
    import gc
    import weakref

    from lyanna_train.runtime.scheduling.scheduler import BatchDecoder

    from .conftest import LAYER_IDS

    gc.disable()
    try:
        for draft in (None, tiny_fitted[True]):  # the draft with its state pool: the most it holds
            decoder = BatchDecoder(tiny_target, draft, max_batch=2, layer_ids=LAYER_IDS if draft else None)
            for _ in range(2):
                decoder.submit([1, 2, 3, 4], 4, eos_ids=())
            for _ in decoder.run():
                pass
            buffer = weakref.ref(decoder.batch.cache.buffer)
            del decoder
            assert buffer() is None
    finally:
        gc.enable()
