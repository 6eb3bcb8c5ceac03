"""Runtime kernels: each Triton kernel against its torch reference, and the references
against the model code they stand for.

On CPU the kernels run under the Triton interpreter, which triton 3.9 only provides when
``TRITON_INTERPRET=1`` is set before its first import in the process: it jits its own
library (``tl.zeros``, ``tl.max``...) at import, and our conftest imports transformers,
which imports triton. So the ``test_triton_*`` cases run in place when the whole session
was started with ``TRITON_INTERPRET=1``, and otherwise :func:`test_interpreter_child`
runs them in one child pytest that has it. Shapes are small: the interpreter is slow.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lyanna_train.runtime.kernels import (hot_head_topk, hot_head_topk_reference, interpreter_ready, pool_fusion,
                                          pool_fusion_reference, rms_norm, triton_available, use_triton)

INTERPRETER = interpreter_ready()
interpreted = pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1 from the start: "
                                                       "test_interpreter_child runs these in a child")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Per dtype: (rtol, atol) on logits (rounded to the weights' dtype by both sides), and on
# the pool's fused states and α (the reference runs the gate in the model's dtype).
LOGIT_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1.6e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
FUSED_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
ALPHA_TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3, torch.float16: 1e-3}


def head_inputs(lead, h, v, dtype, device="cpu", seed=0, strided=False):
    """hidden [*lead, H] (rows ``strided``: a view into wider rows), norm [H], lm_head [V, H]."""
    g = torch.Generator().manual_seed(seed)
    hidden = 3 * torch.randn(*lead, 2 * h if strided else h, generator=g)
    norm = 1 + 0.1 * torch.randn(h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5
    hidden, norm, weight = (t.to(device=device, dtype=dtype) for t in (hidden, norm, weight))
    return hidden[..., :h], norm, weight


def check_head(got, ref, logits, dtype):
    """Values and logsumexp close; indices may differ only between (near-)tied logits."""
    rtol, atol = LOGIT_TOL[dtype]
    values, indices, lse = got
    torch.testing.assert_close(values, ref[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(lse, ref[2], rtol=rtol, atol=atol)
    assert indices.dtype == torch.int64 and (values[..., :-1] >= values[..., 1:]).all()
    assert (indices.sort(-1).values.diff(dim=-1) > 0).all(), "duplicate indices"
    torch.testing.assert_close(logits.gather(-1, indices), ref[0], rtol=rtol, atol=atol)


HEAD_CASES = [  # (leading dims, H, V, k, strided rows): V never a multiple of the 64-wide block
    ((1,), 72, 300, 1, False),
    ((5,), 96, 130, 16, False),  # the last block has 2 tokens: fewer than k
    ((19,), 72, 257, 5, True),
    ((70,), 40, 70, 8, False),  # two row blocks
    ((2, 3), 96, 2458, 16, False),  # a real hot-vocabulary size
]


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead,h,v,k,strided", HEAD_CASES)
@pytest.mark.slow
def test_triton_hot_head_matches_reference(lead, h, v, k, strided, dtype):
    hidden, norm, weight = head_inputs(lead, h, v, dtype, strided=strided)
    got = hot_head_topk(hidden, norm, 1e-5, weight, k, backend="triton")
    ref = hot_head_topk_reference(hidden, norm, 1e-5, weight, k)
    logits = torch.nn.functional.linear(rms_norm(hidden, norm, 1e-5), weight).float()
    assert got[0].shape == got[1].shape == (*lead, k) and got[2].shape == lead
    check_head(got, ref, logits, dtype)
    if dtype == torch.float32:  # no ties in fp32 random logits: the very same tokens
        assert torch.equal(got[1], ref[1])


def test_hot_head_reference_is_draft_score():
    """The reference is LlamaRMSNorm + lm_head, i.e. ``DraftHead.score``, then topk/logsumexp."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hidden, _, weight = head_inputs((4,), 48, 90, torch.bfloat16, seed=1)
    norm = LlamaRMSNorm(48, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
        logits = torch.nn.functional.linear(norm(hidden), weight).float()
    values, indices, lse = hot_head_topk_reference(hidden, norm.weight, 1e-5, weight, 6)
    assert torch.equal(values, logits.topk(6).values) and torch.equal(lse, logits.logsumexp(-1))
    assert torch.equal(logits.gather(-1, indices), values)


def gate_weights(h, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    proj_w = torch.randn(width, 2 * h + 1, generator=g) / (2 * h) ** 0.5
    proj_b = 0.1 * torch.randn(width, generator=g)
    out_w = torch.randn(1, width, generator=g) / width**0.5
    out_b = 0.1 * torch.randn(1, generator=g)
    return [t.to(dtype) for t in (proj_w, proj_b, out_w, out_b)]


def pool_inputs(b, s, h, dtype, case, seed=0):
    """current [B, H], pool [B, S, H], allowed [B, S]: some slots near-copies of the query."""
    g = torch.Generator().manual_seed(seed)
    current = torch.randn(b, h, generator=g)
    pool = torch.randn(b, s, h, generator=g)
    near = torch.randint(0, s, (b,), generator=g)
    pool[torch.arange(b), near] = 1.7 * current + 0.2 * torch.randn(b, h, generator=g)
    allowed = torch.rand(b, s, generator=g) < 0.8
    allowed[torch.arange(b), near] = True
    if case == "none_allowed":
        allowed[0] = False
    if case == "tie":  # the same state in two slots: either may win (rounding), same result
        pool[:, -1] = pool[torch.arange(b), near]
        allowed[:, -1] = True
    return current.to(dtype), pool.to(dtype), allowed


POOL_CASES = [  # (B, S, H, W, threshold, case)
    (2, 1, 72, 24, 0.85, "hit"),
    (3, 130, 96, 64, 0.85, "hit"),
    (2, 37, 72, 24, -1.0, "none_allowed"),
    (2, 40, 72, 24, 0.999, "all_below"),
    (3, 70, 40, 32, 0.85, "tie"),
]


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,s,h,width,threshold,case", POOL_CASES, ids=[c[-1] + f"-S{c[1]}" for c in POOL_CASES])
@pytest.mark.slow
def test_triton_pool_fusion_matches_reference(b, s, h, width, threshold, case, dtype):
    current, pool, allowed = pool_inputs(b, s, h, dtype, case)
    gate = gate_weights(h, width, dtype)
    fused, alpha, sim, index = pool_fusion(current, pool, allowed, threshold, *gate, 0.3, backend="triton")
    ref = pool_fusion_reference(current, pool, allowed, threshold, *gate, 0.3)
    rtol, atol = FUSED_TOL[dtype]
    assert fused.dtype == dtype and alpha.dtype == sim.dtype == torch.float32 and index.dtype == torch.int64
    torch.testing.assert_close(fused, ref[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(alpha, ref[1], rtol=0, atol=ALPHA_TOL[dtype])
    torch.testing.assert_close(sim, ref[2], rtol=1e-5, atol=1e-5)
    if case == "tie":
        rows = torch.arange(b)
        assert torch.equal(pool[rows, index], pool[rows, ref[3]])
    else:
        assert torch.equal(index, ref[3])
    if case in ("hit", "tie"):
        assert (alpha > 0).all()
    if case == "none_allowed":
        assert sim[0] == float("-inf") and index[0] == -1 and alpha[0] == 0 and torch.equal(fused[0], current[0])
    if case == "all_below":
        assert (alpha == 0).all() and torch.equal(fused, current)


def tree_level_inputs(b, q, s, h, dtype):
    """Q queries per sequence (a tree level's nodes), some near one of their pool's slots."""
    current, pool, allowed = pool_inputs(b, s, h, torch.float32, "hit", seed=5)
    g = torch.Generator().manual_seed(6)
    queries = current[:, None] + torch.randn(b, q, h, generator=g) * torch.tensor([0.05] + [3.0] * (q - 1))[:, None]
    return queries.to(dtype), pool.to(dtype), allowed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pool_fusion_reference_with_queries_per_sequence_is_one_query_at_a_time(dtype):
    """[B, Q, H] against each sequence's pool read once = every query alone against its
    sequence's pool (the old call, which copied the pool once per query)."""
    b, q, s, h = 3, 4, 60, 48
    current, pool, allowed = tree_level_inputs(b, q, s, h, dtype)
    gate = gate_weights(h, 16, dtype)
    got = pool_fusion_reference(current, pool, allowed, 0.85, *gate, 0.3)
    alone = pool_fusion_reference(current.reshape(b * q, h), pool.repeat_interleave(q, 0),
                                  allowed.repeat_interleave(q, 0), 0.85, *gate, 0.3)
    assert got[0].shape == (b, q, h) and all(t.shape == (b, q) for t in got[1:])
    for g, a in zip(got, alone):
        torch.testing.assert_close(g, a.reshape(g.shape), rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 2e-2)
    assert (got[1][:, 0] > 0).all() and (got[1][:, 1:] == 0).any()  # the near query hits; far ones miss


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.slow
def test_triton_pool_fusion_with_queries_per_sequence_matches_reference(dtype):
    b, q, s, h = 3, 5, 70, 72
    current, pool, allowed = tree_level_inputs(b, q, s, h, dtype)
    allowed[1] = False  # a sequence whose window holds nothing yet
    gate = gate_weights(h, 24, dtype)
    fused, alpha, sim, index = pool_fusion(current, pool, allowed, 0.85, *gate, 0.3, backend="triton")
    ref = pool_fusion_reference(current, pool, allowed, 0.85, *gate, 0.3)
    rtol, atol = FUSED_TOL[dtype]
    torch.testing.assert_close(fused, ref[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(alpha, ref[1], rtol=0, atol=ALPHA_TOL[dtype])
    torch.testing.assert_close(sim, ref[2], rtol=1e-5, atol=1e-5)
    assert torch.equal(index, ref[3]) and (index[1] == -1).all() and (alpha[0, 0] > 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pool_fusion_reference_is_model_code(dtype):
    """The reference equals ``best_match`` + ``DraftHead.pool_fuse`` (AlphaGate + fuse) exactly."""
    from lyanna_train.models.alpha_gate import AlphaGate
    from lyanna_train.models.draft_head import DraftHead
    from lyanna_train.models.state_pool import best_match

    torch.manual_seed(0)
    b, s, h = 4, 50, 32
    current, pool, allowed = pool_inputs(b, s, h, dtype, "none_allowed", seed=3)
    gate = AlphaGate(h, 16, alpha_max=0.3).to(dtype)
    head = SimpleNamespace(cfg=SimpleNamespace(pool_threshold=0.85), gate=gate)
    with torch.no_grad():
        sim, retrieved = best_match(current[:, None], pool, allowed[:, None])
        fused, alpha, hit = DraftHead.pool_fuse(head, current[:, None], sim, retrieved)
    weights = (gate.proj.weight, gate.proj.bias, gate.out.weight, gate.out.bias)
    got = pool_fusion_reference(current, pool, allowed, 0.85, *(w.detach() for w in weights), 0.3)
    assert hit.any() and not hit.all()
    torch.testing.assert_close(got[0], fused[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], alpha[:, 0].float(), rtol=0, atol=0)
    torch.testing.assert_close(got[2], sim[:, 0], rtol=0, atol=0)
    picked = pool[torch.arange(b), got[3].clamp(min=0)]
    assert torch.equal(picked[got[3] >= 0], retrieved[got[3] >= 0, 0])


def test_dispatch():
    x = torch.zeros(2, 4)
    assert not use_triton("auto", x) and not use_triton("torch", x)
    with pytest.raises(ValueError):
        use_triton("cuda", x)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError):
        use_triton("triton", torch.zeros(2))


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETER or not triton_available(), reason="the interpreted cases already ran in this session")
def test_interpreter_child():
    """A session started without ``TRITON_INTERPRET=1`` (a GPU machine: conftest leaves it
    unset there) runs the interpreted ``test_triton_*`` cases here, in one child pytest."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
                           "-k", "test_triton_ and not on_cpu"], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]


@pytest.mark.slow
def test_runs_without_triton():
    """Importing the package and the auto backend on CPU never touch triton."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, lyanna_train, lyanna_train.runtime.kernels as k\n"
            "assert not k.triton_available()\n"
            "v, i, l = k.hot_head_topk(torch.randn(2, 8), torch.ones(8), 1e-6, torch.randn(10, 8), 3)\n"
            "assert v.shape == (2, 3)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available() or INTERPRETER,
                    reason="needs CUDA and triton, not the interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_kernels_on_gpu(monkeypatch, dtype):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for n in (1, 7, 64):
        hidden, norm, weight = head_inputs((n,), 4096, 1600, dtype, device="cuda")
        got = hot_head_topk(hidden, norm, 1e-5, weight, 10)  # auto: triton on CUDA
        ref = hot_head_topk_reference(hidden, norm, 1e-5, weight, 10)
        logits = torch.nn.functional.linear(rms_norm(hidden, norm, 1e-5), weight).float()
        check_head(got, ref, logits, dtype)
    for b, s in ((1, 512), (8, 130)):
        current, pool, allowed = (t.cuda() for t in pool_inputs(b, s, 4096, dtype, "hit"))
        gate = [t.cuda() for t in gate_weights(4096, 64, dtype)]
        fused, alpha, sim, index = pool_fusion(current, pool, allowed, 0.85, *gate, 0.3)
        ref = pool_fusion_reference(current, pool, allowed, 0.85, *gate, 0.3)
        rtol, atol = FUSED_TOL[dtype]
        torch.testing.assert_close(fused, ref[0], rtol=rtol, atol=atol)
        torch.testing.assert_close(alpha, ref[1], rtol=0, atol=ALPHA_TOL[dtype])
        torch.testing.assert_close(sim, ref[2], rtol=1e-4, atol=1e-4)
        assert torch.equal(index, ref[3])
