"""What an eagle3 export tells the engines that serve it: SGLang, vLLM and speculators.

* The verifier (the target the engines run) is recorded as something they can open: a
  local directory (absolute) or a model id, with its ``architectures``; never the alias
  a run was started with (``smollm2``).
* The ``speculators/`` directory holds its own weight file with the names speculators'
  ``Eagle3DraftModel`` reads (``layers.0.*``; no ``d2t``/``t2d`` for a full-vocabulary
  head, whose LM head rows are then put in token order), beside its config.json. Like
  the checkpoints speculators writes itself, it carries the verifier's
  ``embed_tokens.weight``: speculators 0.9.0 lists it as optional, but its
  ``from_pretrained`` then leaves the embeddings uninitialised (its NaN sentinel does not
  survive transformers' meta-device loading) and never fetches the verifier's.
* The manifest carries the exact commands: SGLang, vLLM (both folders), and speculators'
  converter, which ignores the layer ids in config.json unless they are passed to it (and
  needs the embeddings in the folder, ``--with-embeddings``, for the same reason as above).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch

from ..errors import LyannaError
from . import formats as F


def _architectures(name: str) -> list[str]:
    """From a local directory's config.json, or a model id's config in the local Hugging Face cache."""
    path = Path(name)
    if path.is_dir():
        try:
            return list(json.loads((path / F.CONFIG_FILE).read_text(encoding="utf-8")).get("architectures") or [])
        except (OSError, json.JSONDecodeError):
            return []
    try:
        from transformers import AutoConfig

        return list(AutoConfig.from_pretrained(name, local_files_only=True).architectures or [])
    except Exception:  # noqa: BLE001 - not cached, not a model: unknown
        return []


def _complete_converted_copy(ref, model_path: Path) -> None:
    """A GGUF target's converted copy (our cache) holds the weights alone; engines serving it
    as the verifier also read its tokenizer there, so it is saved beside them once."""
    if any((model_path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return
    from ..target.source import load_tokenizer

    load_tokenizer(ref).save_pretrained(model_path)


def resolve_verifier(target_name: str | None, verifier: str | None = None, target=None) -> dict:
    """{"name_or_path", "architectures"} of the model the engines verify with.

    ``verifier`` (a directory or model id) wins; otherwise the run's target, resolved to the
    directory its weights are read from (an embedded or GGUF target: the converted copy).
    """
    from ..target.source import resolve_target
    from ..target.model import model_dir

    name = verifier
    if name is None:
        if not target_name:
            raise LyannaError("the checkpoint does not name its target: pass --verifier PATH_OR_MODEL_ID")
        try:
            ref = resolve_target(target_name)
            name = model_dir(ref)
            if ref.gguf_file is not None:
                _complete_converted_copy(ref, Path(name))
        except LyannaError as err:
            raise LyannaError(f"cannot locate the verifier for target {target_name} ({err}): "
                              "pass --verifier PATH_OR_MODEL_ID") from None
    path = Path(name).expanduser()
    name = str(path.resolve()) if path.is_dir() else name
    architectures = _architectures(name) or list(getattr(getattr(target, "config", None), "architectures", None) or [])
    if not architectures:
        raise LyannaError(f"cannot read the architectures of verifier {name} (no config.json there or in the "
                          "local Hugging Face cache): pass a local directory with --verifier")
    return {"name_or_path": name, "architectures": architectures}


def speculators_tensors(tensors: dict, cfg) -> dict:
    """The eagle3 export's tensors as speculators' Eagle3DraftModel names them."""
    out = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
           for k, v in tensors.items()}
    if cfg.draft_vocab_size == cfg.vocab_size:  # it keeps no map for a full-vocabulary head
        hot = out.pop("d2t") + torch.arange(cfg.vocab_size)
        out.pop("t2d")
        out["lm_head.weight"] = out["lm_head.weight"][torch.argsort(hot)].contiguous()
    return out


def _weights_dir(name: str) -> Path | None:
    path = Path(name)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the local cache
        return None


def verifier_embeddings(name: str) -> torch.Tensor | None:
    """The verifier's input embeddings, read alone from its safetensors (single file or shards)."""
    from safetensors import safe_open

    root = _weights_dir(name)
    if root is None:
        return None
    index = root / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())) if index.is_file()
             else [p.name for p in sorted(root.glob("*.safetensors"))])
    for file in files:
        with safe_open(str(root / file), framework="pt") as f:
            keys = [k for k in f.keys() if k.endswith("embed_tokens.weight")]  # noqa: SIM118
            if keys:
                return f.get_tensor(min(keys, key=len))
    return None


