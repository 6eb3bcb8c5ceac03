"""Load an exported draft head back, refusing exports made for another target or tokenizer.

Serving code imports this module alone (it never touches training code): every
problem with the directory — a missing file, bytes that do not match the manifest's
sha256, a config that does not fit the weights, a tensor the name table does not know,
a NaN or infinite weight — is one ``LyannaError`` naming the file or the tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..atomic import read_json
from ..errors import LyannaError
from ..models.config import DraftConfig
from ..models.draft_head import DraftHead
from . import formats as F
from .integrity import check_digests, check_finite


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise LyannaError(f"missing {path.name} in {path.parent}")
    try:
        return load_file(str(path))
    except Exception as err:  # noqa: BLE001 - safetensors raises several types on bad bytes
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise LyannaError(f"{path} is not a readable safetensors file (truncated or corrupted?): {first}") from None


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple]:
    """Every tensor a DraftHead with this config has, with its shape (built on the meta device: no memory)."""
    with torch.device("meta"):
        head = DraftHead(cfg, torch.arange(cfg.draft_vocab_size),
                         torch.empty(cfg.vocab_size, cfg.target_hidden_size))
    return {name: tuple(t.shape) for name, t in head.state_dict().items()}


def check_state(state: dict, cfg: DraftConfig, config_file: Path, weights_file: Path) -> None:
    """The weights (DraftHead names) are exactly what ``cfg`` implies, shape for shape."""
    expected = expected_shapes(cfg)
    unknown = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state))
    if unknown:
        raise LyannaError(f"{weights_file}: tensors {unknown} do not belong to the draft {config_file.name} describes")
    if missing:
        raise LyannaError(f"{weights_file}: missing tensors {missing} that {config_file.name} implies")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise LyannaError(f"{config_file} does not match {weights_file.name}: {name} has shape "
                              f"{tuple(state[name].shape)}, the config implies {shape}")


def read_manifest(export_dir: str | Path) -> dict:
    export_dir = Path(export_dir)
    if not export_dir.is_dir():
        raise LyannaError(f"export directory not found: {export_dir}")
    path = export_dir / F.MANIFEST_FILE
    manifest = read_json(path)
    if manifest.get("kind") != F.KIND:
        raise LyannaError(f"{path} is not a Lyanna draft export (kind {manifest.get('kind')!r})")
    if manifest.get("version") != F.VERSION or manifest.get("format") not in F.FORMATS:
        raise LyannaError(f"{path}: unsupported version {manifest.get('version')!r} or format {manifest.get('format')!r}")
    return manifest


def config_from_export(fmt: str, config: dict, where: Path) -> DraftConfig:
    return F.config_from_lyanna(config, str(where)) if fmt == F.LYANNA else F.config_from_eagle3(config, str(where))


def check_fingerprints(manifest: dict, export_dir: Path, target_fp: str, tokenizer=None) -> None:
    """A mismatch means the draft was trained on another target's features (or ids): refused."""
    expected = (manifest.get("target") or {}).get("fingerprint")
    if expected != target_fp:
        raise LyannaError(f"{export_dir} was exported for another target: manifest fingerprint {expected}, "
                          f"this target's fingerprint {target_fp}")
    if tokenizer is not None:
        from ..target.fingerprint import tokenizer_fingerprint

        want, have = (manifest.get("tokenizer") or {}).get("fingerprint"), tokenizer_fingerprint(tokenizer)
        if want != have:
            raise LyannaError(f"{export_dir} was exported for another tokenizer: manifest fingerprint {want}, "
                              f"this tokenizer's fingerprint {have}")


def hot_vocab_path(manifest: dict, fmt: str) -> str:
    """The map's place as the manifest records it (exports before the eagle3 side directory: the root)."""
    recorded = (manifest.get("files") or {}).get("hot_vocab") or F.HOT_VOCAB_FILE
    if Path(recorded).is_absolute() or ".." in Path(recorded).parts:
        raise LyannaError(f"manifest.json: the hot-vocabulary path {recorded!r} leaves the export directory")
    return recorded


def load_exported(export_dir: str | Path, target, tokenizer=None, *,
                  target_fingerprint: str | None = None) -> tuple[DraftHead, dict]:
    """(DraftHead in eval mode on the target's device, manifest) from an export directory.

    ``target`` is the target ``*ForCausalLM`` (its input embeddings feed the draft);
    ``target_fingerprint`` skips recomputing it when the caller already has it.
    An ``eagle3`` export loads with the pool and α-gate off.
    """
    from ..hotvocab.artifact import load_hot_vocab
    from ..target.model import target_fingerprint as fingerprint_of

    export_dir = Path(export_dir)
    manifest = read_manifest(export_dir)
    check_digests(manifest, export_dir, export_dir / F.MANIFEST_FILE)  # before any byte is trusted
    check_fingerprints(manifest, export_dir, target_fingerprint or fingerprint_of(target), tokenizer)
    fmt = manifest["format"]
    config_file, weights_file = export_dir / F.CONFIG_FILE, export_dir / F.WEIGHTS_FILE
    cfg = config_from_export(fmt, read_json(config_file), config_file)
    tensors = read_tensors(weights_file)
    stored_embed = tensors.pop(F.EMBED_TOKENS, None) if fmt == F.EAGLE3 else None  # --with-embeddings
    state = F.rename(tensors, F.inverse(F.NAMES[fmt]), str(weights_file))
    check_state(state, cfg, config_file, weights_file)
    check_finite(state, weights_file)
    hot_file = export_dir / hot_vocab_path(manifest, fmt)
    if not hot_file.is_file():
        raise LyannaError(f"missing {hot_file.relative_to(export_dir)} in {export_dir}")
    hot = load_hot_vocab(hot_file, expect_fingerprint=(manifest.get("tokenizer") or {}).get("fingerprint"))
    if not torch.equal(hot.d2t, state["d2t"]) or not torch.equal(hot.t2d, state["t2d"]):
        raise LyannaError(f"{hot_file} does not match d2t/t2d in {weights_file.name}")
    embeddings = target.get_input_embeddings().weight
    if stored_embed is not None and stored_embed.shape != embeddings.shape:
        raise LyannaError(f"{weights_file}: {F.EMBED_TOKENS} is {tuple(stored_embed.shape)}, the target's "
                          f"embeddings {tuple(embeddings.shape)}")
    if tuple(embeddings.shape) != (cfg.vocab_size, cfg.target_hidden_size):
        raise LyannaError(f"{config_file}: the target's embeddings are {tuple(embeddings.shape)}, the draft expects "
                          f"({cfg.vocab_size}, {cfg.target_hidden_size})")
    draft = DraftHead(cfg, hot.hot_ids, embeddings)
    draft.to(device=embeddings.device, dtype=state["fc.weight"].dtype)
    draft.load_state_dict(state, strict=True)
    draft.measured_acceptance = measured_acceptance(manifest)
    return draft.eval(), manifest


def measured_acceptance(manifest: dict) -> tuple[float, ...]:
    """The head's held-out top-1 agreement per unroll step from its training run (what the
    runtime expects of a row before the row has drafted); () when the run did not measure it."""
    metrics = manifest.get("metrics") or {}
    out = []
    while isinstance(metrics.get(f"eval/heldout_top1_step{len(out)}"), (int, float)):
        out.append(float(metrics[f"eval/heldout_top1_step{len(out)}"]))
    return tuple(out)
