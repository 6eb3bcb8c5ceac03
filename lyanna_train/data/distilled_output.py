"""Regeneration's one pass: the regenerated conversations and their feature cache, written together.

Self-distilled training used to cost two target passes per token: one to regenerate the
answers, one (the feature cache's build) to run the target over them again. The decoder
already computes every feature the cache holds (:mod:`..runtime.verification.recording`),
so :class:`DistilledOutput` writes them as regeneration goes: each finished conversation
becomes a ShareGPT line and a training sample, built by the trainer's own
:class:`.samples.SampleBuilder` from that line, and the samples are grouped into shards by
the cache's own rule (:func:`.feature_cache_writer.shard_samples`: a shard closes at
``shard_tokens`` tokens; samples without loss tokens are left out). The cache is therefore,
shard for shard, the one ``build_feature_cache`` makes from the JSONL file:
``lyanna-train data.corpus=[OUT.jsonl] data.cache_dir=CACHE`` finds every shard complete and
computes nothing. A sample whose recorded tokens differ from its tokenization (an answer
that re-tokenizes otherwise once decoded to text) gets a teacher-forced forward instead,
counted in ``recomputed``.

Resumable after kill -9: a shard's conversations are appended to the JSONL file, then the
shard file and its entry are written, then the manifest (which counts the lines its shards
cover); on resume the JSONL file is cut back to those lines and shards past the manifest are
deleted, so what was regenerated after the last complete shard is regenerated again and
nothing is written twice.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..atomic import write_json_atomic
from ..errors import LyannaError
from .conversations import to_document
from .feature_cache import SHARDS, read_manifest, shard_problem
from .feature_cache_writer import (CacheSettings, ShardSamples, cache_manifest, prepare_cache_dir,
                                   remove_stale_temporaries, write_shard)
from .features import FeatureExtractor
from .samples import SampleBuilder, SampleSettings, SampleStats
from .self_distill import append_jsonl
from .shard_features import ShardFeatures


class DistilledOutput:
    """Appends regenerated conversations to ``jsonl`` and their features to the cache ``root``.

    ``model``/``tokenizer``: the target the decoder runs; ``layer_ids``: the capture layers it
    records (the cache's ``aux``). ``settings``: the cache's (``max_length`` and
    ``shard_tokens`` must be the training run's, as for any cache)."""

    def __init__(self, jsonl: Path, root: Path, model, tokenizer, layer_ids, settings: CacheSettings = CacheSettings(),
                 source: dict | None = None):
        self.jsonl, self.root, self.settings = Path(jsonl), Path(root), settings
        self.model, self.tokenizer, self.source = model, tokenizer, source or {}
        self.extractor = FeatureExtractor(model, layer_ids)
        self.builder = SampleBuilder(tokenizer, SampleSettings(max_length=settings.max_length))
        self.stats = SampleStats()
        old = read_manifest(self.root) if self.root.is_dir() else None
        if old is None and self.jsonl.exists() and self.jsonl.stat().st_size:
            raise LyannaError(f"{self.jsonl} already holds conversations but {self.root} holds no features of "
                              "them: give another --out, or the --features directory they were written with")
        self.plan: list[dict] = []
        state = {"lines": 0, "next_position": 0, "skipped_no_loss_tokens": 0}
        if old is not None:
            self.plan = list(old["shards"])
            state.update(old.get("regeneration") or {})
            broken = [p["shard"] for p in self.plan if shard_problem(self.root, p, verify_checksum=False)]
            if broken:
                raise LyannaError(f"feature cache {self.root}: shard {broken[0]} is damaged; "
                                  "regenerate into another --features directory")
        self.lines, self.position, self.skipped = state["lines"], state["next_position"], state["skipped_no_loss_tokens"]
        manifest = self._manifest()
        prepare_cache_dir(self.root, manifest, overwrite=False)  # refuses a cache made otherwise
        self.shard_meta = {"target": manifest["target"]["fingerprint"], "layers": list(self.extractor.layer_ids)}
        remove_stale_temporaries(self.root, 0, 1)
        self._drop_unlisted_shards()
        cut_lines(self.jsonl, self.lines)
        self.records: list[dict] = []  # since the last shard: their lines, not yet on disk
        self.group: ShardSamples | None = None
        self.recorded: dict[int, object] = {}  # group row -> RecordedFeatures
        self.recomputed = 0  # samples filled by a teacher-forced forward

    @property
    def done(self) -> int:
        """Conversations on disk (with their features)."""
        return self.lines

    def add(self, record: dict, features=None) -> None:
        """One regenerated conversation (a ShareGPT record) and the features the decoder
        recorded for its last turn (:class:`~..runtime.verification.recording.RecordedFeatures`,
        or None: computed here)."""
        sample = self.builder.build(to_document(self.lines + len(self.records), record), self.stats)
        self.records.append(record)
        if sample is None:  # the trainer skips it too (and counts it)
            return
        self.position += 1
        if not bool(sample.loss_mask.any()):
            self.skipped += 1
            return
        if self.group is None:
            self.group = ShardSamples(shard=len(self.plan), first=self.position - 1)
        row = len(self.group.index)
        self.group.add(int(sample.index), sample.input_ids.to(torch.int32), sample.loss_mask.to(torch.bool))
        n = len(sample)
        if features is not None and list(features.ids[:n]) == sample.input_ids.tolist():
            self.recorded[row] = features
        if self.group.tokens >= self.settings.shard_tokens:
            self._write()

    def close(self) -> None:
        """Write what is left: the last (partial) shard, or the lines of samples without one."""
        if self.group is not None or self.records:
            self._write()

    def _write(self) -> None:
        """The pending conversations' lines, then their shard, then the manifest that counts both."""
        group, tensors = self.group, None
        if group is not None:
            tensors = self._features(group).tensors
        append_jsonl(self.jsonl, self.records)
        if group is not None:
            planned = group.plan()
            write_shard(self.root, planned, tensors, self.shard_meta)
            self.plan.append(planned)
        self.lines += len(self.records)
        self.records, self.group, self.recorded = [], None, {}
        write_json_atomic(self.root / "manifest.json", self._manifest())

    def _features(self, group: ShardSamples) -> ShardFeatures:
        features = ShardFeatures(group, self.extractor.aux_size, self.extractor.hidden_size,
                                 self.settings.feature_dtype, self.settings.teacher_summary)
        for row in range(len(group.index)):
            rec = self.recorded.get(row)
            if rec is not None:
                features.put(row, rec.aux, rec.last, rec.top1, rec.logsumexp)
            else:
                features.fill(self.extractor, [row])
                self.recomputed += 1
        return features

    def _manifest(self) -> dict:
        manifest = cache_manifest(self.model, self.tokenizer, self.extractor, self.settings, self.plan,
                                  range(self.skipped), self.source)
        manifest["regeneration"] = {"lines": self.lines, "next_position": self.position,
                                    "skipped_no_loss_tokens": self.skipped}
        return manifest

    def _drop_unlisted_shards(self) -> None:
        """Shards a killed run wrote after its manifest's last (their lines are cut too)."""
        listed = {p["shard"] for p in self.plan}
        for path in (self.root / SHARDS).glob("shard-*.*"):
            if int(path.name.split("-")[1].split(".")[0]) not in listed:
                path.unlink()


def cut_lines(path: Path, keep: int) -> None:
    """Keep the first ``keep`` lines of ``path`` (refused if it has fewer: another writer's file)."""
    if not path.exists():
        if keep:
            raise LyannaError(f"{path} is missing, but its feature cache counts {keep} conversations in it")
        return
    good, lines = 0, 0
    with open(path, "rb") as fh:
        for line in fh:
            if lines == keep:
                break
            if not line.endswith(b"\n"):
                break
            good += len(line)
            lines += 1
    if lines < keep:
        raise LyannaError(f"{path} has {lines} complete lines, but its feature cache counts {keep}: "
                          "the two were not written together")
    if good < path.stat().st_size:
        with open(path, "r+b") as fh:
            fh.truncate(good)
