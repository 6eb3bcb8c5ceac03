"""KD losses against the plain formula."""

from __future__ import annotations

import math

import pytest
import torch

from lyanna_train.losses.kd import hidden_regression, kl_to_teacher, teacher_targets, tv_to_teacher


def _plain_kl(p: list[float], q_logits: list[float]) -> float:
    z = sum(math.exp(x) for x in q_logits)
    q = [math.exp(x) / z for x in q_logits]
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def test_mask_mode_renormalises_over_hot_and_drops_out_of_vocab_top1():
    target = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 5.0, 0.0]])
    hot = torch.tensor([1, 0])  # draft id 0 -> target 1, draft id 1 -> target 0
    teacher, usable, top1_hot = teacher_targets(target, hot, "mask")
    assert usable.tolist() == [True, False] and top1_hot.tolist() == [True, False]
    p = [math.exp(1.0) / (math.exp(1.0) + math.exp(2.0)), math.exp(2.0) / (math.exp(1.0) + math.exp(2.0))]
    torch.testing.assert_close(teacher[0].exp(), torch.tensor(p))
    draft = torch.tensor([[0.3, -0.2], [0.0, 0.0]])
    assert math.isclose(kl_to_teacher(draft, teacher)[0].item(), _plain_kl(p, [0.3, -0.2]), rel_tol=1e-5)


def test_other_mode_keeps_outside_mass_in_a_bucket():
    target = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    hot = torch.tensor([1, 0])
    teacher, usable, _ = teacher_targets(target, hot, "other")
    z = sum(math.exp(x) for x in [2.0, 1.0, 0.0, -1.0])
    p = [math.exp(1.0) / z, math.exp(2.0) / z, (math.exp(0.0) + math.exp(-1.0)) / z]
    torch.testing.assert_close(teacher[0].exp(), torch.tensor(p), atol=1e-6, rtol=1e-5)
    assert usable.all()
    draft = torch.tensor([[0.1, 0.2, -3.0]])
    assert math.isclose(kl_to_teacher(draft, teacher)[0].item(), _plain_kl(p, [0.1, 0.2, -3.0]), rel_tol=1e-5)


def test_kl_is_zero_when_draft_equals_teacher_and_positive_otherwise():
    torch.manual_seed(0)
    logits = torch.randn(6, 9)
    teacher = torch.log_softmax(logits, -1)
    assert kl_to_teacher(logits + 3.0, teacher).abs().max() < 1e-5  # shift-invariant
    assert (kl_to_teacher(torch.randn(6, 9), teacher) > 0).all()
    with pytest.raises(ValueError, match="unknown"):
        teacher_targets(logits, torch.arange(3), "bogus")


def test_hidden_regression_is_scale_free():
    x = torch.randn(4, 16)
    assert hidden_regression(x, 4400 * x).abs().max() < 1e-6
    assert (hidden_regression(x, torch.randn(4, 16)) > 0).all()


@pytest.mark.parametrize("mode", ["mask", "other"])
def test_teacher_from_the_cached_summary_equals_the_plain_definition(mode):
    """Training reads the full-vocabulary top-1 and logsumexp from the feature cache and
    forms only the hot logits: the teacher must be the one full logits give."""
    from lyanna_train.data.features import teacher_summary
    from lyanna_train.training.step import teacher_logprobs

    torch.manual_seed(0)
    last, weight = torch.randn(2, 7, 16), torch.randn(50, 16)
    hot = torch.randperm(50)[:12]
    full, usable_full, _ = teacher_targets((last @ weight.T).reshape(-1, 50), hot, mode)
    top1, lse = teacher_summary(last.reshape(-1, 16), weight, chunk=5)
    for summary in ((top1.view(2, 7), lse.view(2, 7)), (None, None)):
        got, usable = teacher_logprobs(last, weight, hot, mode, *summary)
        torch.testing.assert_close(got.reshape(14, -1), full, atol=1e-5, rtol=1e-5)
        assert torch.equal(usable.reshape(-1), usable_full)
    assert not usable_full.all() or mode == "other"  # some top-1 fall outside the hot ids


def test_total_variation_is_one_minus_the_acceptance_probability():
    teacher = torch.log(torch.tensor([[0.5, 0.3, 0.2], [1.0, 1e-30, 1e-30]]))
    draft_logits = torch.log(torch.tensor([[0.2, 0.3, 0.5], [1e-30, 1.0, 1e-30]]))
    tv = tv_to_teacher(draft_logits, teacher)
    # 1 - sum(min(p, q)): what rejection sampling accepts
    torch.testing.assert_close(tv, torch.tensor([1 - (0.2 + 0.3 + 0.2), 1.0]), rtol=1e-5, atol=1e-6)
    assert float(tv_to_teacher(teacher, teacher).abs().max()) < 1e-6
    logits = torch.randn(4, 7, requires_grad=True)
    tv_to_teacher(logits, torch.log_softmax(torch.randn(4, 7), -1)).sum().backward()
    assert logits.grad.abs().sum() > 0


def test_the_summary_of_a_bf16_lm_head_is_close_to_fp32():
    """A bf16 target's summary uses a bf16 product: logsumexp within rounding, and the
    top-1 the same wherever the best logit leads the second by more than the rounding."""
    from lyanna_train.data.features import teacher_summary

    torch.manual_seed(0)
    last, weight = torch.randn(300, 64), torch.randn(5000, 64) * 0.5
    top1, lse = teacher_summary(last, weight)
    top1_bf, lse_bf = teacher_summary(last.bfloat16(), weight.bfloat16())
    assert lse_bf.dtype == torch.float32
    torch.testing.assert_close(lse_bf, lse, atol=0.15, rtol=0.02)
    logits = last @ weight.T
    gap = logits.topk(2).values.diff(dim=-1).abs().squeeze(-1)
    clear = gap > 0.5
    assert bool(clear.any()) and torch.equal(top1_bf[clear], top1[clear])


def test_feature_noise_is_scaled_to_each_dimensions_rms_without_the_first_position():
    from lyanna_train.training.step import noisy_features

    torch.manual_seed(0)
    rms = torch.tensor([1.0, 100.0, 0.01])
    aux = torch.randn(4, 2000, 3) * rms
    aux[:, 0] = 1e4  # attention sinks: outsized, and left out of the RMS
    valid = torch.ones(4, 2000, dtype=torch.bool)
    valid[1, 1500:] = False
    noise = noisy_features(aux, valid, 0.1) - aux
    body = aux[:, 1:][valid[:, 1:]]
    torch.testing.assert_close(noise.std(dim=(0, 1)), 0.1 * body.pow(2).mean(0).sqrt(), rtol=0.02, atol=0)
    assert torch.equal(noisy_features(aux, valid, 0.0), aux)
