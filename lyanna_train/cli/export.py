"""``lyanna-export``: turn a training checkpoint into a serving directory.

    lyanna-export checkpoints/smollm2_135m --out exports/smollm2-lyanna
    lyanna-export checkpoints/smollm2_135m --out exports/smollm2-eagle3 --format eagle3 --speculators-config
    lyanna-export checkpoints/smollm2_135m/checkpoints/step-00000150 --out exports/at-150
    lyanna-export import path/to/speculators-head --target smollm2 --out exports/imported

``import`` reads an EAGLE-3 head written by speculators, SpecForge or the EAGLE repository
into the lyanna format (see :mod:`lyanna_train.export.importer`).
"""

from __future__ import annotations

import argparse

from .common import entry_point


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lyanna-export",
        description="Export a trained draft head: weights, config.json, hot-vocabulary map and a manifest "
        "(target/tokenizer fingerprints, training config, final metrics), written atomically.",
        epilog="To import a head trained elsewhere: lyanna-export import SRC --target T --out DIR "
        "(lyanna-export import --help).")
    p.add_argument("checkpoint", metavar="CHECKPOINT_OR_RUN_DIR",
                   help="a step-NNNNNNNN checkpoint, or a run directory (its latest complete checkpoint is used)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", choices=["lyanna", "eagle3"], default="lyanna",
                   help="lyanna: everything, state pool and alpha-gate included (default); eagle3: the "
                   "LlamaForCausalLMEagle3 layout SGLang and vLLM load (no pool, no alpha-gate)")
    p.add_argument("--speculators-config", action="store_true",
                   help="eagle3 only: also write speculators/, the same head as the speculators library names it "
                   "(config.json + weights); `vllm serve OUT/speculators` serves it")
    p.add_argument("--with-embeddings", action="store_true",
                   help="eagle3 only: store the verifier's embed_tokens.weight beside the head (as SpecForge does), "
                   "for speculators' converter; SGLang and vLLM do not need it")
    p.add_argument("--verifier", help="the target as engines open it, a directory or model id, recorded with its "
                   "architectures (default: the run's target, resolved to the directory its weights are read from)")
    p.add_argument("--speculative-tokens", type=int, default=3,
                   help="draft depth recorded in the speculators config (default 3)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="cast the floating-point weights (default: as trained)")
    p.add_argument("--target", help="target to fingerprint when the run directory does not record it "
                   "(default: the checkpoint's target)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    return p


def build_import_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lyanna-export import",
        description="Import an EAGLE-3 draft head trained with speculators, SpecForge or the EAGLE repository "
        "into the lyanna format (served by lyanna-generate / lyanna-bench, fine-tuned with "
        "lyanna-train draft.init_from=DIR), keeping its vocabulary map. A head made for another target is refused.")
    p.add_argument("source", metavar="SRC", help="the head's directory (config.json + model.safetensors, "
                   "model.safetensors.index.json or pytorch_model.bin)")
    p.add_argument("--target", required=True, help="the target it drafts for: embedded name, GGUF file or "
                   "Hugging Face directory (checked against the head: hidden size, vocabulary, embeddings, tokenizer)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--layout", choices=["auto", "speculators", "specforge", "eagle"], default="auto",
                   help="the source's layout (default: detected from config.json and the weight file)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="cast the floating-point weights (default: as stored)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    return p


@entry_point("lyanna-export")
def main(argv: list[str]) -> int:
    from ..errors import LyannaError
    from ..export.writer import export_checkpoint

    if argv[:1] == ["import"]:
        from ..export.importer import import_head

        args = build_import_parser().parse_args(argv[1:])
        import_head(args.source, args.out, args.target, layout=args.layout, dtype=args.dtype,
                    overwrite=args.overwrite, say=print)
        return 0
    args = build_parser().parse_args(argv)
    if args.speculative_tokens < 1:
        raise LyannaError("--speculative-tokens must be at least 1")
    export_checkpoint(args.checkpoint, args.out, args.format, target_name=args.target, dtype=args.dtype,
                      overwrite=args.overwrite, speculators=args.speculators_config, verifier=args.verifier,
                      speculative_tokens=args.speculative_tokens, embeddings=args.with_embeddings, say=print)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
