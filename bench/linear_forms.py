"""Benchmark: the target's forward per token count in each CPU GEMM form, past 32 rows too.

The runtime's linears take a tuned form per row count up to ``MAX_ROWS`` and one form for
every count past it (:mod:`lyanna_train.runtime.cpu.small_linear`); this times one target
forward after 256 cached tokens (what the tuning times) in every form at each count, so
the choice can be read off a table.

    python bench/linear_forms.py --sizes 16,32,48,64,96,128,256 --out bench/results/linear-forms-zen4

Writes OUT/linear_forms.json and OUT/summary.md. ``ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2`` in front caps both libraries at AVX2 (what an AVX2-only CPU runs);
the command recorded says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch

from lyanna_train.evaluation.report import markdown_table
from lyanna_train.runtime.cpu.small_linear import FORMS, LARGE, MAX_ROWS, MKL_PACKED, packed_weight, \
    SmallBatchLinear, use_small_batch_linears
from lyanna_train.runtime.cpu.tuning import target_timer
from lyanna_train.target.model import load_target_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--sizes", default="16,32,48,64,96,128,256")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    target = load_target_model(args.target).to(getattr(torch, args.dtype)).eval()
    forms = use_small_batch_linears(target)
    for module in target.modules():  # every weight packed now, not inside a timed forward
        if type(module) is SmallBatchLinear and "onednn_packed" in FORMS:
            packed_weight(module)
    timer = target_timer(target, context=256)
    ms: dict[str, dict[str, float]] = {form: {} for form in FORMS}
    for n in sizes:
        for form in FORMS:
            forms[min(n, LARGE)] = (form, n if n <= MAX_ROWS else 0)
            ms[form][str(n)] = 1000 * timer(n)
        print(f"{n} tokens: " + ", ".join(f"{f} {ms[f][str(n)]:.1f} ms" for f in FORMS), flush=True)
        for module in target.modules():  # MKL's packs are per count: a copy of the weights each
            module.__dict__.pop(MKL_PACKED, None)
    args.out.mkdir(parents=True, exist_ok=True)
    # an instruction set capped for the run (an older CPU's, emulated) is part of the command
    capped = "".join(f"{k}={os.environ[k]} " for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY") if k in os.environ)
    meta = {"command": capped + "python bench/linear_forms.py --sizes " + args.sizes + " --dtype " + args.dtype,
            "target": args.target, "dtype": args.dtype, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine()}
    (args.out / "linear_forms.json").write_text(json.dumps({**meta, "sizes": sizes, "ms": ms}, indent=2))
    rows = [[form] + [f"{ms[form][str(n)]:.1f}" for n in sizes] for form in FORMS]
    table = markdown_table(["form"] + [f"{n} tokens" for n in sizes], rows, left=("form",))
    (args.out / "summary.md").write_text(f"`{meta['command']}`: ms per target forward after 256 cached tokens, "
                                         f"torch {meta['torch']}, threads {meta['threads']}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
