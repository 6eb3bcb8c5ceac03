"""Build the feature cache: plan shards, run the target over them, write them resumably.

Which samples form shard k is a pure function of the sample stream and
``shard_tokens`` (a shard closes once it holds that many tokens), so ``--shard I/N``
processes (shard k belongs to process k % N) agree on the plan without talking, and
an interrupted build resumes to the same bytes: a shard file and its index entry are
renamed into place only once complete, and on resume a shard whose entry, size or
checksum does not match is reported and computed again.

The samples are read twice: a planning pass (token ids only, cheap next to the target)
that fixes the shards and the disk estimate, then the pass that runs the target.
Within a shard samples are batched by length to limit padding, and a background
thread writes each finished shard while the next one is computed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import torch

from ..atomic import write_json_atomic
from ..errors import LyannaError
from ..locks import output_lock
from ..target.capture import LAYER_CONVENTION
from ..target.fingerprint import tokenizer_fingerprint
from ..target.model import target_fingerprint
from .batching import length_grouped_batches
from .feature_cache import (
    FORMAT, SHARDS, VERSION, bytes_per_token, entry_path, read_manifest, shard_path, shard_problem,
)
from .feature_dtype import DEFAULT, scale_description, storage_dtype
from .features import FeatureExtractor
from .samples import MAX_LENGTH, Sample
from .shard_features import ShardFeatures

# What must match for a resumed build (or another --shard process) to add to a cache.
_FIXED = ("format", "version", "target", "tokenizer", "chat_template_sha256", "layers", "max_length",
          "shard_tokens", "dtype")

@dataclass(frozen=True)
class CacheSettings:
    max_length: int = MAX_LENGTH  # what the samples were cut to (SampleSettings): recorded, checked
    shard_tokens: int = 32768  # a shard closes at this many tokens (~150 MB for a 576-wide target)
    batch_tokens: int = 4096  # padded tokens per target forward
    # also store the teacher's full-vocabulary top-1 and logsumexp per token: one more LM-head
    # pass here (~25 % of a 135M model's forward) that every training epoch then skips
    teacher_summary: bool = True
    feature_dtype: str = DEFAULT  # how aux and last are stored: bfloat16, or float8_e4m3fn (half the bytes)

    def __post_init__(self):
        for name in ("max_length", "shard_tokens", "batch_tokens"):
            if getattr(self, name) < 1:
                raise LyannaError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(self, name)}")
        storage_dtype(self.feature_dtype)

@dataclass
class ShardSamples:
    """The samples of one shard, in stream order."""

    shard: int
    first: int  # stream position of the first sample
    tokens: int = 0
    index: list[int] = field(default_factory=list)  # Sample.index of each
    input_ids: list[torch.Tensor] = field(default_factory=list)  # int32 [T_i]
    loss_mask: list[torch.Tensor] = field(default_factory=list)  # bool [T_i]

    def add(self, index: int, ids: torch.Tensor, mask: torch.Tensor) -> None:
        self.index.append(index)
        self.input_ids.append(ids)
        self.loss_mask.append(mask)
        self.tokens += len(ids)

    def plan(self) -> dict:
        """What the shard holds, with a digest of its inputs to detect a changed sample stream."""
        h = hashlib.sha256()
        for i, ids, mask in zip(self.index, self.input_ids, self.loss_mask):
            h.update(f"{i}:{len(ids)}\0".encode())
            h.update(ids.numpy().tobytes())
            h.update(mask.numpy().tobytes())
        return {"shard": self.shard, "first": self.first, "samples": len(self.index), "tokens": self.tokens,
                "loss_tokens": sum(int(m.sum()) for m in self.loss_mask), "inputs_sha256": h.hexdigest()}

def shard_samples(samples: Iterable, settings: CacheSettings, max_samples: int | None = None,
                  skipped: list | None = None) -> Iterator[ShardSamples]:
    """Group the first ``max_samples`` samples into shards of about ``shard_tokens`` tokens.

    Samples without loss tokens (nothing to learn) are dropped; their ``index`` goes to ``skipped``.
    """
    current, shard = None, 0
    for pos, sample in enumerate(itertools.islice(samples, max_samples)):
        ids = torch.as_tensor(sample.input_ids).to(torch.int32)
        mask = torch.as_tensor(sample.loss_mask).to(torch.bool)
        if ids.dim() != 1 or ids.shape != mask.shape:
            raise LyannaError(f"sample {sample.index}: input_ids {tuple(ids.shape)} and loss_mask "
                              f"{tuple(mask.shape)} must be 1-D and of equal length")
        if len(ids) > settings.max_length:  # samples are cut once, when they are built
            raise LyannaError(f"sample {sample.index} has {len(ids)} tokens, more than max_length "
                              f"{settings.max_length}: build the samples with SampleSettings(max_length=...)")
        if not bool(mask.any()):
            if skipped is not None:
                skipped.append(int(sample.index))
            continue
        if current is None:
            current = ShardSamples(shard=shard, first=pos)
        current.add(int(sample.index), ids, mask)
        if current.tokens >= settings.shard_tokens:
            yield current
            current, shard = None, shard + 1
    if current is not None:
        yield current

def shard_batches(group: ShardSamples, batch_tokens: int) -> Iterator[list[Sample]]:
    """The forward passes of one shard: length-grouped, within ``batch_tokens`` padded tokens.

    ``Sample.index`` here is the position in the shard. The grouping is seeded, so the
    batches (and the floating-point result of each) are the same every time the shard is built.
    """
    items = [Sample(j, ids, mask) for j, (ids, mask) in enumerate(zip(group.input_ids, group.loss_mask))]
    return length_grouped_batches(items, batch_tokens, seed=group.shard, buffer_size=len(items))

def write_shard(root: Path, planned: dict, tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """Write one shard file, then its index entry; each appears only once complete (a file
    without its entry is a partial shard, never read)."""
    from safetensors.torch import save

    data = save(tensors, metadata={"lyanna": json.dumps({**meta, **planned}, sort_keys=True)})
    path = shard_path(root, planned["shard"])
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    entry = {**planned, "file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    write_json_atomic(entry_path(root, planned["shard"]), entry)
    return entry

class _BackgroundWriter:
    """Writes finished shards on a thread so the disk overlaps the next shard's forward passes.

    At most ``pending`` shards wait in the queue, which bounds memory to ~``pending + 2``
    shards. A write error is re-raised in the caller at the next ``submit`` or at ``close``.
    """

    def __init__(self, root: Path, meta: dict, on_written, pending: int = 1):
        self.root, self.meta, self.on_written = root, meta, on_written
        self.queue: queue.Queue = queue.Queue(maxsize=pending)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="feature-cache-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is None:  # after a failure keep draining so submit() never blocks
                try:
                    self.on_written(write_shard(self.root, *item, self.meta))
                except BaseException as err:  # noqa: BLE001 - handed to the main thread
                    self.error = err

    def _check(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            raise LyannaError(f"cannot write a shard to {self.root}: {err}") from None

    def submit(self, planned: dict, tensors: dict) -> None:
        self._check()
        self.queue.put((planned, tensors))

    def close(self, quiet: bool = False) -> None:
        """Wait for queued shards to be written (also on interrupt: they are complete)."""
        self.queue.put(None)
        self.thread.join()
        if not quiet:
            self._check()

def compute_shard(extractor, group: ShardSamples, batch_tokens: int, teacher_summary: bool = True,
                  on_tokens=None, feature_dtype: str = DEFAULT) -> dict[str, torch.Tensor]:
    """Run the target over one shard and pack its features: aux [N, k*H], last [N, H] in
    ``feature_dtype`` and (``teacher_summary``) the full-vocabulary top-1 int32 and logsumexp
    fp32 (see :func:`~.features.teacher_summary`)."""
    features = ShardFeatures(group, extractor.aux_size, extractor.hidden_size, feature_dtype, teacher_summary)
    for batch in shard_batches(group, batch_tokens):
        tokens = features.fill(extractor, [sample.index for sample in batch])
        if on_tokens is not None:
            on_tokens(tokens)
    return features.tensors

@dataclass
class BuildResult:
    out: Path
    shards_total: int  # in the whole cache
    shards_mine: int  # belonging to this --shard I/N process
    shards_reused: int  # already complete and valid
    shards_written: int
    tokens_computed: int
    seconds: float  # from the first forward pass to the last shard on disk
    bytes_written: int
    bytes_estimate: int
    complete: bool  # every shard of the cache is on disk (all processes done)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_computed / max(self.seconds, 1e-9)

def cache_manifest(model, tokenizer, extractor, settings, plan, skipped, source) -> dict:
    config = model.config
    return {
        "format": FORMAT,
        "version": VERSION,
        "target": {"fingerprint": target_fingerprint(model), "architectures": list(config.architectures or []),
                   "hidden_size": extractor.hidden_size, "num_layers": len(extractor.layers)},
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "chat_template_sha256": hashlib.sha256((getattr(tokenizer, "chat_template", None) or "").encode()).hexdigest(),
        "layers": {"ids": list(extractor.layer_ids), "convention": LAYER_CONVENTION},
        "last": "final hidden state after the final norm (HF hidden_states[-1]): lm_head(last) == logits",
        "max_length": settings.max_length,
        "shard_tokens": settings.shard_tokens,
        "dtype": settings.feature_dtype,
        **({"scale": scale_description(settings.feature_dtype)} if scale_description(settings.feature_dtype) else {}),
        "aux_size": extractor.aux_size,
        "bytes_per_token": bytes_per_token(extractor.aux_size, extractor.hidden_size, settings.feature_dtype),
        "totals": {"samples": sum(p["samples"] for p in plan), "tokens": sum(p["tokens"] for p in plan),
                   "loss_tokens": sum(p["loss_tokens"] for p in plan), "shards": len(plan),
                   "skipped_no_loss_tokens": len(skipped)},
        "source": source or {},
        "last_build": {"batch_tokens": settings.batch_tokens, "target_dtype": str(model.dtype).removeprefix("torch.")},
        "shards": plan,
    }

def prepare_cache_dir(out: Path, manifest: dict, overwrite: bool) -> None:
    """Refuse to add to a cache made with other settings; then (re)write the manifest."""
    if out.exists() and not out.is_dir():
        raise LyannaError(f"output path {out} exists and is not a directory")
    old = read_manifest(out) if out.is_dir() else None
    if overwrite and out.exists():
        shutil.rmtree(out)
    elif old is not None:
        changed = [k for k in _FIXED if old.get(k) != manifest.get(k)]
        if changed:
            raise LyannaError(f"{out} holds a feature cache made with other {', '.join(changed)}; "
                              "use another --out or pass --overwrite")
    elif out.is_dir() and any(p.name != SHARDS and not p.name.startswith(".manifest.json") for p in out.iterdir()):
        # (another --shard process starting at the same time may have made only these so far)
        raise LyannaError(f"output directory {out} exists and is not a feature cache (pass --overwrite to replace it)")
    (out / SHARDS).mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "manifest.json", manifest)

def remove_stale_temporaries(out: Path, part: int, parts: int) -> None:
    """Delete half-written files a killed run of this process left (other processes own theirs)."""
    for tmp in (out / SHARDS).glob(".shard-*.tmp-*"):
        if int(tmp.name.split("-")[1].split(".")[0]) % parts == part:
            tmp.unlink(missing_ok=True)

def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"

def _shards_to_compute(out: Path, mine: list[dict], say) -> dict[int, dict]:
    """This process's planned shards that are not complete and valid on disk (problems reported)."""
    todo = {}
    for planned in mine:
        problem = shard_problem(out, planned)
        if problem is not None:
            if problem != "missing":
                say(f"shard {planned['shard']}: {problem}; computing it again")
            todo[planned["shard"]] = planned
    return todo

