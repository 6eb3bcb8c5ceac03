"""Where the shipped configs live: ``conf/`` (Hydra groups, decode presets) and ``recipes/``,
and how Hydra is told about them (:func:`register_configs`).

They sit at the top of the checkout, where people read and edit them, and are linked
into the package (``lyanna_train/conf``, ``lyanna_train/recipes``) so a wheel carries
them: an editable install and a plain ``pip install .`` find them the same way.
``$LYANNA_CONF`` / ``$LYANNA_RECIPES`` point elsewhere (a user's own tree).
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path


def _shipped(name: str) -> Path:
    return Path(str(files(__package__) / name))


def conf_dir() -> Path:
    """The Hydra config tree (``config.yaml`` and one folder per group)."""
    return Path(os.environ.get("LYANNA_CONF") or _shipped("conf"))


def recipes_dir() -> Path:
    """One YAML per target model, selected with ``+recipe=NAME``."""
    return Path(os.environ.get("LYANNA_RECIPES") or _shipped("recipes"))


def decode_dir() -> Path:
    """Decoding presets (``--decode NAME``)."""
    return conf_dir() / "decode"


_registered: tuple | None = None  # what the store holds: the schema and the recipe files as they were


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size


def register_configs(schema) -> None:
    """The typed schema (``training.config.Config``, handed in: this module stays a leaf) as
    ``lyanna_schema``, which ``conf/config.yaml``'s defaults start from, and every
    ``recipes/*.yaml`` as the ``recipe`` group (package _global_). Once per process while
    the recipe files stay as they are (a compose registered them again: ~60 ms each)."""
    global _registered
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    paths = sorted(recipes_dir().glob("*.yaml"))
    key = (id(schema), str(recipes_dir()), tuple((p.name, *_stamp(p)) for p in paths))
    if key == _registered:
        return
    store = ConfigStore.instance()
    store.store(name="lyanna_schema", node=schema)
    for path in paths:
        store.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")
    _registered = key
