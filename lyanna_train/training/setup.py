"""Everything a run needs before its first step: target, hot vocabulary, data, draft, prompts.

Work that writes shared files (the hot vocabulary, the feature cache) is done by the
main rank or split across ranks, with barriers, and is skipped when already complete,
so a resumed or repeated run starts in seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.corpus import Corpus
from ..data.samples import CorpusSamples, SampleSettings
from ..errors import LyannaError
from ..hotvocab.artifact import load_hot_vocab, read_manifest
from ..hotvocab.selection import size_for_ratio
from ..models.config import DraftConfig
from ..models.draft_head import DraftHead
from ..models.init import init_from_target
from ..target.fingerprint import tokenizer_fingerprint, vocab_size
from ..target.source import load_tokenizer
from ..target.model import load_target_model, target_fingerprint
from .deepspeed_engine import rank_device


@dataclass
class RunParts:
    tokenizer: object
    target: torch.nn.Module
    hot_ids: torch.Tensor
    draft: DraftHead
    lm_weight: torch.Tensor  # the target's output embedding [V, Ht]
    layer_ids: tuple
    eval_prompts: list  # token-id lists


def _barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def hot_vocabulary(cfg, tokenizer, out_dir: Path, is_main: bool) -> torch.Tensor:
    """The hot ids (by descending frequency), from cfg.hotvocab.path or built from the corpus."""
    vocab = vocab_size(tokenizer)
    if cfg.hotvocab.full_vocab:
        return torch.arange(vocab)
    size = cfg.hotvocab.size or size_for_ratio(cfg.hotvocab.ratio, vocab)
    if size > vocab:  # checked before anything is built: a bad size must not leave a hot vocabulary behind
        raise LyannaError(f"config: hotvocab.size = {size} is not allowed (allowed: 1 to the vocabulary size, {vocab})")
    fingerprint = tokenizer_fingerprint(tokenizer)
    path = Path(cfg.hotvocab.path) if cfg.hotvocab.path else out_dir / "hotvocab"
    if cfg.hotvocab.path is None and is_main and not (path / "manifest.json").exists():
        from ..hotvocab.build import build
        from ..hotvocab.counting import CountSettings
        from ..hotvocab.selection import SelectionRequest

        build(list(cfg.data.corpus), cfg.target.name, path, [SelectionRequest(size=size)], CountSettings(),
              overwrite=True, progress=True, tokenizer=tokenizer)
    _barrier()
    if path.is_dir():
        sizes = [s["size"] for s in read_manifest(path)["selections"]]
        if size not in sizes:
            raise LyannaError(f"hot vocabulary {path} has no selection of size {size} (available: {sizes}); "
                              "set hotvocab.size or hotvocab.ratio to one of them")
    hot = load_hot_vocab(path, size=size if path.is_dir() else None, expect_fingerprint=fingerprint)
    if cfg.hotvocab.size is not None and hot.size != cfg.hotvocab.size:
        raise LyannaError(f"config: hotvocab.size = {cfg.hotvocab.size}, but hotvocab.path {path} holds a hot "
                          f"vocabulary of {hot.size}: drop hotvocab.size or point hotvocab.path at that selection")
    return hot.hot_ids


@dataclass
class CacheSpec:
    """Where a run's feature cache lives and what goes in it (cached and hybrid modes alike)."""

    root: Path
    settings: object  # data.feature_cache_writer.CacheSettings
    samples: object  # re-iterable samples
    max_samples: int | None
    source: dict


def cache_spec(cfg, samples: CorpusSamples, out_dir: Path, max_samples: int | None,
               heldout_from: int | None = None) -> CacheSpec:
    """The run's cache over the first ``max_samples`` samples (or, with ``heldout_from``, the
    held-out one beside it); a cache already there with other features than
    ``data.feature_dtype`` is refused in one line."""
    from ..data.feature_cache import read_manifest
    from ..data.feature_cache_writer import CacheSettings
    from .heldout import StreamSlice

    root = Path(cfg.data.cache_dir) if cfg.data.cache_dir else out_dir / "features"
    source = {"corpus": list(cfg.data.corpus)}
    if heldout_from is not None:
        root = root.with_name(root.name + "-heldout")
        samples, max_samples = StreamSlice(samples, heldout_from, cfg.eval.heldout_samples), None
        source["heldout_from"] = heldout_from
    manifest = read_manifest(root) if root.is_dir() else None
    if manifest is not None and manifest.get("dtype") != cfg.data.feature_dtype:
        raise LyannaError(f"config: data.feature_dtype = {cfg.data.feature_dtype}, but the feature cache {root} holds "
                          f"{manifest.get('dtype')} features: set data.feature_dtype={manifest.get('dtype')}, "
                          "or data.cache_dir to another directory")
    settings = CacheSettings(max_length=cfg.data.max_length, shard_tokens=cfg.data.shard_tokens,
                             batch_tokens=cfg.data.batch_tokens, teacher_summary=cfg.data.teacher_summary,
                             feature_dtype=cfg.data.feature_dtype)
    return CacheSpec(root, settings, samples, max_samples, source)


