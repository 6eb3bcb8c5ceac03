"""Benchmark: lyanna-serve under load, over HTTP with the openai client, Lyanna vs --no-draft.

Starts two servers on localhost from one export — speculative (Lyanna) and ``--no-draft``
(target-only decoding through the same engine) — and drives both with the same MT-Bench
first turns (chat, greedy, streamed so the first token is timed), side by side in one run:

* **load**: N requests at C concurrency, bounded in time: every request must be answered
  (none lost, none failed), with throughput and p50/p95 latency;
* **levels**: 1, 4, 16 concurrent clients (closed loop), both servers, the order
  alternating per level and pass (``--repeats``: the median pass is reported, with every
  pass); total tokens/s, latency p50/p95, time to first token, τ (from each server's
  /metrics), and whether Lyanna's greedy texts equal --no-draft's.

    python bench/serve_load.py --draft /work/runs/smollm2_135m-export --out checkpoints/serve-load \\
        --load-requests 200 --load-concurrency 32 --levels 1,4,16 --max-tokens 64

Prints a markdown table and writes OUT/serve_load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from lyanna_train.evaluation.report import markdown_table

MODEL = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One lyanna-serve process on a free port."""

    def __init__(self, name: str, args: list[str], log: Path):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log.open("w")
        cmd = [sys.executable, "-m", "lyanna_train.cli.serve", "--port", str(self.port), "--served-model-name", MODEL,
               "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} server exited with {self.proc.returncode}: see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.name} server did not come up in {seconds:.0f} s: see {self.log.name}")

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}

    def stop(self) -> int:
        """SIGTERM, then the exit status (the drain is part of what is measured working)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


async def one_request(client: AsyncOpenAI, prompt: str, max_tokens: int) -> dict:
    began = time.perf_counter()
    first, text, used = None, [], None
    try:
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=max_tokens, temperature=0, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
            used = chunk.usage or used
    except Exception as err:  # noqa: BLE001 - a failed request is a result to report, not a crash
        return {"ok": False, "error": f"{type(err).__name__}: {err}", "latency": time.perf_counter() - began}
    end = time.perf_counter()
    return {"ok": used is not None, "latency": end - began, "ttft": (first or end) - began, "text": "".join(text),
            "tokens": used.completion_tokens if used else 0}


async def drive(url: str, prompts: list[str], concurrency: int, max_tokens: int, time_limit: float) -> dict:
    """Closed loop: ``concurrency`` clients take the prompts in order until none is left."""
    queue = list(enumerate(prompts))[::-1]
    results: list[dict | None] = [None] * len(prompts)
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=time_limit) as client:
        async def worker():
            while queue:
                i, prompt = queue.pop()
                results[i] = await one_request(client, prompt, max_tokens)

        began = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*[worker() for _ in range(concurrency)]), time_limit)
        except asyncio.TimeoutError:
            pass
        wall = time.perf_counter() - began
    done = [r for r in results if r is not None and r["ok"]]
    lat = sorted(r["latency"] for r in done) or [float("nan")]
    ttft = sorted(r["ttft"] for r in done) or [float("nan")]
    tokens = sum(r["tokens"] for r in done)
    return {"requests": len(prompts), "answered": len(done), "failed": sum(1 for r in results if r and not r["ok"]),
            "unanswered": sum(1 for r in results if r is None), "wall_s": wall, "tokens": tokens,
            "tokens_per_s": tokens / wall, "requests_per_s": len(done) / wall,
            "latency_p50": percentile(lat, 50), "latency_p95": percentile(lat, 95), "ttft_p50": percentile(ttft, 50),
            "errors": sorted({r["error"] for r in results if r and not r["ok"]})[:3],
            "texts": [r["text"] if r and r["ok"] else None for r in results]}


def median_pass(passes: list[dict]) -> dict:
    """The pass of median tokens/s (the lower middle one for an even count), with every pass's tokens/s."""
    ranked = sorted(passes, key=lambda r: r["tokens_per_s"])
    return ranked[(len(ranked) - 1) // 2] | {"passes_tokens_per_s": [r["tokens_per_s"] for r in passes]}


def percentile(ordered: list[float], q: float) -> float:
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[q - 1]


def measure(server: Server, prompts: list[str], concurrency: int, max_tokens: int, time_limit: float) -> dict:
    before = server.metrics()
    result = asyncio.run(drive(server.url, prompts, concurrency, max_tokens, time_limit))
    after = server.metrics()
    forwards = after["lyanna_target_forwards_total"] - before["lyanna_target_forwards_total"]
    generated = after["lyanna_generation_tokens_total"] - before["lyanna_generation_tokens_total"]
    steps = after["lyanna_engine_steps_total"] - before["lyanna_engine_steps_total"]
    return result | {"server": server.name, "concurrency": concurrency, "tau": generated / forwards if forwards else 0,
                     "steps": steps, "rows_per_step": forwards / steps if steps else 0}


def table(rows: list[dict]) -> str:
    head = ["server", "clients", "answered", "tok/s", "× no-draft", "req/s", "p50 s", "p95 s", "TTFT p50 s", "τ",
            "steps", "rows/step", "passes tok/s"]
    base = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["server"] == "no-draft"}
    cells = []
    for r in rows:
        ratio = r["tokens_per_s"] / base[r["concurrency"]] if base.get(r["concurrency"]) else float("nan")
        cells.append([r["server"], str(r["concurrency"]), f"{r['answered']}/{r['requests']}", f"{r['tokens_per_s']:.1f}",
                      f"{ratio:.2f}×", f"{r['requests_per_s']:.2f}", f"{r['latency_p50']:.2f}",
                      f"{r['latency_p95']:.2f}", f"{r['ttft_p50']:.2f}", f"{r['tau']:.2f}",
                      f"{r.get('steps', 0):.0f}", f"{r.get('rows_per_step', 0):.1f}",
                      " / ".join(f"{x:.1f}" for x in r.get("passes_tokens_per_s", [r["tokens_per_s"]]))])
    return markdown_table(head, cells, left=("server",))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="exported draft (lyanna-export)")
    p.add_argument("--target", help="target spec (default: the one the export names)")
    p.add_argument("--out", default="checkpoints/serve-load")
    p.add_argument("--prompts", default="mtbench", help="mtbench, humaneval or a JSONL file (first turns)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--levels", default="1,4,16", help="concurrent clients per measured level")
    p.add_argument("--level-requests", default="8,8,32", help="requests per level (same count for both servers)")
    p.add_argument("--repeats", type=int, default=1, help="passes per level and server, interleaved (median reported)")
    p.add_argument("--load-requests", type=int, default=200)
    p.add_argument("--load-concurrency", type=int, default=32)
    p.add_argument("--load-max-tokens", type=int, default=32)
    p.add_argument("--time-limit", type=float, default=600, help="seconds allowed per measured phase")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--threads", type=int, help="torch threads per server (default: torch's choice)")
    p.add_argument("--skip-load", action="store_true")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a decoding setting for both servers (lyanna-serve --set), repeatable")
    p.add_argument("--stock-linears", action="store_true", help="lyanna-serve --stock-linears for both servers")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    serve_extra = [a for kv in args.overrides for a in ("--set", kv)] + (["--stock-linears"] if args.stock_linears else [])

    from lyanna_train.evaluation.prompts import read_questions

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    questions = read_questions(args.prompts)
    firsts = [q.turns[0] for q in questions]
    common = ["--draft", args.draft, "--max-batch", str(args.max_batch), *serve_extra] + \
        (["--target", args.target] if args.target else []) + (["--threads", str(args.threads)] if args.threads else [])
    servers = {"lyanna": Server("lyanna", common, out / "lyanna.log"),
               "no-draft": Server("no-draft", common + ["--no-draft"], out / "no-draft.log")}
    report: dict = {"command": " ".join(sys.argv), "max_tokens": args.max_tokens, "levels": [], "load": None}
    try:
        for server in servers.values():
            server.wait_ready(900)
        levels = [int(x) for x in args.levels.split(",")]
        counts = [int(x) for x in args.level_requests.split(",")]
        for k, (clients, count) in enumerate(zip(levels, counts)):
            prompts = [firsts[i % len(firsts)] for i in range(count)]
            passes: dict[str, list[dict]] = {"lyanna": [], "no-draft": []}
            same = 0
            for r in range(args.repeats):  # interleaved, the order alternating: drift falls on both alike
                order = ["lyanna", "no-draft"] if (k + r) % 2 == 0 else ["no-draft", "lyanna"]
                rows = {name: measure(servers[name], prompts, clients, args.max_tokens, args.time_limit)
                        for name in order}
                same += sum(a == b for a, b in zip(rows["lyanna"]["texts"], rows["no-draft"]["texts"]) if a is not None)
                for name in order:
                    passes[name].append(rows[name])
                print(f"{clients} clients, pass {r + 1}: lyanna {rows['lyanna']['tokens_per_s']:.1f} tok/s, no-draft "
                      f"{rows['no-draft']['tokens_per_s']:.1f} tok/s", flush=True)
            identical = f"{same}/{count * args.repeats}"
            lyanna, plain = (median_pass(passes[name]) | {"identical_to_no_draft": identical}
                             for name in ("lyanna", "no-draft"))
            report["levels"] += [lyanna, plain]
            print(f"{clients} clients: lyanna / no-draft {lyanna['tokens_per_s'] / plain['tokens_per_s']:.2f} "
                  f"(medians of {args.repeats}), identical {identical}", flush=True)
        if not args.skip_load:
            prompts = [firsts[i % len(firsts)] for i in range(args.load_requests)]
            report["load"] = measure(servers["lyanna"], prompts, args.load_concurrency, args.load_max_tokens,
                                     args.time_limit)
    finally:
        report["exit_status"] = {name: s.stop() for name, s in servers.items()}
    for row in report["levels"] + ([report["load"]] if report["load"] else []):
        row.pop("texts", None)
    (out / "serve_load.json").write_text(json.dumps(report, indent=2))
    print(table(report["levels"]))
    if report["load"]:
        r = report["load"]
        print(f"\nload: {r['requests']} requests at {args.load_concurrency} concurrent, {args.load_max_tokens} tokens: "
              f"{r['answered']} answered, {r['failed']} failed, {r['unanswered']} unanswered in {r['wall_s']:.1f} s; "
              f"{r['tokens_per_s']:.1f} tok/s, {r['requests_per_s']:.2f} req/s, latency p50 {r['latency_p50']:.2f} s "
              f"p95 {r['latency_p95']:.2f} s, τ {r['tau']:.2f}")
    print(f"servers exited with {report['exit_status']} after SIGTERM; {out / 'serve_load.json'}")
    lost = report["load"] and (report["load"]["answered"] != report["load"]["requests"])
    return 1 if lost or any(r["answered"] != r["requests"] for r in report["levels"]) else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