def write_speculators(root: Path, cfg, tensors: dict, verifier: dict, tokens: int, dtype: str,
                      embeddings: torch.Tensor) -> None:
    """``root/speculators``: a directory ``vllm serve`` and speculators' from_pretrained load as is."""
    from safetensors.torch import save_file

    sub = root / F.SPECULATORS_DIR
    sub.mkdir()
    config = F.speculators_config(cfg, verifier, tokens, dtype)
    (sub / F.CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file({**speculators_tensors(tensors, cfg), F.EMBED_TOKENS: embeddings}, str(sub / F.WEIGHTS_FILE),
              metadata={"format": "pt"})


def speculators_embeddings(verifier: dict, cfg, target=None) -> torch.Tensor:
    """The embeddings the speculators directory carries: the verifier's, else the given target's."""
    emb = verifier_embeddings(verifier["name_or_path"])
    if emb is None and target is not None:
        emb = target.get_input_embeddings().weight
    if emb is None:
        raise LyannaError(f"cannot read embed_tokens from verifier {verifier['name_or_path']} (speculators/ carries "
                          "them): pass a local directory with --verifier")
    if tuple(emb.shape) != (cfg.vocab_size, cfg.target_hidden_size):
        raise LyannaError(f"verifier {verifier['name_or_path']} has embeddings {tuple(emb.shape)}, the draft was "
                          f"trained on a target with ({cfg.vocab_size}, {cfg.target_hidden_size})")
    return emb


def serving_commands(out_dir: Path, cfg, verifier: str, tokens: int, speculators: bool, embeddings: bool) -> dict:
    """The commands that serve this export (paths as written; adjust them if the directory moves)."""
    d, v = shlex.quote(str(Path(out_dir).resolve())), shlex.quote(verifier)
    vllm_config = json.dumps({"method": "eagle3", "model": str(Path(out_dir).resolve()),
                              "num_speculative_tokens": tokens})
    # its converter reads neither from config.json: without them it uses its defaults
    converter = {"eagle_aux_hidden_state_layer_ids": F.vllm_layer_ids(cfg.aux_layer_ids),
                 **({"norm_before_residual": True} if cfg.norm_before_residual else {})}
    out = {
        "sglang": f"python -m sglang.launch_server --model-path {v} --speculative-algorithm EAGLE3 "
                  f"--speculative-draft-model-path {d} --speculative-num-steps {tokens} --speculative-eagle-topk 1 "
                  f"--speculative-num-draft-tokens {tokens + 1}",
        "vllm": f"vllm serve {v} --speculative-config {shlex.quote(vllm_config)}",
    }
    if embeddings:
        out["speculators_convert"] = (f"speculators convert {d} --algorithm eagle3 --verifier {v} --algorithm-kwargs "
                                      f"{shlex.quote(json.dumps(converter))} --output-path {d}-speculators")
    if speculators:
        out["vllm_speculators"] = f"vllm serve {shlex.quote(str(Path(out_dir).resolve() / F.SPECULATORS_DIR))}"
    if cfg.norm_before_residual:  # SGLang's layer always adds the un-normed state: it would serve another draft
        out["sglang"] = None
        out["notes"] = ["norm_before_residual: SGLang's LlamaForCausalLMEagle3 does not read it (its residual is "
                        "the un-normed state), so it would serve a different draft; serve this head with vLLM"]
    return out