def _compute(samples, settings: CacheSettings, max_samples, extractor, todo: dict, writer, on_tokens) -> None:
    for group in shard_samples(samples, settings, max_samples):
        planned = todo.get(group.shard)
        if planned is None:
            continue
        if group.plan() != planned:
            raise LyannaError("the samples changed between the planning and the computing pass "
                              "(the sample stream must be deterministic)")
        writer.submit(planned, compute_shard(extractor, group, settings.batch_tokens, settings.teacher_summary,
                                             on_tokens, settings.feature_dtype))

def _summary(result: BuildResult, part: int, parts: int) -> str:
    state = "complete" if result.complete else "incomplete (other --shard processes still to run)"
    if not result.shards_written:
        return f"nothing to compute: the {result.shards_mine} shards of process {part}/{parts} were done; cache {state}"
    return (f"wrote {result.shards_written} shards: {result.tokens_computed:,} tokens, {_gb(result.bytes_written)} "
            f"({result.bytes_written / result.tokens_computed:,.0f} bytes/token) in {result.seconds:.1f} s "
            f"({result.tokens_per_second:,.0f} tokens/s); cache {state}")

def build_feature_cache(samples: Iterable, model, tokenizer, out: str | Path, *, layer_ids=None,
                        settings: CacheSettings = CacheSettings(), shard: tuple[int, int] = (0, 1),
                        max_samples: int | None = None, source: dict | None = None, overwrite: bool = False,
                        progress: bool = True, say=print) -> BuildResult:
    """Write (or resume) this process's shards of the feature cache ``out``.

    ``samples`` is read twice (planning, then computing), so it must be re-iterable
    (a list, or an object whose ``__iter__`` starts over) and yield the same samples
    each time: objects with ``index``, ``input_ids`` [T] and ``loss_mask`` [T]. One
    process at a time writes each ``--shard I/N`` of ``out`` (others stop at once).
    """
    part, parts = shard
    if not (parts >= 1 and 0 <= part < parts):
        raise LyannaError(f"--shard must be I/N with 0 <= I < N, not {part}/{parts}")
    if iter(samples) is samples:
        raise TypeError("samples must be re-iterable (they are read twice), not a one-shot iterator")
    with output_lock(out, tag=f".shard-{part}of{parts}"):
        return _build(samples, model, tokenizer, Path(out), layer_ids, settings, shard, max_samples, source,
                      overwrite, progress, say)

