"""``lyanna-train +recipe=NAME [overrides]``: distil a Lyanna draft head (Hydra + DeepSpeed).

``--plan`` prints what the run would cost instead (``lyanna-plan``). Runs as one process
or under the DeepSpeed launcher, which appends ``--local_rank=N``:
that flag is taken out of the arguments (and put in ``LOCAL_RANK``) before Hydra
parses them. Recipes in ``recipes/`` are registered as the ``recipe`` config group.

Before Hydra runs (it writes ``hydra/`` into ``train.out_dir`` and prints several lines for
an error of its own) and before the slow imports (torch, DeepSpeed's op check), the
overrides are composed once, so that an unknown recipe or a value of the wrong type is one
line, and the main rank claims the run folder: a folder that cannot be written, or that
another run holds, is refused in about a second (:func:`claimed_early`).
"""

from __future__ import annotations

import contextlib
import os
import sys

from ..configs import conf_dir, register_configs
from .common import entry_point, exit_on_user_error

PROG = "lyanna-train"


def take_local_rank(argv: list[str]) -> list[str]:
    """Remove ``--local_rank=N`` / ``--local_rank N`` (DeepSpeed launcher) from argv into LOCAL_RANK."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            os.environ["LOCAL_RANK"] = arg.split("=", 1)[1]
        elif arg in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ["LOCAL_RANK"] = argv[i + 1]
            i += 1
        else:
            out.append(arg)
        i += 1
    return out


def run(cfg) -> None:
    from omegaconf import OmegaConf

    from ..training.loop import train

    with exit_on_user_error(PROG):  # inside Hydra's task function: its own handler would print a traceback
        train(cfg, OmegaConf.to_container(cfg, resolve=True))


def _main_rank() -> bool:
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0"


@contextlib.contextmanager
def claimed_early(overrides: list[str]):
    """Compose ``overrides`` and, on the main rank, hold ``train.out_dir``'s lock for the run
    (the trainer's own claim nests in it); errors are ``LyannaError``s (one line, exit 2). Hydra's own flags
    (``--cfg``, ``-m``...) leave all of it to Hydra."""
    if any(arg.startswith("-") for arg in overrides):
        yield
        return
    from ..atomic import check_writable
    from ..errors import LyannaError, os_error_line
    from ..locks import run_folder_lock
    from .plan import compose

    with contextlib.ExitStack() as stack:
        out_dir = compose(overrides).train.out_dir
        if _main_rank():
            check_writable(out_dir, "run folder")
            try:
                os.makedirs(out_dir, exist_ok=True)
                stack.enter_context(run_folder_lock(out_dir))
            except OSError as err:
                raise LyannaError(f"cannot create run folder {out_dir}: {os_error_line(err)}") from None
        yield


@entry_point(PROG)
def main(argv: list[str]) -> int:
    if "--plan" in argv:  # the same config, planned instead of run (lyanna-plan)
        from .plan import main as plan

        return plan([a for a in argv if a != "--plan"])
    import hydra

    sys.argv = [sys.argv[0], *take_local_rank(argv)]  # Hydra parses sys.argv itself
    with claimed_early(sys.argv[1:]):
        from ..training.config import Config

        register_configs(Config)
        hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)(run)()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
