"""Decoding settings as data: ``conf/decode/<preset>.yaml`` plus ``key=value`` overrides.

The YAML is checked against :class:`~lyanna_train.runtime.decode.DecodeSettings` itself
(an OmegaConf structured config), so a misspelt key or a value of the wrong type stops
with one line naming it instead of being silently ignored.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..configs import decode_dir
from ..errors import LyannaError


def presets() -> list[str]:
    return sorted(p.stem for p in decode_dir().glob("*.yaml"))


def preset_path(preset: str) -> Path:
    """A preset name (``conf/decode/<name>.yaml``) or a path to a YAML file."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    path = decode_dir() / f"{preset}.yaml"
    if not path.is_file():
        raise LyannaError(f"unknown decode preset {preset!r} (choose from {', '.join(presets())}, or a .yaml file)")
    return path


def _fields(node, prefix: str = "") -> list[str]:
    """Every leaf key, dotted (``tree.depth``): what an error message lists."""
    from omegaconf import DictConfig

    out = []
    for key in node:
        child = node[key]
        out += _fields(child, f"{prefix}{key}.") if isinstance(child, DictConfig) else [f"{prefix}{key}"]
    return out


def _merge(schema, *sources) -> None:
    """Merge in place; frozen dataclasses make every node read-only, so lift that meanwhile."""
    from omegaconf import DictConfig, read_write

    with contextlib.ExitStack() as stack:
        stack.enter_context(read_write(schema))
        for key in schema:
            if isinstance(schema[key], DictConfig):
                stack.enter_context(read_write(schema[key]))
        schema.merge_with(*sources)


def load_decode_settings(preset: str = "default", overrides: list[str] | tuple = ()):
    """``preset`` (name or YAML path) + dotlist ``overrides`` (``tree.depth=6``) -> DecodeSettings."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    from .decode import DecodeSettings

    path = preset_path(preset)
    schema = OmegaConf.structured(DecodeSettings)
    known = ", ".join(_fields(schema))
    for item in overrides:
        if "=" not in item:
            raise LyannaError(f"decode override {item!r} is not key=value (keys: {known})")
    try:
        sources = [OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides))]
    except Exception as err:  # noqa: BLE001 - yaml and the dotlist parser raise several types
        raise LyannaError(f"cannot read decode settings {path} / {list(overrides)}: {err}") from None
    try:
        _merge(schema, *sources)
    except ConfigKeyError as err:
        raise LyannaError(f"unknown decode setting {err.full_key!r} (known: {known})") from None
    except OmegaConfBaseException as err:
        where = f" for {err.full_key}" if getattr(err, "full_key", None) else ""
        raise LyannaError(f"bad decode setting{where}: {str(err).splitlines()[0]}") from None
    try:
        return OmegaConf.to_object(schema)
    except ValueError as err:  # the dataclasses' own range checks
        raise LyannaError(f"bad decode settings ({path.name} with {list(overrides)}): {err}") from None