def feature_cache(cfg, samples: CorpusSamples, target, tokenizer, layer_ids, out_dir: Path, rank: int, world: int,
                  max_samples: int | None, heldout_from: int | None = None):
    """The run's feature cache over the first ``max_samples`` samples (or, with ``heldout_from``,
    the held-out one beside it): each rank builds its shards, then everyone opens the whole."""
    from ..data.feature_cache import FeatureCache
    from ..data.feature_cache_writer import build_feature_cache

    spec = cache_spec(cfg, samples, out_dir, max_samples, heldout_from)
    build_feature_cache(spec.samples, target, tokenizer, spec.root, layer_ids=layer_ids, settings=spec.settings,
                        shard=(rank, world), max_samples=spec.max_samples, source=spec.source,
                        progress=rank == 0, say=print if rank == 0 else (lambda *_: None))
    _barrier()
    return FeatureCache(spec.root, target_fingerprint(target), tokenizer_fingerprint(tokenizer), layer_ids,
                        cfg.data.feature_dtype)


def eval_prompts(cfg, tokenizer) -> list[list[int]]:
    """First user turns of the evaluation set, rendered with the generation prompt."""
    from ..data.conversations import Document
    from ..data.corpus import ReadNotes, iter_documents

    prompts: list = []
    if cfg.eval.num_prompts <= 0:
        return prompts
    for doc in iter_documents(Corpus.resolve([cfg.eval.prompts]), ReadNotes()):
        if isinstance(doc, Document) and doc.is_conversation:
            first = [m for m in doc.messages if m["role"] == "user"][:1]
            prompts.append(tokenizer.apply_chat_template(first, tokenize=True, add_generation_prompt=True,
                                                         return_dict=False))
        if len(prompts) >= cfg.eval.num_prompts:
            break
    return prompts


def draft_overrides(draft_conf) -> dict:
    """The ``draft`` group's fields that are :class:`DraftConfig` fields (shapes and the
    Lyanna switches), by name, so the list of fields is the dataclass's own; any other
    field of the group is a training setting, not part of the head's config."""
    names = {f.name for f in dataclasses.fields(DraftConfig)}
    return {k: v for k, v in dict(draft_conf).items() if k in names}


def build_parts(cfg, out_dir: Path, is_main: bool) -> RunParts:
    from ..target.capture import check_layer_ids, default_layer_ids

    tokenizer = load_tokenizer(cfg.target.name)
    # on the device DeepSpeed trains the draft on: the features, the teacher's LM head and the
    # evaluation's decoding meet the draft there
    target = load_target_model(cfg.target.name, dtype=getattr(torch, cfg.target.dtype)).to(rank_device())
    if cfg.draft.init_from:  # fine-tune an exported or imported head
        return parts_from_export(cfg, tokenizer, target, out_dir, is_main)
    layers = target.config.num_hidden_layers
    layer_ids = check_layer_ids(cfg.target.aux_layers or default_layer_ids(layers), layers)
    hot_ids = hot_vocabulary(cfg, tokenizer, out_dir, is_main)
    draft_cfg = DraftConfig.from_target(target.config, len(hot_ids), **draft_overrides(cfg.draft),
                                        other_bucket=cfg.loss.out_of_vocab == "other", num_aux_layers=len(layer_ids),
                                        aux_layer_ids=tuple(layer_ids))
    torch.manual_seed(cfg.train.seed)
    draft = DraftHead(draft_cfg, hot_ids, target.get_input_embeddings().weight)
    init = cfg.draft.target_init
    init_from_target(draft, target, lm_head=init.lm_head, layer=init.layer, fc=init.fc)
    if cfg.draft.freeze_lm_head:
        draft.lm_head.weight.requires_grad_(False)
    draft.to(target.device)  # built (and seeded) on the host, as on a CPU run
    lm_weight = target.get_output_embeddings().weight.detach()
    return RunParts(tokenizer, target, hot_ids, draft, lm_weight, layer_ids, eval_prompts(cfg, tokenizer))


def parts_from_export(cfg, tokenizer, target, out_dir: Path, is_main: bool) -> RunParts:
    from .init_from import draft_from_export

    draft, hot_ids, layer_ids = draft_from_export(
        cfg, target, tokenizer, lambda: hot_vocabulary(cfg, tokenizer, out_dir, is_main),
        say=print if is_main else (lambda *_: None))
    if cfg.draft.freeze_lm_head:
        draft.lm_head.weight.requires_grad_(False)
    draft.to(target.device)
    lm_weight = target.get_output_embeddings().weight.detach()
    return RunParts(tokenizer, target, hot_ids, draft, lm_weight, layer_ids, eval_prompts(cfg, tokenizer))


def training_samples(cfg, tokenizer) -> CorpusSamples:
    """The corpus as samples (re-iterable; a run builds it once and cuts it to its sample count)."""
    corpus = Corpus.resolve(list(cfg.data.corpus))
    return CorpusSamples(corpus, tokenizer, SampleSettings(max_length=cfg.data.max_length))
