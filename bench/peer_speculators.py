"""Train speculators' EAGLE-3 draft with its own defaults on our cached features (the peer).

Run by ``bench/peer_training.py`` in the environment the Makefile gives the speculators
library (``PYTHONPATH=.venv/consumers``: speculators 0.9.0 and the transformers release it
supports), so nothing here imports lyanna_train. Everything that decides what is learned
comes from the library: ``TrainConfig``'s EAGLE-3 defaults (flattened as its CLI does),
``build_draft_model`` (the model its CLI builds: lm_head from the verifier's hot rows,
norm_before_residual / norm_before_fc / norm_output), ``shift_batch`` (its alignment of
features, tokens, targets and loss mask), the model's own forward and loss
(``get_trainer_kwargs``), ``build_optimizers`` (Muon + AdamW) and its linear warm-up
schedule. The loop mirrors ``Trainer.train_epoch`` (autocast, backward, clip 1.0, step
every optimizer and scheduler); its Trainer itself assumes a CUDA device. Shims, all for
the CPU and all the library's own options: dense-mask SDPA attention instead of flex
attention (``--draft-attn-impl sdpa``) and the eager loss instead of the Triton-fused one
(``--loss-implementation eager``); the features are read from our cache and packed like
its collate (document ids) into the same batches our trainer sees. With ``--dtype float32``
(the run's precision on a CPU that only emulates bf16) torch's Muon also orthogonalises
in fp32: it casts to bf16 itself, which there made a step take ~40 s, one core busy.

    python bench/peer_speculators.py --plan PLAN.json --cache DIR --verifier DIR --hot HOT.safetensors --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import time
from argparse import Namespace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load as load_bytes


def library_args(verifier: str, hot_path: str, layer_ids: list[int]) -> tuple[Namespace, torch.Tensor, torch.Tensor]:
    """Its CLI's flattened defaults for an EAGLE-3 run, with our vocabulary map and layers."""
    from speculators.train.config import TrainConfig

    cfg = TrainConfig(speculator_type="eagle3", verifier={"verifier_name_or_path": verifier})
    args = Namespace(**cfg.flatten())
    with safe_open(hot_path, "pt") as fh:
        hot = fh.get_tensor("hot_ids").sort().values  # speculators keeps draft ids in target order
    vocab = int(json.loads((Path(verifier) / "config.json").read_text())["vocab_size"])
    t2d = torch.zeros(vocab, dtype=torch.bool).scatter_(0, hot, True)
    d2t = hot - torch.arange(len(hot))
    args.draft_attn_impl = "sdpa"  # shim: flex attention needs a GPU compile
    args.loss_implementation = "eager"  # shim: the fused loss is a Triton kernel (same loss, the library says)
    args.target_layer_ids = [i + 1 for i in layer_ids]  # its convention: the input of layer i
    return args, t2d, d2t


def muon_in_fp32() -> None:
    """torch's Muon runs its Newton–Schulz iteration in bf16 (a fixed cast); where bf16 is
    emulated that dominates the step. The same iteration (same coefficients) in fp32."""
    import torch.optim._muon as muon

    def newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        x = grad.float()
        tall = x.size(0) > x.size(1)
        x = x.T if tall else x
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return (x.T if tall else x).to(grad.dtype)

    muon._zeropower_via_newtonschulz = newton_schulz_fp32


def build_model(args, t2d, d2t):
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import build_draft_model

    return build_draft_model(args, Eagle3DraftModel, t2d, d2t, len(d2t))


class Shards:
    """Our feature-cache shards, one in memory at a time."""

    def __init__(self, root: Path):
        self.root, self.index, self.tensors = root, None, None

    def __call__(self, shard: int) -> dict:
        if shard != self.index:
            path = self.root / "shards" / f"shard-{shard:05d}.safetensors"
            self.index, self.tensors = shard, load_bytes(path.read_bytes())
        return self.tensors


