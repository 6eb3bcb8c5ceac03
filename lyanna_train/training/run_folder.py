"""A run folder belongs to one run at a time, and to one configuration.

Before any work the main rank claims ``train.out_dir``: it checks that the folder can be
written, takes its lock (held until the run ends, so a second run there stops at once,
naming the first), removes what dead runs left half-written, and compares the new
config with the one the folder was trained with (``config.yaml``). A change that alters
what is trained — another learning rate, corpus, draft shape — is refused on
``train.resume=auto``, naming each differing field, unless ``train.resume=force`` asks to
continue the folder's run with it; only how the run is watched and stored (logging,
evaluation, checkpoint cadence, threads, W&B) may change freely. A folder where nothing
was built yet (a run that failed during setup) takes any config. The verdict is shared
with every rank, so all stop with the same one line.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..atomic import check_writable, remove_stale_temporaries, write_text_atomic
from ..errors import LyannaError, os_error_line
from ..locks import run_folder_lock
from ..run_record import latest_checkpoint
from . import checkpoint as ckpt

CONFIG_FILE = "config.yaml"

# Fields (or groups, ending in ".") that change how a run is watched or stored, not what it
# trains: they may differ between the sessions of one run.
OPERATIONAL = ("run_name", "train.out_dir", "train.resume", "train.threads", "train.log_every", "train.save_every",
               "train.keep_last", "deepspeed.backend", "data.cache_dir", "tracking.", "eval.")


@dataclass
class Claim:
    resume_from: str | None  # the checkpoint to resume (None: start at step 0)
    forced: list = field(default_factory=list)  # (field, saved, new) accepted by train.resume=force


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def _operational(name: str) -> bool:
    return any(name == f or (f.endswith(".") and name.startswith(f)) for f in OPERATIONAL)


_ABSENT = "<absent>"


def changed_fields(saved: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(field, saved value, new value) for every field that alters what is trained."""
    old, now = _flatten(saved), _flatten(new)
    return [(k, old.get(k, _ABSENT), now.get(k, _ABSENT)) for k in sorted(set(old) | set(now))
            if not _operational(k) and old.get(k, _ABSENT) != now.get(k, _ABSENT)]


def describe(changes: list, limit: int = 8) -> str:
    shown = [f"{k} {a!r} -> {b!r}" for k, a, b in changes[:limit]]
    more = f" and {len(changes) - limit} more" if len(changes) > limit else ""
    return ", ".join(shown) + more


def _saved_config(out_dir: Path) -> dict | None:
    from omegaconf import OmegaConf

    path = out_dir / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        saved = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as err:  # noqa: BLE001 - OSError, YAML errors of several kinds
        raise LyannaError(f"{path} is unreadable ({type(err).__name__}); it records what this folder trained: "
                          "restore it or use another train.out_dir") from None
    if not isinstance(saved, dict):
        raise LyannaError(f"{path} does not hold a config mapping; restore it or use another train.out_dir")
    return saved


def resolved(cfg) -> dict:
    """The config as plain data (a Hydra DictConfig or a :class:`Config` dataclass)."""
    from omegaconf import DictConfig, OmegaConf

    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    return OmegaConf.to_container(node, resolve=True)


def _holds_work(out_dir: Path) -> bool:
    """Whether anything was built here with the saved config (a run that failed in setup built nothing)."""
    return latest_checkpoint(out_dir / "checkpoints") is not None or \
        any((out_dir / part / "manifest.json").is_file() for part in ("hotvocab", "features"))


def _claim_on_main(cfg, out_dir: Path, stack: contextlib.ExitStack, say) -> Claim:
    from omegaconf import OmegaConf

    check_writable(out_dir, "run folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise LyannaError(f"cannot create run folder {out_dir}: {os_error_line(err)}") from None
    stack.enter_context(run_folder_lock(out_dir))
    for stale in [*remove_stale_temporaries(out_dir), *ckpt.remove_partials(out_dir / "checkpoints")]:
        say(f"removed {stale.name}, left half-written by an earlier run that stopped")
    root = out_dir / "checkpoints"
    latest = latest_checkpoint(root)
    mode = cfg.train.resume
    if mode == "never" and latest is not None:
        raise LyannaError(f"train.resume=never, but {root} holds checkpoints of an earlier run (up to {latest.name}); "
                          "new ones would mix with them: delete that folder or set another train.out_dir")
    resume = ckpt.resolve_resume(mode, root)
    new = resolved(cfg)
    saved = _saved_config(out_dir) if _holds_work(out_dir) else None
    changes = changed_fields(saved, new) if saved is not None else []
    if changes and mode in ("auto", "never"):
        raise LyannaError(f"{out_dir} was trained with another configuration: {describe(changes)}. These change what "
                          "is trained: set train.resume=force to continue that run with them, or use another "
                          "train.out_dir")
    if changes:
        say(f"train.resume={mode}: continuing with changed {describe(changes)}")
    try:
        write_text_atomic(out_dir / CONFIG_FILE, OmegaConf.to_yaml(new))
    except OSError as err:
        raise LyannaError(f"cannot write {out_dir / CONFIG_FILE}: {os_error_line(err)}") from None
    return Claim(str(resume) if resume is not None else None, changes)


def _share(outcome, world: int):
    """Rank 0's outcome, on every rank (pickled between our own processes, never read from disk)."""
    import torch

    if world == 1:
        return outcome
    box = [outcome]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def claim(cfg, out_dir: Path, rank: int, world: int, say=print) -> Iterator[Claim]:
    """Claim ``out_dir`` for this run (lock held by the main rank until the block ends)."""
    stack = contextlib.ExitStack()
    outcome = None
    if rank == 0:
        try:
            outcome = ("ok", _claim_on_main(cfg, out_dir, stack, say))
        except LyannaError as err:
            outcome = ("error", str(err))
        except BaseException:
            _share(("error", "the main rank failed while claiming the run folder"), world)
            stack.close()
            raise
    outcome = _share(outcome, world)
    if outcome[0] == "error":
        stack.close()
        raise LyannaError(outcome[1])
    with stack:
        yield outcome[1]
