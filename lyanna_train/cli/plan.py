"""``lyanna-plan +recipe=NAME [overrides] [--gpus N] [--gpu-memory GiB]``: what a run will cost.

    lyanna-plan +recipe=llama3_8b target.name=/models/Meta-Llama-3-8B-Instruct --gpus 8 --gpu-memory 80
    lyanna-train +recipe=llama3_8b target.name=/models/Meta-Llama-3-8B-Instruct --plan     # the same

Composes the config exactly as ``lyanna-train`` does, builds the target and the draft on
the meta device from the target's ``config.json`` (no weights are read; a recipe's hub id
needs no download: its config ships with the package), and prints the parameters, the
memory per rank for the configured dtype and ZeRO stage, the hot-vocabulary size, the
feature cache's size in each feature dtype, and each phase's hours from a stated
throughput per GPU (``--tflops``). Exit status 2, with one line, when the plan
does not fit ``--gpu-memory``.
"""

from __future__ import annotations

import argparse

from .common import entry_point


def build_parser() -> argparse.ArgumentParser:
    from ..training.plan import DEFAULT_TFLOPS  # lazily: lyanna-train imports this module before torch

    p = argparse.ArgumentParser(prog="lyanna-plan", description="Plan a training run from the target's config.json "
                                "(meta device, no weights): parameters, memory per rank, feature-cache disk.")
    p.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="as for lyanna-train: +recipe=NAME, key=value")
    p.add_argument("--gpus", type=int, default=1, help="ranks the run will use (default 1)")
    p.add_argument("--gpu-memory", type=float, metavar="GIB", help="memory of one GPU in GiB: refuse a plan that "
                   "does not fit (default: the local GPU's, if any)")
    p.add_argument("--tokens", type=int, help="training tokens, for the feature cache's size and the phase "
                   "times (default: data.max_samples x data.max_length, an upper bound)")
    p.add_argument("--tflops", type=float, default=DEFAULT_TFLOPS, help="sustained bf16 TFLOP/s per GPU the phase "
                   f"times assume (default {DEFAULT_TFLOPS:g}: ~40 %% of an H100 SXM's dense peak)")
    return p


def compose(overrides: list[str]):
    """The config ``lyanna-train`` would run with these overrides (recipes registered)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ..configs import conf_dir, register_configs
    from ..errors import LyannaError
    from ..training.config import Config

    register_configs(Config)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            return hydra_compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise LyannaError(f"config: {config_error(err)}") from None


_HYDRA_TRAILERS = ("See https://", "Config search path", "Available options", "full_key:", "object_type=")


def config_error(err: Exception) -> str:
    """Hydra's several-line message (and the OmegaConf error under it) as one line: what is
    wrong, the cause (``Value 'abc' ... could not be converted to Float``), the choices."""
    lines = []
    for line in str(err).strip().splitlines():
        if line.strip().startswith(_HYDRA_TRAILERS):
            break
        if line.strip():
            lines.append(line.strip())
    message = " ".join(lines) or type(err).__name__
    cause = err.__cause__ if isinstance(err.__cause__, Exception) else None
    if cause is not None:
        message += f": {config_error(cause)}"
    options = getattr(err, "options", None)  # MissingConfigException: an unknown +recipe=NAME
    if options:
        message += f" (choose from {', '.join(options)})"
    return message


def _local_gpu_memory() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 1024**3


@entry_point("lyanna-plan")
def main(argv: list[str]) -> int:
    from ..errors import LyannaError
    from ..training.config import validate
    from ..training.plan import check_fits, describe, make_plan

    # Hydra overrides may come before, between or after the flags: put them last for argparse
    overrides = [a for a in argv if not a.startswith("-") and ("=" in a or a.startswith("~"))]
    args = build_parser().parse_args([a for a in argv if a not in overrides] + overrides)
    if args.gpus < 1 or (args.gpu_memory is not None and args.gpu_memory <= 0) or not args.tflops > 0:
        raise LyannaError("--gpus, --gpu-memory and --tflops must be positive")
    cfg = compose(args.overrides)
    validate(cfg)
    plan = make_plan(cfg, world=args.gpus, tokens=args.tokens, tflops=args.tflops)
    memory = args.gpu_memory or _local_gpu_memory()
    print(describe(plan, memory))
    if memory:
        check_fits(plan, memory)
        print(f"fits: ~{plan.memory_per_rank / 1024**3:,.1f} of {memory:,.1f} GiB per rank")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
