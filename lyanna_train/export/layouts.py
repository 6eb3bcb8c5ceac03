"""EAGLE-3 heads written by other toolkits: their configs and tensor names, read into ours.

Three layouts, all one decoder layer over ``fc`` of three target layers:

* ``speculators`` (vLLM's speculators library, ``Eagle3DraftModel.save_pretrained``):
  config.json with ``speculators_model_type: eagle3``, the layer shapes nested in
  ``transformer_layer_config``, layer ids in vLLM's convention ("input of layer i") in
  ``eagle_aux_hidden_state_layer_ids``; tensors ``layers.0.*``, ``fc``, ``norm``,
  ``lm_head``, ``d2t``/``t2d`` (absent when the head scores the whole vocabulary) and a
  copy of the verifier's ``embed_tokens.weight``.
* ``specforge`` (SGLang's SpecForge): a Llama config.json (``LlamaForCausalLMEagle3``,
  ``draft_vocab_size``, maybe ``target_hidden_size`` / ``eagle_config``) and ``midlayer.*``
  tensors in model.safetensors, sometimes with ``embed_tokens.weight``.
* ``eagle`` (SafeAILab/EAGLE, ``traineagle3``): the same keys and names, the weights in
  DeepSpeed's ``pytorch_model.bin``; its config may still say ``LlamaForCausalLM``.

speculators' EAGLE-3 variants (``norm_before_fc``, ``fc_norm``, ``norm_output``, its
trainer's defaults) are computed as it does; variants the draft cannot compute the same
way (more layers, q/k norms, rope scaling, biases) are refused
by name, never approximated.
"""

from __future__ import annotations

import torch

from ..errors import LyannaError
from ..models.config import DraftConfig
from . import formats as F

SPECULATORS, SPECFORGE, EAGLE = "speculators", "specforge", "eagle"
LAYOUTS = (SPECULATORS, SPECFORGE, EAGLE)
EMBED = "embed_tokens.weight"  # the source's copy of the target's embeddings: checked, not kept
_CORE = {k for k, v in F.NAMES[F.EAGLE3].items() if v is not None}  # DraftHead names of the EAGLE-3 part (midlayer.*, fc, norm, lm_head, d2t, t2d)
_IGNORED = ("verifier_lm_head.weight", "verifier_norm.weight")  # speculators' frozen training-only copies
# speculators' EAGLE-3 variants the draft computes too (its trainer's defaults turn on norm_before_residual,
# norm_before_fc and norm_output)
_VARIANTS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
_VARIANT_TENSORS = ("input_norm.weight", "fc_norm.")


def detect_layout(config: dict, weights_file: str) -> str:
    """The layout a source directory was written in, from its config.json and weight file name."""
    if "speculators_model_type" in config:
        return SPECULATORS
    return EAGLE if weights_file.endswith(".bin") else SPECFORGE


def _refuse_rope(rope: dict | None, where: str) -> None:
    if rope and (rope.get("rope_type") or rope.get("type") or "default") != "default":
        raise LyannaError(f"{where}: rope scaling {rope} is not supported (the draft uses plain rotary embeddings)")


def _check_llama_layer(layer: dict, where: str) -> None:
    if layer.get("hidden_act", "silu") != "silu":
        raise LyannaError(f"{where}: hidden_act {layer['hidden_act']!r} is not supported (silu only)")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        raise LyannaError(f"{where}: attention/MLP biases are not supported")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise LyannaError(f"{where}: {layer['num_hidden_layers']} decoder layers; only one-layer EAGLE-3 heads "
                          "are supported")
    _refuse_rope(layer.get("rope_scaling"), where)
    params = layer.get("rope_parameters")
    _refuse_rope(params if isinstance(params, dict) else None, where)


def _window_note(layer: dict) -> list[str]:
    """speculators' trainer gives draft layers a sliding window (2048 by default); this draft
    attends to the whole context, which is the same computation up to that many tokens."""
    kinds, window = layer.get("layer_types") or [], layer.get("sliding_window")
    if window and (layer.get("use_sliding_window") or "sliding_attention" in kinds):
        return [f"the source's draft layer attends to a sliding window of {window} tokens; served here over "
                f"the whole context: identical for contexts up to {window} tokens"]
    return []