@dataclass
class OpenedCache:
    """A cache directory whose manifest is written (or checked): what is planned to go in it."""

    out: Path
    manifest: dict
    extractor: FeatureExtractor
    groups: list | None  # the planned ShardSamples (with their token ids), when asked to keep them

    @property
    def plan(self) -> list[dict]:
        return self.manifest["shards"]

    @property
    def shard_meta(self) -> dict:
        """What each shard file records of its cache (safetensors metadata)."""
        return {"target": self.manifest["target"]["fingerprint"], "layers": list(self.extractor.layer_ids)}


def open_cache(samples, model, tokenizer, out: Path, layer_ids, settings: CacheSettings, shard=(0, 1),
               max_samples: int | None = None, source: dict | None = None, overwrite: bool = False,
               progress: bool = False, keep_groups: bool = False) -> OpenedCache:
    """The planning pass (token ids only), then the manifest of ``out``: written, or checked
    against one already there (another build, or a hybrid run, adds to it only with the same
    settings); half-written files of this ``shard`` process are removed."""
    from tqdm.auto import tqdm

    part, parts = shard
    extractor = FeatureExtractor(model, layer_ids)
    skipped: list[int] = []
    groups = tqdm(shard_samples(samples, settings, max_samples, skipped), desc="planning", unit="shard",
                  disable=not progress)
    kept = list(groups) if keep_groups else None
    plan = [g.plan() for g in (kept if keep_groups else groups)]
    if not plan:
        raise LyannaError("no sample has any loss token: nothing to cache")
    manifest = cache_manifest(model, tokenizer, extractor, settings, plan, skipped, source)
    prepare_cache_dir(out, manifest, overwrite)
    remove_stale_temporaries(out, part, parts)
    return OpenedCache(out, manifest, extractor, kept)


