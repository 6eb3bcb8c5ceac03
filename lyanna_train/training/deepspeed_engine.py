"""The one module that talks to DeepSpeed.

Its config dict is built from a few typed fields (stage, precision, clipping,
accumulation) rather than kept as hand-written JSON; the optimizer and the schedule are
plain torch objects handed to ``deepspeed.initialize``, so the same code runs as one
process or under the launcher, on CPU (gloo, fp32) or GPU (nccl, bf16).
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import pickle
import re

import torch

from ..errors import LyannaError


def _on_gpu() -> bool:
    return torch.cuda.is_available()


def rank_device() -> torch.device:
    """This rank's device: GPU ``LOCAL_RANK`` where there is CUDA (the one DeepSpeed puts the
    draft on, so the target and its features go there too), else the CPU."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if _on_gpu() else torch.device("cpu")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(backend: str = "auto") -> tuple[int, int]:
    """Initialise torch.distributed through DeepSpeed (also for one process): (rank, world size)."""
    import deepspeed

    if backend == "auto":
        backend = "nccl" if _on_gpu() else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a lone process: any free port (a launcher sets its own)
        os.environ["MASTER_PORT"] = str(_free_port())
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if _on_gpu():  # DeepSpeed sets it only in its engine; NCCL collectives before that use it (else GPU 0 on all ranks)
        torch.cuda.set_device(rank_device())
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total`` steps."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def deepspeed_config(ds, train) -> dict:
    precision = ds.precision if ds.precision != "auto" else ("bf16" if _on_gpu() else "fp32")
    config = {
        "train_micro_batch_size_per_gpu": 1,  # our micro-batches are token-budgeted; DeepSpeed only counts them
        "gradient_accumulation_steps": train.grad_accum,
        "zero_optimization": {"stage": ds.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if train.grad_clip > 0:
        config["gradient_clipping"] = train.grad_clip
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


class Engine:
    """A DeepSpeed engine for the draft with its optimizer and schedule."""

    def __init__(self, model: torch.nn.Module, ds, train, total_steps: int):
        import deepspeed

        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=train.lr, betas=tuple(ds.betas), eps=ds.eps,
                                      weight_decay=train.weight_decay)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(train.warmup_steps, total_steps, train.min_lr_ratio))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=schedule, config=deepspeed_config(ds, train))
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def backward_and_step(self, loss: torch.Tensor) -> bool:
        """Backward one micro-batch; steps the optimizer at accumulation boundaries (returns True then)."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.backward(loss)
        self.engine.step()
        return boundary

    def save(self, root, tag: str, client_state: dict) -> None:
        self.engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)

    def load(self, root, tag: str) -> dict:
        """Restore model, optimizer, schedule and the client state, unpickling tensors and plain data only.

        A run folder may come from someone else: a ``.pt`` file there must never run code.
        DeepSpeed reads its files through its checkpoint engine with ``weights_only=False``;
        here that engine is swapped for one that loads ``weights_only=True``, and
        ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` covers any other ``torch.load`` on the way. Only
        DeepSpeed's own plain records are allowed beside tensors (:func:`_deepspeed_records`).
        """
        where = os.path.join(str(root), tag)
        if not glob.glob(os.path.join(glob.escape(where), "*model_states.pt")):  # DeepSpeed asserts, unworded
            raise LyannaError(f"cannot resume from {where}: DeepSpeed's model states (mp_rank_00_model_states.pt) "
                              "are missing from it (an incomplete copy?): restore that file, or move the checkpoint "
                              "away to resume from the one before")
        if not isinstance(self.engine.checkpoint_engine, _WeightsOnlyLoads):
            self.engine.checkpoint_engine = _WeightsOnlyLoads(self.engine.checkpoint_engine)
        try:
            with _force_weights_only(), torch.serialization.safe_globals(_deepspeed_records()):
                _, client_state = self.engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                                              load_lr_scheduler_states=True)
        except pickle.UnpicklingError as err:
            found = re.search(r"GLOBAL (\S+) was not an allowed global", str(err))
            refused = f"the global {found.group(1)}" if found else "an unsafe pickle"
            raise LyannaError(f"refusing to load {where}: it holds pickled objects other than tensors and plain "
                              f"data, which could run code ({refused}); it was not loaded") from None
        except (RuntimeError, ValueError, EOFError, OSError, KeyError, AssertionError) as err:
            detail = " ".join(str(err).split())[:300]
            if any(m in detail for m in ("size mismatch", "Unexpected key", "Missing key", "state_dict")):
                raise LyannaError(f"cannot resume from {where}: its weights do not fit the configured draft "
                                  f"({detail}); resuming needs the draft settings it was trained with") from None
            raise LyannaError(f"cannot resume from {where}: a checkpoint file is unreadable "
                              f"(truncated or corrupted?): {detail}") from None
        if client_state is None:
            raise LyannaError(f"cannot resume from {where}: DeepSpeed found no checkpoint there")
        return client_state

    def apply_hyperparameters(self, ds, train, total_steps: int) -> None:
        """After a forced resume: the new config's optimizer settings and schedule, from the resumed step on.

        A checkpoint restores the old learning rate, betas and schedule; ``train.resume=force``
        means "continue these weights with the new settings", so they are set again here.
        """
        schedule = self.scheduler
        schedule.base_lrs = [train.lr for _ in schedule.base_lrs]
        schedule.lr_lambdas = [lr_lambda(train.warmup_steps, total_steps, train.min_lr_ratio)
                               for _ in schedule.lr_lambdas]
        for group, f in zip(self.optimizer.param_groups, schedule.lr_lambdas):
            group.update(betas=tuple(ds.betas), eps=ds.eps, weight_decay=train.weight_decay, initial_lr=train.lr,
                         lr=train.lr * f(schedule.last_epoch))
        schedule._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def barrier(self) -> None:
        torch.distributed.barrier()

    def mean(self, values: dict) -> dict:
        """Average 0-d metric tensors over ranks (one collective for all)."""
        if not values:
            return {}
        keys = sorted(values)
        stacked = torch.stack([values[k].float().detach() for k in keys])
        if self.world_size > 1:
            torch.distributed.all_reduce(stacked)
            stacked /= self.world_size
        return dict(zip(keys, stacked.tolist()))


def _deepspeed_records() -> list:
    """The few DeepSpeed classes its ZeRO optimizer files hold: plain records, safe to rebuild.

    (``fragment_address`` is a two-int dataclass, ``ZeroStageEnum`` an IntEnum, the loss
    scalers hold a scale and counters.) Allowing them by name lets ``weights_only`` read
    ZeRO 1/2 and bf16-ZeRO checkpoints; any other global is still refused.
    """
    import importlib

    found = []
    for module, name in (("deepspeed.utils.tensor_fragment", "fragment_address"),
                         ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
                         ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                         ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # another DeepSpeed version: that record is then refused
            pass
    return found


@contextlib.contextmanager
def _force_weights_only():
    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = before


class _WeightsOnlyLoads:
    """DeepSpeed's checkpoint engine with ``load`` unpickling tensors and plain data only (saving unchanged)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, path: str, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=True)
