"""Benchmark: hot-vocabulary counting rate vs the tokenizer's raw batched encoding.

Side by side in one run, on the embedded ShareGPT corpus with the SmolLM2 tokenizer:

* raw: ``tokenizer(texts, add_special_tokens=False)`` in batches over the very texts the
  counter tokenizes (conversations rendered with the chat template), rendering excluded;
* count: the ``lyanna-hotvocab`` CLI end to end in a subprocess (JSON parsing, template
  rendering, assistant spans, tokenization, counting), timed by its counting stage,
  with the peak resident memory of its whole process tree sampled from /proc.

Usage: python bench/hotvocab_speed.py [--repeats 2] [--num-proc N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def rendered_texts(tokenizer) -> list[str]:
    from lyanna_train.data.chat_template import ChatRenderer, TemplateRenderError
    from lyanna_train.data.conversations import Document
    from lyanna_train.data.corpus import Corpus, ReadNotes, iter_documents

    renderer = ChatRenderer(tokenizer)
    texts = []
    for doc in iter_documents(Corpus.resolve(["sharegpt"]), ReadNotes()):
        if isinstance(doc, Document):
            try:
                texts.append(renderer.render(doc.messages))
            except TemplateRenderError:
                pass
    return texts


def raw_rate(tokenizer, texts: list[str], batch: int) -> tuple[float, int]:
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), batch):
        tokens += sum(map(len, tokenizer(texts[i:i + batch], add_special_tokens=False)["input_ids"]))
    return tokens / (time.perf_counter() - start), tokens


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as fh:
                total += next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    stack += [int(c) for c in fh.read().split()]
        except (OSError, StopIteration):
            continue
    return total


def count_run(num_proc: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hv"
        cmd = [sys.executable, "-m", "lyanna_train.cli.hotvocab", "--corpus", "sharegpt", "--tokenizer", "smollm2",
               "--out", str(out), "--no-progress", "--num-proc", str(num_proc)]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        peak = [0]

        def sample():
            while proc.poll() is None:
                peak[0] = max(peak[0], _tree_rss(proc.pid))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, err = proc.communicate()
        sampler.join()
        wall = time.perf_counter() - start
        if proc.returncode:
            raise SystemExit(f"lyanna-hotvocab failed:\n{err}")
        manifest = json.loads((out / "manifest.json").read_text())
    timing = manifest["timing"]
    return {"rate": manifest["tokens_encoded"] / timing["seconds"], "tokens": manifest["tokens_encoded"],
            "seconds": timing["seconds"], "wall": wall, "peak_bytes": peak[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-proc", type=int, default=1, help="the CLI's default")
    ap.add_argument("--batch", type=int, default=64, help="raw encoding batch (the counter's default batch)")
    args = ap.parse_args()

    from lyanna_train.target.source import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    texts = rendered_texts(tokenizer)
    print(f"ShareGPT: {len(texts)} rendered conversations, {sum(map(len, texts)) / 1e6:.1f} M characters")
    raws, counts = [], []
    for r in range(args.repeats):  # interleaved, so both see the same machine conditions
        rate, tokens = raw_rate(tokenizer, texts, args.batch)
        raws.append(rate)
        counts.append(count_run(args.num_proc))
        print(f"round {r + 1}: raw {rate:,.0f} tok/s over {tokens:,} tokens | count {counts[-1]['rate']:,.0f} tok/s "
              f"over {counts[-1]['tokens']:,} tokens ({counts[-1]['seconds']:.1f} s counting, "
              f"{counts[-1]['wall']:.1f} s CLI wall), peak {counts[-1]['peak_bytes'] / 2**20:,.0f} MiB")
        assert counts[-1]["tokens"] == tokens, "the counter must tokenize exactly the raw texts"
    raw, count = max(raws), max(c["rate"] for c in counts)
    peak = max(c["peak_bytes"] for c in counts)
    print("\n| measure | value |\n|---|---:|")
    print(f"| raw batched encoding (best of {args.repeats}) | {raw:,.0f} tokens/s |")
    print(f"| lyanna-hotvocab counting, {args.num_proc} proc (best of {args.repeats}) | {count:,.0f} tokens/s |")
    print(f"| ratio count / raw | {count / raw:.3f} (target >= 0.85) |")
    print(f"| peak memory, whole process tree | {peak / 2**20:,.0f} MiB (target < 2048) |")


if __name__ == "__main__":
    main()