def config_from_speculators(config: dict, where: str) -> tuple[DraftConfig, dict, list[str]]:
    """(DraftConfig with the pool off, the verifier it records, notes) from a speculators config.json."""
    if config.get("speculators_model_type") != "eagle3":
        raise LyannaError(f"{where}: speculators model type {config.get('speculators_model_type')!r} is not an "
                          "EAGLE-3 head")
    layer = config.get("transformer_layer_config") or {}
    if layer.get("model_type", "llama") != "llama":
        raise LyannaError(f"{where}: a {layer['model_type']!r} decoder layer is not supported (llama only; "
                          "qwen3 layers carry q/k norms)")
    _check_llama_layer(layer, where)
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids and min(int(i) for i in ids) < 1:
        raise LyannaError(f"{where}: layer id 0 (the embeddings) in {ids} cannot be fed to this draft")
    try:
        hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        rope = layer.get("rope_theta", (layer.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        cfg = DraftConfig(
            target_hidden_size=int(config.get("target_hidden_size") or hidden), vocab_size=int(layer["vocab_size"]),
            draft_vocab_size=int(config["draft_vocab_size"]), hidden_size=hidden,
            intermediate_size=int(layer["intermediate_size"]), num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads), rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope), max_position_embeddings=int(layer.get("max_position_embeddings", 4096)),
            num_aux_layers=len(ids) if ids else 3, aux_layer_ids=tuple(int(i) - 1 for i in ids or ()),
            pool_size=0, alpha_max=0.0, other_bucket=False, **{k: bool(config.get(k)) for k in _VARIANTS})
    except KeyError as err:
        raise LyannaError(f"{where}: missing key {err.args[0]!r}") from None
    except (TypeError, ValueError, LyannaError) as err:
        raise LyannaError(f"{where}: {err}") from None
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {})
    return cfg, {k: verifier.get(k) for k in ("name_or_path", "architectures")}, _window_note(layer)


def config_from_eagle3_family(config: dict, where: str) -> DraftConfig:
    """DraftConfig (pool off) from a SpecForge / EAGLE config.json (a Llama config plus draft keys)."""
    if config.get("model_type", "llama") != "llama":
        raise LyannaError(f"{where}: a {config['model_type']!r} draft is not supported (llama only)")
    _check_llama_layer(config, where)
    return F.config_from_eagle3({k: v for k, v in config.items() if k != "rope_scaling"}, where)


def _speculators_name(name: str) -> str:
    if name.startswith("layers.0."):
        return "midlayer." + name.removeprefix("layers.0.")
    return name


def to_draft_names(tensors: dict, layout: str, where: str) -> tuple[dict, torch.Tensor | None]:
    """(DraftHead-named EAGLE-3 tensors without d2t/t2d filled in, the source's embeddings or None).

    Every name must be known: an unknown one (a second layer, q/k norms, an fc norm) is an
    error naming it, so nothing is dropped silently.
    """
    out, embed = {}, None
    for name, tensor in tensors.items():
        if name == EMBED:
            embed = tensor
            continue
        if name in _IGNORED or name.endswith("rotary_emb.inv_freq"):
            continue
        ours = _speculators_name(name) if layout == SPECULATORS else name
        if layout == SPECULATORS and ours.startswith(_VARIANT_TENSORS):  # checked against the config by the caller
            out[ours] = tensor
            continue
        if ours not in _CORE:
            hint = " (a second decoder layer: only one-layer heads are supported)" if name.startswith(
                ("layers.1.", "midlayer.1", "layers.2.")) else ""
            raise LyannaError(f"{where}: tensor {name!r} has no place in this draft{hint}")
        out[ours] = tensor
    missing = sorted(_CORE - {"d2t", "t2d"} - set(out))
    if missing:
        raise LyannaError(f"{where}: missing tensors {missing}")
    return out, embed


def hot_ids_of(state: dict, cfg: DraftConfig, where: str) -> torch.Tensor:
    """The head's draft id -> target id map, from ``d2t`` and/or ``t2d``; the identity for a
    full-vocabulary head that carries neither."""
    d2t, t2d = state.get("d2t"), state.get("t2d")
    n, vocab = cfg.draft_vocab_size, cfg.vocab_size
    if d2t is not None:
        if tuple(d2t.shape) != (n,):
            raise LyannaError(f"{where}: d2t has shape {tuple(d2t.shape)}, the config's draft vocabulary is {n}")
        hot = d2t.to(torch.int64) + torch.arange(n)
    elif t2d is not None:  # EAGLE-3 orders the draft vocabulary by ascending target id
        hot = torch.nonzero(t2d.to(torch.bool)).flatten()
    elif n == vocab:
        hot = torch.arange(n)
    else:
        raise LyannaError(f"{where}: a {n}-token LM head over a {vocab}-token vocabulary but no d2t/t2d map")
    if len(hot) != n or int(hot.min()) < 0 or int(hot.max()) >= vocab or len(torch.unique(hot)) != n:
        raise LyannaError(f"{where}: the vocabulary map is not {n} distinct ids below {vocab}")
    if t2d is not None:
        mask = t2d.to(torch.bool)
        if tuple(mask.shape) != (vocab,) or int(mask.sum()) != n or not bool(mask[hot].all()):
            raise LyannaError(f"{where}: t2d does not mark the {n} tokens d2t maps to (a {vocab}-token mask expected)")
    return hot
