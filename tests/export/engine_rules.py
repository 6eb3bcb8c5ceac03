"""How SGLang and vLLM find and route an EAGLE-3 draft's weights, reproduced for tests.

Neither engine installs here (CUDA), so their loading rules are restated from their source;
bench/engine_load_check.py runs the real engines when a GPU is at hand.

* File discovery, both engines: ``DefaultModelLoader._prepare_weights`` (vLLM:
  vllm/model_executor/model_loader/default_loader.py; SGLang:
  python/sglang/srt/model_loader/loader.py) globs ``*.safetensors`` in the model folder
  (not its subfolders) and, when ``model.safetensors.index.json`` exists, keeps only the
  files its ``weight_map`` names (``filter_duplicate_safetensors_files`` in each
  engine's model_loader/weight_utils.py). Every tensor of every kept file is routed.
* vLLM routing: ``Eagle3LlamaForCausalLM.load_weights`` then ``LlamaModel.load_weights``
  (vllm/model_executor/models/llama_eagle3.py): ``t2d`` skipped, ``d2t`` ->
  ``draft_id_to_target_id``, other names but ``lm_head`` get ``model.``; ``midlayer.`` ->
  ``layers.0.``; q/k/v -> ``qkv_proj`` and gate/up -> ``gate_up_proj`` shards; an unknown
  name is a KeyError (``params_dict[name]``) or AutoWeightsLoader's ValueError.
* SGLang routing: ``LlamaForCausalLMEagle3.load_weights``
  (python/sglang/srt/models/llama_eagle3.py): ``d2t`` -> ``hot_token_id = d2t + arange``,
  ``t2d`` skipped, the same stacked shards, a name tried as is then with ``model.``; an
  unknown name is skipped silently (so a misnamed tensor leaves a random parameter).
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

from safetensors import safe_open

_STACKED = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
            (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))


def discover(folder: Path) -> dict:
    """{name: shape} of every tensor the engines read from ``folder``."""
    files = glob.glob(os.path.join(folder, "*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        named = {os.path.join(folder, f) for f in json.loads(index.read_text())["weight_map"].values()}
        files = [f for f in files if f in named]
    shapes = {}
    for file in sorted(files):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _params(config: dict, layer: str) -> dict:
    """The draft's parameters in the engine (``layer``: ``layers.0`` in vLLM, ``midlayer`` in SGLang),
    with their full shapes; stacked ones list the shard shapes they take."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    kv, d, inter = config["num_key_value_heads"], config.get("head_dim") or h // heads, config["intermediate_size"]
    target_h = config.get("target_hidden_size") or h
    p = f"model.{layer}"
    return {
        "model.fc.weight": (h, 3 * target_h), "model.norm.weight": (h,),
        "lm_head.weight": (config.get("draft_vocab_size") or config["vocab_size"], h),
        f"{p}.input_layernorm.weight": (h,), f"{p}.hidden_norm.weight": (h,),
        f"{p}.post_attention_layernorm.weight": (h,), f"{p}.self_attn.o_proj.weight": (h, heads * d),
        f"{p}.mlp.down_proj.weight": (h, inter),
        f"{p}.self_attn.qkv_proj.weight": {"q": (heads * d, 2 * h), "k": (kv * d, 2 * h), "v": (kv * d, 2 * h)},
        f"{p}.mlp.gate_up_proj.weight": {0: (inter, h), 1: (inter, h)},
    }


def _load(params: dict, loaded: dict, name: str, shape: tuple, shard=None) -> None:
    want = params[name] if shard is None else params[name][shard]
    if tuple(shape) != tuple(want):
        raise ValueError(f"{name}{'' if shard is None else f'[{shard}]'}: shape {shape}, the engine expects {want}")
    loaded.setdefault(name, set()).add(shard)


def _stacked(name: str):
    for param, weight, shard in _STACKED:
        if weight in name:
            return name.replace(weight, param), shard
    return name, None


def vllm_route(config: dict, tensors: dict) -> dict:
    """{parameter: shards loaded}, as vLLM's Eagle3LlamaForCausalLM loads them; raises like it does."""
    params = {**_params(config, "layers.0"), "draft_id_to_target_id": (config.get("draft_vocab_size"),),
              "model.embed_tokens.weight": (config["vocab_size"], config["hidden_size"])}
    loaded: dict = {}
    for name, shape in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        name, shard = _stacked(name)
        if name not in params:
            raise KeyError(f"vLLM: no parameter {name!r} in Eagle3LlamaForCausalLM")
        _load(params, loaded, name, shape, shard)
    return loaded


def sglang_route(config: dict, tensors: dict) -> tuple[dict, list]:
    """({parameter: shards loaded}, names skipped silently), as SGLang's LlamaForCausalLMEagle3 loads them."""
    params = {**_params(config, "midlayer"),
              "model.embed_tokens.weight": (config["vocab_size"], config["hidden_size"])}
    loaded: dict = {}
    skipped = []
    for name, shape in tensors.items():
        if "d2t" in name:
            loaded["hot_token_id"] = {None}
            continue
        if "t2d" in name:
            continue
        routed, shard = _stacked(name)
        routed = routed if routed in params else f"model.{routed}"
        if routed not in params:
            skipped.append(name)
            continue
        _load(params, loaded, routed, shape, shard)
    return loaded, skipped


def required(config: dict, layer: str) -> dict:
    """{parameter: shards} a complete load must fill (the embeddings come from the target)."""
    return {name: set(shape) if isinstance(shape, dict) else {None}
            for name, shape in _params(config, layer).items()}
