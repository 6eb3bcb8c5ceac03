"""``lyanna-serve``: an OpenAI-compatible HTTP server on the batched speculative-decoding runtime.

    lyanna-serve --draft exports/smollm2-lyanna                       # http://127.0.0.1:8000/v1
    lyanna-serve --draft exports/smollm2-lyanna --no-draft --port 8001   # the target alone, same path
    lyanna-serve --draft exports/smollm2-lyanna --max-batch 32 --set sampling.temperature=0.7

Routes: /v1/completions, /v1/chat/completions (streamed or whole), /v1/models, /health,
/metrics. The library code is lyanna_train/serving; this module only reads the flags.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..serving.limits import Limits
from .common import entry_point
from .generate import add_model_args, load_and_tune


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lyanna-serve", description="Serve the target, speculatively decoded with an "
                                "exported Lyanna draft head and continuous batching, over the OpenAI HTTP API.")
    add_model_args(p)
    p.add_argument("--no-draft", action="store_true", help="serve target-only decoding (one token per forward) "
                   "through the same engine: the baseline")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", metavar="NAME", help="the model id clients send (default: the target's "
                   "name as the draft's manifest gives it, or --target)")
    p.add_argument("--max-batch", type=int, default=16, help="requests decoded together (default 16); more wait")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens when a request gives no max_tokens "
                   "(default 256; cut to the context the prompt leaves)")
    p.add_argument("--max-queue", type=int, default=Limits.max_queue, help="requests that may wait for a decoding "
                   f"slot beyond the --max-batch decoded; more get a 429 (default {Limits.max_queue})")
    p.add_argument("--max-concurrency", type=int, default=Limits.max_concurrency, help="generation requests handled "
                   "at once, from the first byte of the body to the last streamed chunk; more get a 429 "
                   f"(default {Limits.max_concurrency})")
    p.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes, help="largest request body; a "
                   f"larger one gets a 413 unread (default {Limits.max_body_bytes:,} = 8 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="on SIGTERM, seconds in-flight requests "
                   "may take to finish before they are cancelled (default 30)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return p


def model_name(args) -> str:
    """What ``/v1/models`` lists: --served-model-name, else the target spec's last path part."""
    if args.served_model_name:
        return args.served_model_name
    if args.target:
        return Path(args.target).name or args.target
    from ..export.reader import read_manifest

    spec = (read_manifest(args.draft).get("target") or {}).get("name") or "lyanna"
    return Path(spec).name or spec


@entry_point("lyanna-serve")
def main(argv: list[str]) -> int:
    from ..errors import LyannaError
    from ..runtime.settings import load_decode_settings
    from ..serving.server import build_app, listen, serve, target_only

    args = build_parser().parse_args(argv)
    numbers = ("max_batch", "max_tokens", "max_queue", "max_concurrency", "max_body_bytes")
    low = [f"--{n.replace('_', '-')}" for n in numbers if getattr(args, n) < 1]
    if low:
        raise LyannaError(f"{' and '.join(low)} must be at least 1")
    if not 0 < args.port < 65536:
        raise LyannaError(f"--port must lie in 1..65535, got {args.port}")
    name = model_name(args)  # reads the draft's manifest: a wrong --draft is named before the port
    sock = listen(args.host, args.port)  # a port in use: refused now, before the models load
    limits = Limits(args.max_concurrency, args.max_queue, args.max_body_bytes)
    settings = load_decode_settings(args.decode, args.overrides)
    if args.no_draft:
        settings = target_only(settings)
    target, tokenizer, draft, cost = load_and_tune(args, not args.no_draft and settings.tree.depth > 0, settings.tree)
    app = build_app(target, tokenizer, draft, settings, name, args.max_batch, cost, args.max_tokens,
                    args.shutdown_timeout, limits)
    mode = "target only (--no-draft)" if args.no_draft else "speculative" if draft is not None else "prompt lookup"
    seconds = app.state.engine.decoder.warm_up()
    print(f"lyanna-serve: warmed up in {seconds:.1f} s", file=sys.stderr, flush=True)
    print(f"lyanna-serve: {name!r}, {mode}, up to {args.max_batch} requests at once, on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    serve(app, args.host, args.port, args.shutdown_timeout, args.log_level, sock)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
