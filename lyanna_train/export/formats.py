"""The two export formats: tensor-name tables and ``config.json`` builders.

``lyanna``: every part of the draft (α-gate, pool settings, "other" logit); config.json
holds the :class:`DraftConfig` fields. Read back by :func:`lyanna_train.export.reader.load_exported`.

``eagle3``: what SGLang's ``LlamaForCausalLMEagle3`` and vLLM's ``Eagle3LlamaForCausalLM``
load (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``; the engines share
the target's embeddings, so none are written). Those engines have no state pool and no
α-gate: they are left out and the head serves as a plain EAGLE-3 draft (loaded back
here with the pool off). The "other" logit, if trained, is dropped too.

Aux-layer ids. Ours (``DraftConfig.aux_layer_ids``): "output of decoder layer i,
0-based" = HF ``hidden_states[i + 1]``. The engines read two different keys:

* SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` and captures the
  *input* of layer ``id + 1`` (``LlamaForCausalLM.set_eagle3_layers_to_capture``:
  ``layers_to_capture = [val + 1 for val in layer_ids]``), i.e. the output of layer
  ``id``: our convention, written unchanged.
* vLLM reads the top-level ``eagle_aux_hidden_state_layer_ids``
  (``eagle3_utils.get_eagle3_aux_layers_from_config``) and captures
  ``hidden_states + residual`` *before* layer ``id`` (``LlamaModel.forward``), i.e.
  the output of layer ``id - 1``: written as ours + 1.

Both defaults agree with EAGLE-3's: ours (1, L/2-1, L-4) = vLLM (2, L/2, L-3).
"""

from __future__ import annotations

import dataclasses

from ..errors import LyannaError
from ..models.config import DraftConfig
from ..target.capture import LAYER_CONVENTION

KIND = "lyanna.draft-export"
VERSION = 1
LYANNA, EAGLE3 = "lyanna", "eagle3"
FORMATS = (LYANNA, EAGLE3)
MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
HOT_VOCAB_FILE = "hot_vocab.safetensors"  # hot_ids, d2t, t2d + tokenizer fingerprint (hotvocab artifact layout)
# eagle3: engines load every *.safetensors beside config.json, so Lyanna's own files go one level down
SIDE_DIR = "lyanna"
EMBED_TOKENS = "embed_tokens.weight"  # the verifier's embeddings, stored beside a head only for speculators
SPECULATORS_DIR = "speculators"  # speculators' config.json + the weights under its names (vllm serve DIR)
AUX_CONVENTION = LAYER_CONVENTION  # ours, as the manifest states it

_CORE = (  # the EAGLE-3 layout, named as SGLang and vLLM name it
    "fc.weight",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
)
_LYANNA_ONLY = ("embed_proj.weight", "gate.proj.weight", "gate.proj.bias", "gate.out.weight", "gate.out.bias",
                "input_norm.weight", *(f"fc_norm.{i}.weight" for i in range(16)))  # imported variants' norms

# DraftHead state-dict name -> name in the export; None: not part of that format.
NAMES: dict[str, dict[str, str | None]] = {
    LYANNA: {name: name for name in _CORE + _LYANNA_ONLY},
    EAGLE3: {**{name: name for name in _CORE},
             "gate.proj.weight": None, "gate.proj.bias": None, "gate.out.weight": None, "gate.out.bias": None},
}


def fold_aux_scale(cfg: DraftConfig, state: dict) -> tuple[DraftConfig, dict]:
    """``fc(aux · s)`` = ``(W · diag s)(aux)``: the per-dimension feature scale goes into fc,
    so every format (and every engine) sees a plain EAGLE-3 ``fc``."""
    if not cfg.aux_scale:
        return cfg, state
    state = dict(state)
    scale = state.pop("aux_scale")
    state["fc.weight"] = (state["fc.weight"].float() * scale.float()[None, :]).to(state["fc.weight"].dtype)
    return dataclasses.replace(cfg, aux_scale=False), state


def hot_vocab_file(fmt: str) -> str:
    """Where the hot-vocabulary map lives in an export, relative to it."""
    return HOT_VOCAB_FILE if fmt == LYANNA else f"{SIDE_DIR}/{HOT_VOCAB_FILE}"


def rename(state: dict, table: dict, where: str) -> dict:
    """Rename through ``table``; a name it does not list is an error (never passed through silently)."""
    out = {}
    for name, tensor in state.items():
        if name not in table:
            raise LyannaError(f"{where}: unknown tensor {name!r} (not in the export's name table)")
        if table[name] is not None:
            out[table[name]] = tensor
    return out


def inverse(table: dict) -> dict:
    return {new: old for old, new in table.items() if new is not None}


def vllm_layer_ids(ids) -> list[int]:
    return [int(i) + 1 for i in ids]


def sglang_layer_ids(ids) -> list[int]:
    return [int(i) for i in ids]


def lyanna_config(cfg: DraftConfig) -> dict:
    out = cfg.to_dict()
    out["aux_layer_ids"] = [int(i) for i in cfg.aux_layer_ids]
    return out