def packed_batch(shards: Shards, shard: int, rows: list[int], norm_weight: torch.Tensor) -> dict:
    """Samples ``rows`` of ``shard`` through the library's ``shift_batch``, packed with document ids.

    The cache stores ``last`` after the target's final norm; the library applies that norm
    itself (``verifier_norm``), so it gets ``last / weight``, whose norm is ``last`` again."""
    from speculators.models.eagle3.data import shift_batch

    t = shards(shard)
    parts = []
    for j in rows:
        a, b = int(t["offsets"][j]), int(t["offsets"][j + 1])
        sample = {"input_ids": t["input_ids"][a:b].long(), "hidden_states": t["aux"][a:b],
                  "verifier_last_hidden_states": t["last"][a:b].float() / norm_weight,
                  "loss_mask": t["loss_mask"][a:b], "lengths": torch.tensor([b - a]),
                  "position_ids": torch.arange(b - a)}
        parts.append(shift_batch(sample))
    batch = {key: torch.cat([p[key] for p in parts])[None] for key in
             ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask", "position_ids")}
    batch["document_ids"] = torch.cat([torch.full((len(p["input_ids"]),), i) for i, p in enumerate(parts)])[None]
    return batch


def schedulers(args, optimizers, total: int):
    from transformers import get_linear_schedule_with_warmup

    warmup = args.scheduler_warmup_steps if args.scheduler_warmup_steps is not None else total // 100
    if args.scheduler_type != "linear":
        raise SystemExit(f"the library's default schedule changed to {args.scheduler_type}: update this script")
    return [get_linear_schedule_with_warmup(opt, warmup, total) for opt in optimizers]


def main() -> None:
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="JSON: [[shard, [rows...]], ...], one optimizer step each")
    p.add_argument("--cache", required=True, type=Path)
    p.add_argument("--verifier", required=True, help="the target as a Hugging Face directory")
    p.add_argument("--hot", required=True, help="hot-vocabulary safetensors (hot_ids)")
    p.add_argument("--layers", default="1,14,26", help="our aux layer ids (output of layer i)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", help="autocast dtype instead of the library's default (bfloat16): float32 on a CPU "
                   "that only emulates bf16, where the library's default runs ~5x slower")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    args, t2d, d2t = library_args(a.verifier, a.hot, [int(i) for i in a.layers.split(",")])
    if a.dtype:
        args.hidden_states_dtype = a.dtype
        if a.dtype == "float32":
            muon_in_fp32()
    torch.manual_seed(args.seed)
    model = build_model(args, t2d, d2t).train()
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(**vars(args))
    config = TrainerConfig(lr=args.lr, num_epochs=1, save_path=str(a.out), optimizer=args.optimizer,
                           weight_decay=args.weight_decay, muon_lr=args.muon_lr, muon_momentum=args.muon_momentum,
                           muon_weight_decay=args.muon_weight_decay, muon_ns_steps=args.muon_ns_steps,
                           muon_adjust_lr_fn=args.muon_adjust_lr_fn)
    optimizers = build_optimizers(model, config)
    plan = json.loads(Path(a.plan).read_text())
    scheds = schedulers(args, optimizers, len(plan))
    dtype = getattr(torch, args.hidden_states_dtype)
    norm_weight = model.verifier_norm.weight.detach().float()
    shards, start, tokens, log = Shards(a.cache), time.perf_counter(), 0, []
    for step, (shard, rows) in enumerate(plan, 1):
        batch = packed_batch(shards, shard, rows, norm_weight)
        batch["hidden_states"] = batch["hidden_states"].to(dtype)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            _, loss, metrics = model(**batch, **train_kwargs)
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
        for sched in scheds:
            sched.step()
        tokens += batch["input_ids"].shape[1]
        if step % 20 == 0 or step == len(plan):
            acc = metrics.get("full_acc_0_sum", torch.tensor(0.0)) / metrics.get("full_acc_0_total", torch.tensor(1.0)).clamp(min=1)
            rate = tokens / (time.perf_counter() - start)
            log.append({"step": step, "loss": float(loss), "acc0": float(acc), "tokens_per_s": rate})
            print(f"peer step {step}/{len(plan)} loss {float(loss):.3f} acc0 {float(acc):.3f} {rate:.0f} tok/s", flush=True)
    model.eval().save_pretrained(str(a.out))
    summary = {"steps": len(plan), "tokens": tokens, "seconds": time.perf_counter() - start, "log": log,
               "defaults": {k: getattr(args, k) for k in ("lr", "optimizer", "weight_decay", "muon_lr", "scheduler_type",
                                                          "ttt_steps", "ttt_step_loss_decay", "loss_fn", "norm_before_residual",
                                                          "norm_before_fc", "norm_output", "num_layers", "hidden_states_dtype")}}
    (a.out / "peer_training.json").write_text(json.dumps(summary, indent=2, default=str))
    if not math.isfinite(float(loss)):
        raise SystemExit("the peer's loss is not finite")


if __name__ == "__main__":
    main()
