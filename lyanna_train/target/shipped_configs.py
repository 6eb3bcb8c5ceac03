"""The recipe models' configs, shipped with the package (``model_configs/*.json``).

``lyanna-plan +recipe=llama2_7b`` plans a run for a model that is usually not on the
planning machine: the plan needs only a few shapes (hidden size, layers, heads,
intermediate size, vocabulary), and these files carry them for each recipe's hub id,
so the plan answers at once, offline, without the weights or a Hugging Face cache.
A local directory or cached download is read as before; a shipped copy is used only
for a hub id that is not on disk.
"""

from __future__ import annotations

import json
from importlib.resources import files

_DIR = "model_configs"


def _file_name(hub_id: str) -> str:
    return hub_id.replace("/", "--") + ".json"


def shipped_hub_ids() -> list[str]:
    """Hub ids whose config ships with the package."""
    root = files(__package__) / _DIR
    return sorted(json.loads(p.read_text())["hub_id"] for p in root.iterdir() if p.name.endswith(".json"))


def shipped_config(hub_id: str):
    """The ``transformers`` config of ``hub_id`` from its shipped copy, or None when none ships."""
    from transformers import AutoConfig

    path = files(__package__) / _DIR / _file_name(hub_id)
    if not path.is_file():
        return None
    fields = dict(json.loads(path.read_text())["config"])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
