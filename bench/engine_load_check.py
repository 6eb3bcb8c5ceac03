"""Load an eagle3 export in the real vLLM / SGLang and compare greedy outputs: needs a GPU.

For each engine asked for, on the export's verifier (manifest ``verifier``, else --target)
and MT-Bench first turns rendered with its chat template:

* target-only greedy decoding in the engine (the reference),
* the same with our head as its EAGLE-3 draft (vLLM: ``speculative_config`` on the eagle3
  folder, and ``vllm serve``'s route, the ``speculators/`` folder, when present; SGLang:
  ``speculative_algorithm=EAGLE3`` on the eagle3 folder), ``--depth`` draft tokens per step,

then reports per route: outputs identical to the reference (greedy speculative decoding
is lossless, so any difference means the draft or the verify path is wrong... or bf16
kernel noise: the first differing position is printed), tokens per verify step where
the engine reports it, and wall time. ``--engine ours`` adds (and alone runs, on CPU
too) our runtime's chain decoding of the same head for the same τ comparison: a head the
engine loaded with misrouted weights accepts next to nothing there.

Usage (GPU):
    python bench/engine_load_check.py --export exports/smollm2-eagle3 --engine vllm,sglang,ours
    python bench/engine_load_check.py --export DIR --engine ours --num-prompts 4   # CPU: our side only

Engines not installed, or no CUDA device, are reported as skipped (exit 0), never as passed.
``--out FILE`` writes the report as JSON. Not run in this repository's CI or on its CPU
machines (no vLLM/SGLang there); see docs/export.md "Serving with SGLang / vLLM".
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

ENGINES = ("vllm", "sglang", "ours")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--export", required=True, help="an eagle3 export directory (lyanna-export --format eagle3)")
    p.add_argument("--engine", default="vllm,sglang,ours", help="comma list of vllm, sglang, ours")
    p.add_argument("--target", help="verifier to serve (default: the manifest's verifier)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=3, help="draft tokens per verify step")
    p.add_argument("--dtype", default="bfloat16", help="engine dtype (bfloat16 or float16)")
    p.add_argument("--gpu-memory", type=float, default=0.35, help="fraction of GPU memory per engine instance")
    p.add_argument("--out", help="write the report here as JSON")
    return p.parse_args(argv)


def load_manifest(export: Path) -> dict:
    manifest = json.loads((export / "manifest.json").read_text())
    if manifest.get("format") != "eagle3":
        raise SystemExit(f"{export} is a {manifest.get('format')!r} export: engines load the eagle3 format "
                         "(lyanna-export RUN --format eagle3 --speculators-config)")
    return manifest


def prompts(verifier: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from lyanna_train.evaluation.prompts import read_questions, render_prompt

    tok = AutoTokenizer.from_pretrained(verifier)
    return [render_prompt(tok, [{"role": "user", "content": q.turns[0]}]) for q in read_questions("mtbench", n)]


def compare(reference: list[list[int]], outputs: list[list[int]]) -> dict:
    same = sum(a == b for a, b in zip(reference, outputs))
    first = next(((i, next(j for j, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y))
                  for i, (a, b) in enumerate(zip(reference, outputs)) if a != b), None)
    return {"identical": f"{same}/{len(reference)}", "first_difference": first}


def run_vllm(args, verifier: str, export: Path, ids: list[list[int]]) -> dict:
    from vllm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    inputs = [{"prompt_token_ids": p} for p in ids]

    def generate(**kwargs):
        llm = LLM(model=kwargs.pop("model", verifier), dtype=args.dtype, gpu_memory_utilization=args.gpu_memory,
                  enforce_eager=True, disable_log_stats=False, **kwargs)
        begin = time.perf_counter()
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(inputs, greedy)]
        wall = time.perf_counter() - begin
        metrics = {}
        try:  # vLLM >= 0.10 exposes the spec-decode counters
            for m in llm.get_metrics():
                if "spec_decode" in m.name and hasattr(m, "value"):
                    metrics[m.name] = m.value
        except Exception:  # noqa: BLE001 - older versions have no get_metrics
            pass
        del llm
        gc.collect()
        import torch

        torch.cuda.empty_cache()
        return outs, wall, metrics

    reference, ref_wall, _ = generate()
    report = {"target_only": {"wall_s": round(ref_wall, 2)}}
    spec = {"method": "eagle3", "model": str(export), "num_speculative_tokens": args.depth}
    outs, wall, metrics = generate(speculative_config=spec)
    report["eagle3_folder"] = {**compare(reference, outs), "wall_s": round(wall, 2), "metrics": metrics}
    if (export / "speculators" / "config.json").is_file():  # what `vllm serve EXPORT/speculators` loads
        outs, wall, metrics = generate(model=str(export / "speculators"))
        report["speculators_folder"] = {**compare(reference, outs), "wall_s": round(wall, 2), "metrics": metrics}
    return report


def run_sglang(args, verifier: str, export: Path, ids: list[list[int]]) -> dict:
    import sglang as sgl

    params = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}

    def generate(**kwargs):
        engine = sgl.Engine(model_path=verifier, dtype=args.dtype, mem_fraction_static=args.gpu_memory, **kwargs)
        begin = time.perf_counter()
        outs = engine.generate(input_ids=ids, sampling_params=params)
        wall = time.perf_counter() - begin
        engine.shutdown()
        # token ids where this SGLang version returns them, else the text (characters compared)
        tokens = [list(o["output_ids"]) if o.get("output_ids") is not None else list(o["text"]) for o in outs]
        verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
        produced = sum(o["meta_info"].get("completion_tokens", 0) for o in outs)
        return tokens, wall, (produced / verify if verify else None)

    reference, ref_wall, _ = generate()
    outs, wall, tau = generate(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(export),
                               speculative_num_steps=args.depth, speculative_eagle_topk=1,
                               speculative_num_draft_tokens=args.depth + 1)
    return {"target_only": {"wall_s": round(ref_wall, 2)},
            "eagle3_folder": {**compare(reference, outs), "wall_s": round(wall, 2), "tokens_per_verify": tau}}


def run_ours(args, verifier: str, export: Path, ids: list[list[int]]) -> dict:
    """Our runtime on the same head and verifier: chain drafting ``depth`` deep, every draft verified."""
    import torch

    from lyanna_train.runtime.settings import load_decode_settings
    from lyanna_train.export.reader import load_exported
    from lyanna_train.runtime.scheduling.requests import cut, stop_ids
    from lyanna_train.runtime.scheduling.scheduler import generate
    from lyanna_train.target.model import load_target_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_target_model(verifier).to(device)
    draft, _ = load_exported(export, target)
    settings = load_decode_settings("chain", [f"tree.depth={args.depth}", f"tree.max_nodes={args.depth}"])
    accepted, forwards, identical = 0, 0, 0
    for prompt in ids:
        out = generate(target, draft, prompt, args.max_new_tokens, settings)
        ref = target.generate(torch.tensor([prompt], device=device), max_new_tokens=args.max_new_tokens,
                              do_sample=False)[0, len(prompt):].tolist()
        identical += cut(ref, stop_ids(target, None), args.max_new_tokens)[0] == out.tokens
        accepted += len(out.tokens)
        forwards += out.target_forwards
    return {"device": device, "identical_to_transformers": f"{identical}/{len(ids)}",
            "tokens_per_verify": round(accepted / max(forwards, 1), 3)}


def main(argv=None) -> int:
    args = parse_args(argv)
    export = Path(args.export).resolve()
    manifest = load_manifest(export)
    verifier = args.target or (manifest.get("verifier") or {}).get("name_or_path")
    if not verifier:
        raise SystemExit("the manifest records no verifier: pass --target PATH_OR_MODEL_ID")
    wanted = [e.strip() for e in args.engine.split(",") if e.strip()]
    unknown = [e for e in wanted if e not in ENGINES]
    if unknown:
        raise SystemExit(f"unknown engine(s) {unknown}: choose from {', '.join(ENGINES)}")
    ids = prompts(verifier, args.num_prompts)
    report = {"export": str(export), "verifier": verifier, "prompts": len(ids), "depth": args.depth}
    for engine in wanted:
        if engine != "ours":
            import torch

            if not torch.cuda.is_available():
                report[engine] = {"status": "skipped", "reason": "no CUDA device"}
                continue
            if importlib.util.find_spec(engine) is None:
                report[engine] = {"status": "skipped", "reason": f"{engine} is not installed (pip install {engine})"}
                continue
        if engine != "ours" and len(wanted) > 1:  # engines hold the GPU and process groups: one process each
            argv2 = [sys.executable, __file__, "--export", str(export), "--engine", engine, "--target", verifier,
                     "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
                     "--depth", str(args.depth), "--dtype", args.dtype, "--gpu-memory", str(args.gpu_memory),
                     "--out", str(export.parent / f".engine-check-{engine}.json")]
            proc = subprocess.run(argv2, capture_output=True, text=True)
            result_file = export.parent / f".engine-check-{engine}.json"
            report[engine] = (json.loads(result_file.read_text())[engine] if proc.returncode == 0
                              and result_file.is_file() else {"status": "failed", "stderr": proc.stderr[-2000:]})
            result_file.unlink(missing_ok=True)
            continue
        runner = {"vllm": run_vllm, "sglang": run_sglang, "ours": run_ours}[engine]
        try:
            report[engine] = {"status": "ran", **runner(args, verifier, export, ids)}
        except Exception as err:  # noqa: BLE001 - report the engine's own error, keep the others
            report[engine] = {"status": "failed", "error": f"{type(err).__name__}: {str(err)[:500]}"}
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
