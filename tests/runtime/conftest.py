"""A tiny random Llama target, draft heads for it, and an oracle that drafts its greedy continuation."""

from __future__ import annotations

import pytest
import torch

from lyanna_train.models.config import DraftConfig
from lyanna_train.models.draft_head import DraftHead

V, H = 256, 64
LAYER_IDS = (0, 1, 2)  # default_layer_ids needs more than 4 layers


def add_oracle_chain(tree, full, n: int, right: int, depth: int, decoys: int = 0) -> None:
    """A chain of ``depth`` guesses of x_n.. under the root: the reference tokens for the
    first ``right``, then wrong ones; ``decoys`` wrong siblings before each chain node."""
    parent = 0
    for j in range(depth):
        token = full[n + j] if j < right else (full[n + j] + 1) % V
        for k in range(1, decoys + 1):
            tree.add(parent, (token + 7 * k) % V)
        parent = tree.add(parent, token)


@pytest.fixture(autouse=True)
def _tiny_models_on_one_thread(one_thread):
    """Every runtime test on one thread (see ``one_thread`` in tests/conftest.py)."""
    yield


@pytest.fixture(scope="session")
def tiny_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # initializer_range 0.2: varied continuations (0.02 falls into loops at once) and clear argmax margins.
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                         bos_token_id=1, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    model.requires_grad_(False)
    return model


def make_draft(target, pool: bool, draft_vocab: int = 64, seed: int = 0, **variant) -> DraftHead:
    """``variant``: DraftConfig switches (norm_before_residual, norm_before_fc, fc_norm, norm_output, aux_scale)."""
    torch.manual_seed(seed)
    # Threshold 0 when the pool is on: random states rarely reach 0.85, and fusion must be exercised.
    cfg = DraftConfig(target_hidden_size=H, vocab_size=V, draft_vocab_size=draft_vocab, hidden_size=H,
                      intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      pool_size=128 if pool else 0, pool_threshold=0.0, **variant)
    hot = torch.randperm(V)[:draft_vocab]
    draft = DraftHead(cfg, hot, target.model.embed_tokens.weight).eval()
    with torch.no_grad():  # norms away from 1, so a missing or doubled norm shows
        for module in (draft.norm, draft.input_norm):
            if module is not None:
                module.weight.uniform_(0.5, 2.0)
        if cfg.aux_scale:
            draft.aux_scale.uniform_(0.1, 2.0)
    return draft


def greedy_reference(target, prompt: list[int], max_new_tokens: int, eos=None) -> list[int]:
    """target.generate(do_sample=False): the output speculative decoding must reproduce."""
    ids = torch.tensor([prompt])
    out = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def oracle_trees(full_for, good=None, decoys: int = 0):
    """A stand-in for the head's ``draft_trees`` (patch it into
    ``lyanna_train.runtime.drafting.propose``) that drafts each row's true continuation as
    a chain of ``shape.depth``: all of it right, or only ``good(key, i)`` tokens at that
    row's i-th drafting, then wrong ones. ``full_for(slot) -> (full, key)``: the row's
    prompt + greedy tokens, and a name for its schedule. With ``decoys``, every chain node
    gets that many wrong siblings inserted before it, so the accepted path is not a prefix
    of the node order and the caches must be gathered, not just cropped. ``calls[key]``:
    the tokens accepted at each drafting (where the draft's guesses start)."""
    calls: dict = {}

    def draft_trees(draft, state, rows, trees, shape):
        for slot, tree in zip(range(rows.start, rows.stop), trees):
            if tree is None:
                continue
            full, key = full_for(slot)
            n = state.anchor_pos[slot] + 2  # tokens accepted so far: the draft guesses x_n onwards
            seen = calls.setdefault(key, [])
            right = shape.depth if good is None else min(good(key, len(seen)), shape.depth)
            seen.append(n)
            add_oracle_chain(tree, full, n, right, shape.depth, decoys)
        return [[] for _ in trees]

    draft_trees.calls = calls
    return draft_trees


# The prompts the runtime tests decode; the fitted drafts memorise the target's greedy
# continuations of exactly these.
FIT_PROMPTS = ([1, 17, 200, 5, 99, 42, 7, 130, 64], [1], [1, 250, 3, 3, 3, 3, 8, 160, 77, 21, 90, 45, 12, 199, 31, 2],
               [1, 17, 200, 5, 99])
FIT_TOKENS = 72  # continuation length learned: the longest decode in these tests, plus a draft chain
FIT_STEPS = 400  # ~6 s for both drafts; a chain of 1 then keeps ~28 of 60 draft tokens, a chain of 5 ~45


@pytest.fixture(scope="session")
def tiny_fitted(tiny_target, tmp_path_factory):
    """{pool: draft} for pool on and off: drafts distilled (a few seconds each, with the
    trainer's loss, :func:`tests.conftest.fit_draft`) on ``tiny_target``'s own greedy
    continuations of ``FIT_PROMPTS``, so that their candidates ARE accepted there. A
    random draft's tokens (p ~ 1/V) are almost never accepted: a lossless test through one
    checks plain decoding, not the verification and roll-back of draft nodes."""
    from ..conftest import fit_draft, once_per_run

    with torch.inference_mode():
        fulls = [list(p) + greedy_reference(tiny_target, list(p), FIT_TOKENS) for p in FIT_PROMPTS]
    seen = sorted({t for full in fulls for t in full})

    def build(pool: bool) -> DraftHead:
        torch.manual_seed(0)
        rest = [t for t in torch.randperm(V).tolist() if t not in set(seen)]
        hot = torch.tensor(seen + rest[:max(0, 128 - len(seen))])
        cfg = DraftConfig(target_hidden_size=H, vocab_size=V, draft_vocab_size=len(hot), hidden_size=H,
                          intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          pool_size=128 if pool else 0, pool_threshold=0.0, aux_layer_ids=LAYER_IDS)
        return DraftHead(cfg, hot, tiny_target.model.embed_tokens.weight)

    def fit() -> dict:
        return {pool: fit_draft(tiny_target, build(pool), fulls, steps=FIT_STEPS, lr=1e-2, threads=1).state_dict()
                for pool in (True, False)}

    states = once_per_run(tmp_path_factory, "tiny_fitted", fit)
    drafts = {}
    for pool, state in states.items():
        drafts[pool] = build(pool)
        drafts[pool].load_state_dict(state)
        drafts[pool].eval()
    return drafts


def drafted_tokens(out) -> int:
    """Candidates the target accepted (each verify's τ counts its own bonus token once)."""
    return sum(n - 1 for n in out.accept_lengths)