def config_from_lyanna(config: dict, where: str) -> DraftConfig:
    """A DraftConfig from exactly its fields (an unknown or missing field is an error)."""
    known = {f.name for f in dataclasses.fields(DraftConfig)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise LyannaError(f"{where}: unknown draft config keys {unknown}")
    try:
        return DraftConfig(**{**config, "aux_layer_ids": tuple(config.get("aux_layer_ids", ()))})
    except TypeError as err:
        raise LyannaError(f"{where}: {err}") from None


def check_eagle3(cfg: DraftConfig) -> None:
    """What the engines' EAGLE-3 draft cannot express is refused before anything is written."""
    if cfg.hidden_size != cfg.target_hidden_size:
        raise LyannaError(f"the eagle3 format needs the draft width to equal the target's ({cfg.hidden_size} != "
                          f"{cfg.target_hidden_size}): SGLang and vLLM feed it the target's embeddings")
    if cfg.num_aux_layers != 3:
        raise LyannaError(f"the eagle3 format fuses exactly 3 target layers, this draft fuses {cfg.num_aux_layers}")
    variants = [name for name in ("norm_before_fc", "fc_norm", "norm_output") if getattr(cfg, name)]
    if variants:
        raise LyannaError(f"the eagle3 format has no {', '.join(variants)} (SGLang's and vLLM's EAGLE-3 layer "
                          "lack it): export this head with --format lyanna")
    if list(cfg.aux_layer_ids) != sorted(cfg.aux_layer_ids):  # engines capture layers in model order
        raise LyannaError(f"the eagle3 engines fuse target layers in ascending order; this draft was trained on "
                          f"{list(cfg.aux_layer_ids)} in another order")


def _llama_fields(cfg: DraftConfig, dtype: str) -> dict:
    return {
        "model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "torch_dtype": dtype,
    }


def eagle3_config(cfg: DraftConfig, dtype: str) -> dict:
    """config.json for SGLang / vLLM (``LlamaForCausalLMEagle3``), layer ids in each engine's convention."""
    check_eagle3(cfg)
    out = {"architectures": ["LlamaForCausalLMEagle3"], **_llama_fields(cfg, dtype),
           "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
           "norm_before_residual": cfg.norm_before_residual,  # is the residual the normed incoming state?
           "eagle_config": {"use_aux_hidden_state": True}}
    if cfg.aux_layer_ids:
        out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = sglang_layer_ids(cfg.aux_layer_ids)
        out["eagle_aux_hidden_state_layer_ids"] = vllm_layer_ids(cfg.aux_layer_ids)
    return out


def config_from_eagle3(config: dict, where: str) -> DraftConfig:
    """A DraftConfig (pool, α-gate and "other" logit off) from an EAGLE-3 config.json."""
    if config.get("num_hidden_layers", 1) != 1:
        raise LyannaError(f"{where}: only one-layer EAGLE-3 drafts are supported, not {config['num_hidden_layers']}")
    if config.get("rope_scaling"):
        raise LyannaError(f"{where}: rope_scaling {config['rope_scaling']} is not supported")
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is None and config.get("eagle_aux_hidden_state_layer_ids"):
            ids = [int(i) - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]  # vLLM's convention
        rope = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        return DraftConfig(
            target_hidden_size=int(config.get("target_hidden_size") or hidden), vocab_size=int(config["vocab_size"]),
            draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]), num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads), rms_norm_eps=float(config["rms_norm_eps"]),
            rope_theta=float(rope), max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            num_aux_layers=3, aux_layer_ids=tuple(sglang_layer_ids(ids or ())),
            norm_before_residual=bool(config.get("norm_before_residual", False)), pool_size=0, alpha_max=0.0, other_bucket=False)
    except KeyError as err:
        raise LyannaError(f"{where}: missing key {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise LyannaError(f"{where}: {err}") from None


def speculators_config(cfg: DraftConfig, verifier: dict, speculative_tokens: int, dtype: str) -> dict:
    """speculators' config.json (``speculators_model_type: eagle3``) for the same head, which
    ``vllm serve`` and speculators' ``Eagle3DraftModel.from_pretrained`` load.

    vLLM converts it in ``SpeculatorsConfig``/``update_eagle3``: ``norm_before_residual``
    defaults to True there, so it is written out; layer ids use vLLM's convention.
    ``verifier``: {"name_or_path", "architectures"}, the target the engine loads.
    """
    check_eagle3(cfg)
    out = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
           "norm_before_residual": cfg.norm_before_residual, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
           "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **_llama_fields(cfg, dtype)},
           "speculators_config": {
               "algorithm": "eagle3", "default_proposal_method": "greedy",
               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                     "verifier_accept_k": 1, "accept_tolerance": 0.0}],
               "verifier": {"name_or_path": verifier["name_or_path"],
                            "architectures": list(verifier["architectures"])}},
           "torch_dtype": dtype}
    if cfg.aux_layer_ids:
        out["eagle_aux_hidden_state_layer_ids"] = vllm_layer_ids(cfg.aux_layer_ids)
    return out
