"""Which targets the pipeline can serve: what it needs of an architecture, and the tested table.

The draft head reads the outputs of decoder layers (``base_model.layers``) and is built
in the target's shape (hidden, intermediate and head sizes from its config); the runtime
verifies trees with explicit position ids under a custom attention mask, which needs
rotary positions and attention layers a mask can express (full or sliding-window).
A target missing any of that is refused here, in one line, before anything is built
from it. ``TESTED`` is the table the architecture matrix (``tests/target/
test_architectures.py``) keeps true: each goes through the whole pipeline under eager
and SDPA attention, lossless.
"""

from __future__ import annotations

import warnings

from ..errors import LyannaError

# model_type -> the name docs/architectures.md gives it
TESTED = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma",
          "gemma2": "Gemma2", "phi3": "Phi-3", "gpt_neox": "GPT-NeoX", "qwen2_moe": "Qwen2-MoE", "mixtral": "Mixtral"}
LAYER_KINDS = ("full_attention", "sliding_attention")  # what a custom 4-D mask can express
_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def text_config(config):
    """The language model's config (a multimodal config nests it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _config_gaps(config) -> list[str]:
    gaps = []
    if getattr(config, "rope_parameters", None) is None:
        gaps.append("rotary position embeddings (it uses learned or ALiBi positions)")
    missing = [f for f in _SHAPE_FIELDS if getattr(config, f, None) is None]
    if missing:
        gaps.append(f"{', '.join(missing)} in its config")
    kinds = sorted(set(getattr(config, "layer_types", None) or []) - set(LAYER_KINDS))
    if kinds:
        gaps.append(f"attention layers only (it has {', '.join(kinds)} layers)")
    return gaps


def _refuse(config, gaps: list[str]) -> LyannaError:
    arch = ", ".join(getattr(config, "architectures", None) or []) or type(config).__name__
    return LyannaError(f"target architecture {getattr(config, 'model_type', '?')} ({arch}) is not supported: it lacks "
                       f"{'; '.join(gaps)} (supported: {', '.join(TESTED.values())}; see docs/architectures.md)")


def check_target_config(config) -> None:
    """Refuse a target config the draft head or the runtime cannot work with; warn once
    for a config that has what is needed but is outside the tested table."""
    config = text_config(config)
    gaps = _config_gaps(config)
    if gaps:
        raise _refuse(config, gaps)
    if getattr(config, "model_type", None) not in TESTED:
        warnings.warn(f"target architecture {config.model_type} is not in the tested table (docs/architectures.md); "
                      f"the runtime checks its attention masks at start, training and export are untested",
                      stacklevel=2)


def check_target_model(model) -> None:
    """:func:`check_target_config`, and the decoder layers where the feature capture reads them."""
    config = text_config(model.config)
    gaps = _config_gaps(config)
    if getattr(getattr(model, "base_model", None), "layers", None) is None:
        gaps.append("decoder layers under base_model.layers")
    if gaps:
        raise _refuse(config, gaps)
    check_target_config(config)
