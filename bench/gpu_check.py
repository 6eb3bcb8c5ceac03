"""One command for a lent GPU: every GPU-only check in under 8 minutes, one table at the end.

    make gpu-check                       # or: python bench/gpu_check.py [--out DIR] [--budget 480]
    python bench/gpu_check.py --steps kernels           # a subset: kernels, train (train, export, bench)

Steps, each a subprocess with its own time limit (the whole run stops at ``--budget``):

1. ``kernels``: every GPU-marked test (``pytest -m gpu tests``): the Triton kernels compiled on
   the GPU against their torch references, training batches moved from the host;
2. ``kernel speed``: ``bench/gpu_kernels.py`` (fused kernels vs references, µs);
3. ``train``: a short bf16 distillation of the SmolLM2 recipe on the GPU (200 samples,
   60 steps, ZeRO-0, bf16) and its τ;
4. ``export``: that checkpoint to a serving directory;
5. ``bench``: ``lyanna-bench`` on 8 MT-Bench first turns, 128 tokens, against target-only
   and transformers' prompt lookup, with the lossless check.

Needs torch with CUDA (and triton) in the running interpreter: ``make install`` puts a CPU
torch in .venv, so on a GPU machine run it with an interpreter that has the CUDA build.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], limit: float, log: Path) -> tuple[bool, float, str]:
    """-> (ok, seconds, output tail); the output goes to ``log`` too."""
    start = time.perf_counter()
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    env.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(limit, 1))
        ok, text = done.returncode == 0, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        ok, text = False, f"{(err.stdout or b'').decode(errors='replace')}\ntimed out after {limit:.0f} s"
    log.write_text(text)
    return ok, time.perf_counter() - start, text


def _last(pattern: str, text: str, default: str = "") -> str:
    found = re.findall(pattern, text)
    return found[-1] if found else default


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="where the logs and run folders go (default: a temporary directory)")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for everything (default 480)")
    p.add_argument("--steps", default="kernels,train",
                   help="which groups: kernels (tests and speed), train (train, export, bench); default both")
    args = p.parse_args(argv)
    steps = set(args.steps.split(","))
    if not steps <= {"kernels", "train"}:
        p.error(f"--steps: unknown {sorted(steps - {'kernels', 'train'})}; choose from kernels, train")

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device in this interpreter (torch " + torch.__version__ + "): nothing to check")
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="lyanna-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    py, begin, rows = sys.executable, time.perf_counter(), []
    left = lambda share: min(share, args.budget - (time.perf_counter() - begin))  # noqa: E731
    run_dir, export_dir = out / "run", out / "export"

    if "kernels" in steps:
        ok, secs, text = run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests"], left(150),
                             out / "kernels.log")
        rows.append(("kernels vs references (compiled)", ok, secs, _last(r"(\d+ passed[^\n]*)", text)))

        ok, secs, text = run([py, "bench/gpu_kernels.py", "--dtype", "bf16"], left(90), out / "gpu_kernels.log")
        ratios = re.findall(r"^\s*64\s.*?([\d.]+)x\s+([\d.]+)x\s*$", text, re.M)
        rows.append(("kernel speed (bench/gpu_kernels.py)", ok, secs,
                     f"hot head N=64: ref/triton {ratios[0][0]}x" if ratios else "see gpu_kernels.log"))

    if "train" in steps:
        overrides = ["+recipe=smollm2_135m", f"train.out_dir={run_dir}", "data.max_samples=200", "train.max_steps=60",
                     "train.save_every=0", "train.autocast=null", "target.dtype=bfloat16", "deepspeed.precision=bf16",
                     "eval.num_prompts=4", "tracking.wandb.enabled=false"]
        ok, secs, text = run([py, "-m", "lyanna_train.cli.train", *overrides], left(180), out / "train.log")
        tau = _last(r"eval/mean_tau ([\d.]+)", text, "?")
        rows.append(("train: SmolLM2 recipe, bf16, 60 steps", ok, secs, f"τ {tau}"))

        ok, secs, text = run([py, "-m", "lyanna_train.cli.export", str(run_dir), "--out", str(export_dir),
                              "--overwrite"], left(60), out / "export.log")
        rows.append(("export", ok, secs, ""))

        ok, secs, text = run([py, "-m", "lyanna_train.cli.bench", "--draft", str(export_dir), "--num-prompts", "8",
                              "--turns", "1", "--max-new-tokens", "128", "--out", str(out / "bench")],
                             left(180), out / "bench.log")
        summary = out / "bench" / "summary.json"
        figure = ""
        if summary.is_file():
            s = json.loads(summary.read_text())
            m = s["methods"]
            figure = (f"target {m['target']['tokens_per_s']:.1f} tok/s, lyanna {m['lyanna']['speedup']:.2f}x "
                      f"(τ {m['lyanna']['tau']:.2f}), pld {m['pld']['speedup']:.2f}x, "
                      f"lossless {'yes' if s['lossless'].get('identical') else 'NO'}")
        rows.append(("lyanna-bench, 8 MT-Bench prompts", ok, secs, figure))

    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; logs in {out}\n")
    print("| step | result | seconds | figure |\n|---|---|---:|---|")
    for name, ok, secs, figure in rows:
        print(f"| {name} | {'ok' if ok else 'FAILED'} | {secs:.0f} | {figure} |")
    print(f"\ntotal {time.perf_counter() - begin:.0f} s (budget {args.budget:.0f} s)")
    (out / "gpu_check.json").write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "command": "python bench/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "rows": [{"step": name, "ok": ok, "seconds": round(secs, 1), "figure": figure}
                 for name, ok, secs, figure in rows]}, indent=1))
    return 0 if all(ok for _, ok, _, _ in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
