"""Teacher-forced agreement against a brute-force count."""

from __future__ import annotations

import pytest
import torch

from lyanna_train.evaluation.agreement import top1_agreement
from lyanna_train.models.config import DraftConfig
from lyanna_train.models.draft_head import DraftHead
from lyanna_train.training.config import LossConf
from lyanna_train.training.step import distill_loss

H, V, VD = 16, 50, 20


def _head():
    torch.manual_seed(0)
    cfg = DraftConfig(target_hidden_size=H, vocab_size=V, draft_vocab_size=VD, hidden_size=H, intermediate_size=32,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, pool_size=0, alpha_max=0.0)
    return DraftHead(cfg, torch.randperm(V)[:VD], torch.randn(V, H))


def _batch(b=2, t=11):
    g = torch.Generator().manual_seed(3)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, 8:] = False
    loss_mask = torch.rand(b, t, generator=g) > 0.3
    return {"aux": torch.randn(b, t, 3 * H, generator=g), "input_ids": torch.randint(0, V, (b, t), generator=g),
            "valid": valid, "loss_mask": loss_mask & valid, "teacher_top1": torch.randint(0, V, (b, t), generator=g)}


def test_counts_match_a_brute_force_loop():
    head, batch, steps = _head(), _batch(), 3
    # make some positions agree: the teacher's top-1 is the draft's own step-0 choice there
    with torch.no_grad():
        outs = head.forward_unrolled(batch["aux"], batch["input_ids"], steps, batch["valid"])
    own = head.draft_to_target(outs[0].logits.argmax(-1))
    batch["teacher_top1"][:, 1:6] = own[:, 0:5]
    got = top1_agreement(head, [batch], steps)
    for j in range(steps):
        drafted = head.draft_to_target(outs[j].logits.argmax(-1))
        agree = count = 0
        for r in range(2):
            for t in range(11 - 2 - j):
                if batch["loss_mask"][r, t + 2 + j] and batch["valid"][r, t + 2 + j]:
                    count += 1
                    agree += int(drafted[r, t] == batch["teacher_top1"][r, t + 1 + j])
        assert got[f"top1_step{j}"] == agree / count
        if j == 0:
            assert got["positions"] == count and agree >= 5
    assert head.training  # restored


def test_teacher_top1_from_last_states_when_the_cache_has_no_summary():
    head, batch = _head(), _batch()
    lm = torch.randn(V, H)
    batch["last"] = torch.randn(2, 11, H)
    batch["teacher_top1"] = (batch["last"] @ lm.T).argmax(-1)
    with_summary = top1_agreement(head, [batch], 2)
    del batch["teacher_top1"]
    assert top1_agreement(head, [batch], 2, lm_weight=lm) == with_summary


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_draft_on_the_gpu_takes_batches_from_the_host():
    """Cache shards and the online extractor hand batches over on the host: the agreement and
    the training loss move them to the draft's device (the first GPU run stopped here)."""
    head, batch = _head(), _batch()
    on_cpu = top1_agreement(head, [batch], 2)
    on_gpu = top1_agreement(head.cuda(), [batch], 2)
    assert on_gpu["positions"] == on_cpu["positions"] > 0
    batch["last"] = torch.randn(2, 11, H)
    loss, _ = distill_loss(head, batch, torch.randn(V, H, device="cuda"), LossConf(ttt_steps=2))
    assert loss.device.type == "cuda" and torch.isfinite(loss)