def _build(samples, model, tokenizer, out: Path, layer_ids, settings, shard, max_samples, source, overwrite,
           progress, say) -> BuildResult:
    from tqdm.auto import tqdm

    part, parts = shard
    opened = open_cache(samples, model, tokenizer, out, layer_ids, settings, shard, max_samples, source, overwrite,
                        progress)
    manifest, extractor, plan = opened.manifest, opened.extractor, opened.plan
    mine = [p for p in plan if p["shard"] % parts == part]
    todo = _shards_to_compute(out, mine, say)
    tokens, bpt = sum(p["tokens"] for p in todo.values()), manifest["bytes_per_token"]
    say(f"feature cache {out}: {len(plan)} shards in all, {len(mine)} for process {part}/{parts}, "
        f"{len(mine) - len(todo)} already done; to compute: {tokens:,} tokens x {bpt:,} bytes/token "
        f"= ~{_gb(tokens * bpt)} on disk")

    bar = tqdm(total=tokens, unit="tok", unit_scale=True, desc="features", dynamic_ncols=True, disable=not progress)
    written: list[dict] = []
    writer = _BackgroundWriter(out, opened.shard_meta, written.append)
    start = time.perf_counter()
    try:
        _compute(samples, settings, max_samples, extractor, todo, writer, bar.update)
    except BaseException:
        writer.close(quiet=True)  # shards already computed are still written: they are complete
        raise
    finally:
        bar.close()
    writer.close()
    result = BuildResult(out, len(plan), len(mine), len(mine) - len(todo), len(written),
                         sum(e["tokens"] for e in written), time.perf_counter() - start,
                         sum(e["bytes"] for e in written), tokens * bpt,
                         all(shard_problem(out, p, verify_checksum=False) is None for p in plan))
    say(_summary(result, part, parts))
    return result
