"""The recipe's small parts: the metric window (summed on the device, read at the log
interval) and the progress record a checkpoint carries."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lyanna_train.training.loop import MetricWindow, Progress


class _Ranks:
    """``world_size`` ranks that all hold the same values: their mean over ranks is one rank's
    (the engine's ``mean`` without DeepSpeed)."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def mean(self, values: dict) -> dict:
        return {k: float(v) for k, v in values.items()}


def test_the_window_sums_on_the_device_and_reads_means_once():
    window = MetricWindow()
    for loss, acc, tokens in ((1.0, 0.5, 10), (3.0, 0.7, 30)):
        window.add(torch.tensor(loss, requires_grad=True) * 1, {"acc/step0": torch.tensor(acc),
                                                                 "tokens": torch.tensor(tokens)})
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in window.sums.values())  # no host sync yet
    means, seen = window.read(_Ranks(world_size=2))
    assert means == pytest.approx({"acc/step0": 0.6, "loss/total": 2.0})
    assert seen == 2 * 40  # tokens of every rank
    assert window.sums == {} and window.micro == 0


def test_progress_round_trips_through_a_checkpoints_plain_dict():
    progress = Progress(step=7, epoch=1, batch=3, tokens=1234, wandb_id="abc")
    saved = dataclasses.asdict(progress)
    assert saved == {"step": 7, "epoch": 1, "batch": 3, "tokens": 1234, "wandb_id": "abc"}
    assert Progress.saved(saved) == progress
    assert Progress.saved({**saved, "retired_field": 1}) == progress  # a key it no longer knows is ignored
