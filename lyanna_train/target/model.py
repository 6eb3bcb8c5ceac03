"""Load the target model (embedded name, GGUF file or local directory) and fingerprint it.

A GGUF target is de-quantised by transformers once (~20 s for SmolLM2) and the result
is cached as safetensors beside the converted tokenizer (``TargetRef.cache_dir/model``);
later loads read the cache directly. Nothing is fetched from the network.
"""

from __future__ import annotations

import hashlib
import json

import torch

from ..atomic import atomic_directory
from ..errors import LyannaError
from .source import REMOTE_CODE_REFUSED, TargetRef, refuses_remote_code, resolve_target
from .support import check_target_config, check_target_model

# Config fields that decide the shapes and the numerics of a forward pass; anything
# else (generation defaults, names, paths) may differ between copies of one target.
_CONFIG_KEYS = (
    "model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "hidden_act",
    "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "tie_word_embeddings",
    "attention_bias", "mlp_bias",
)
_DIGEST_ELEMENTS = 256  # per parameter: enough to tell fine-tunes apart, cheap for 8B models


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def _resolve(spec_or_ref: str | TargetRef) -> TargetRef:
    if isinstance(spec_or_ref, TargetRef):
        return spec_or_ref
    try:
        return resolve_target(spec_or_ref)
    except LyannaError as err:  # resolve_target words its errors for tokenizers
        raise LyannaError(f"target model: {err}") from None


def _from_pretrained(ref: TargetRef, path: str, dtype: torch.dtype, **kwargs):
    from transformers import AutoModelForCausalLM

    try:
        # never the folder's own code (auto_map), whatever stdin would answer: see loading._from_pretrained
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, trust_remote_code=False,
                                                    **kwargs)
    except Exception as err:  # noqa: BLE001 - transformers raises many types
        if refuses_remote_code(err):
            raise LyannaError(f"cannot load target model {ref.spec}: {REMOTE_CODE_REFUSED}") from None
        raise LyannaError(f"cannot load target model {ref.spec}: {_first_line(err)}") from None


def _dense_gguf() -> dict:
    """Ask for plain dense weights: a model that keeps GGUF blocks cannot be saved."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always de-quantise GGUF
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def model_dir(ref: TargetRef) -> str:
    """A directory (or cached hub id) ``from_pretrained`` reads without converting anything."""
    if ref.gguf_file is None:
        return ref.path
    cached = ref.cache_dir / "model"
    if not (cached / "config.json").exists():
        model = _from_pretrained(ref, ref.path, torch.float32, gguf_file=ref.gguf_file, **_dense_gguf())
        with atomic_directory(cached, overwrite=True) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
    return str(cached)


def _check_config(ref: TargetRef, path: str) -> None:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception:  # noqa: BLE001 - from_pretrained words the same failure below, in one line
        return
    try:
        check_target_config(config)
    except LyannaError as err:
        raise LyannaError(f"{ref.spec}: {err}") from None


def load_target_model(spec_or_ref: str | TargetRef, dtype: torch.dtype = torch.float32,
                      attn_implementation: str | None = None):
    """The target as an eval-mode ``*ForCausalLM`` with gradients off (it is never trained).
    ``attn_implementation``: transformers' choice when None (SDPA where the model has it)."""
    ref = _resolve(spec_or_ref)
    path = model_dir(ref)
    _check_config(ref, path)  # before the weights: an unsupported 7B target is refused in a second
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = _from_pretrained(ref, path, dtype, **extra)
    check_target_model(model)
    model.eval()
    model.requires_grad_(False)
    return model


def _config_summary(config) -> dict:
    raw = config.to_dict()
    return {k: raw[k] for k in _CONFIG_KEYS if raw.get(k) is not None}


def _weight_digest(model) -> str:
    """sha256 over a strided sample of every parameter, rounded to bf16.

    Rounding to bf16 first makes a target loaded in fp32 or bf16 digest the same (the
    features it yields are stored in bf16 anyway); a fine-tune changes nearly every
    element, so 256 per tensor are plenty.
    """
    h = hashlib.sha256()
    for name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // _DIGEST_ELEMENTS)
        sample = flat[::step][:_DIGEST_ELEMENTS].to(torch.bfloat16).view(torch.int16)
        h.update(f"{name}:{tuple(param.shape)}\0".encode())
        h.update(sample.cpu().numpy().tobytes())
    return h.hexdigest()


def target_fingerprint(model) -> str:
    """A short hash of the architecture and a weight sample; caches made with another target differ."""
    summary = json.dumps(_config_summary(model.config), sort_keys=True, default=str)
    digest = hashlib.sha256(summary.encode() + b"\0" + _weight_digest(model).encode()).hexdigest()
    return "sha256:" + digest[:16]
