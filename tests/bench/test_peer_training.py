"""bench/peer_training.py end to end on a tiny random target: speculators' trainer replays the
run's batches, its head comes back through the importer and both heads are measured alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..training.conftest import compose, tiny_corpus, tiny_overrides, tiny_target_dir  # noqa: F401 (fixtures)

BENCH = Path(__file__).resolve().parents[2] / "bench" / "peer_training.py"
CONSUMERS = Path(os.environ.get("LYANNA_CONSUMERS", Path(sys.prefix) / "consumers"))


@pytest.mark.slow
@pytest.mark.skipif(not (CONSUMERS / "speculators").is_dir(), reason=f"speculators is not installed in {CONSUMERS}")
def test_the_peer_replays_the_runs_batches_and_is_served_here(tmp_path, tiny_target_dir, tiny_corpus):
    from lyanna_train.training.loop import train

    run = tmp_path / "run"
    train(compose(tiny_overrides(tiny_target_dir, tiny_corpus, run, "target.aux_layers=[0,1,2]", "train.max_steps=3",
                                 "data.max_samples=18", "eval.heldout_samples=4", "eval.num_prompts=0")))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK",
                                                            "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, str(BENCH), "--run", str(run), "--out", str(tmp_path / "peer"),
                           "--prompts", "1", "--max-new-tokens", "4"], capture_output=True, text=True, env=env,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "peer" / "results.json").read_text())
    assert results["steps"] == 3 and results["tokens"] > 0
    training = json.loads((tmp_path / "peer" / "peer" / "head" / "peer_training.json").read_text())
    assert training["steps"] == 3 and training["defaults"]["optimizer"] == "muon"  # the library's own defaults
    plan = json.loads((tmp_path / "peer" / "peer" / "plan.json").read_text())
    assert len(plan) == 3 and all(rows for _, rows in plan)
    ours, peer = results["rows"]
    for row in (ours, peer):
        assert row["tau"] >= 1.0 and 0.0 <= row["heldout_top1_step0"] <= 1.0 and len(row["accept"]) == 3
    imported = json.loads((tmp_path / "peer" / "peer" / "export" / "manifest.json").read_text())
    assert imported["imported"]["layout"] == "speculators"
    assert "| speculators EAGLE-3 defaults |" in proc.stdout


def test_the_peers_fp32_muon_is_torchs_iteration_without_the_bf16_cast():
    """On a CPU without native bf16 the peer orthogonalises in fp32: the same Newton–Schulz
    iteration as torch's Muon (which casts to bf16), so they agree to bf16's rounding."""
    import importlib.util

    import torch
    import torch.optim._muon as muon

    spec = importlib.util.spec_from_file_location("peer_speculators", BENCH.with_name("peer_speculators.py"))
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    torchs = muon._zeropower_via_newtonschulz
    coefficients = (muon.DEFAULT_A, muon.DEFAULT_B, muon.DEFAULT_C)
    try:
        peer.muon_in_fp32()
        ours = muon._zeropower_via_newtonschulz
        assert ours is not torchs
        for shape in ((300, 64), (64, 300)):  # tall and wide: the transposed branch too
            grad = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
            got, want = ours(grad, coefficients, 5, 1e-7), torchs(grad, coefficients, 5, 1e-7).float()
            assert got.dtype == torch.float32 and got.shape == grad.shape
            assert torch.allclose(got, want, atol=0.05 * want.abs().max().item())
            assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), 0) > 0.999
            assert not torch.allclose(got, grad / grad.norm(), atol=1e-3)  # it did iterate
    finally:
        muon._zeropower_via_newtonschulz = torchs
