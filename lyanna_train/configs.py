"""Where the shipped configs live: ``conf/`` (Hydra groups, decode presets) and ``recipes/``.

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
