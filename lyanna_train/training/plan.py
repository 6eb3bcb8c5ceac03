"""A plan before a run: what a configuration will cost, from the target's ``config.json`` alone.

The target and the draft are built on the meta device (shapes, no weights), so planning a
Llama-3-8B run takes a second on a laptop. Memory per rank is an estimate of what a
training step holds, in bytes:

* the frozen target, replicated on every rank (it makes features; ``params x dtype``);
* the draft's weights, gradients and AdamW state, split across ranks by ZeRO: stage 1
  partitions the optimizer state (fp32 master copy under bf16, both moments), stage 2
  the gradients as well;
* activations of one micro-batch (``data.batch_tokens`` tokens as rows of
  ``data.max_length``), kept for backward through ``loss.ttt_steps`` unrolled steps: the
  attention probabilities of the training-time test (rows x heads x T x T in fp32 per
  step, softmax's saved output, plus one step's scores in flight: the largest term at long
  contexts), the layer's hidden states, and the hot-vocabulary logits;
* with ``data.features=online`` or ``hybrid``, the target's own forward on the micro-batch
  (no grad: one layer's activations at a time) and the features it hands over.

Disk: the feature cache's bytes per token (:func:`~lyanna_train.data.feature_cache.bytes_per_token`)
in each ``data.feature_dtype``, times the configured tokens (``data.max_samples x
data.max_length`` at most, or ``tokens``).

Time: each phase's matmul FLOPs per token over a stated throughput, ``tflops`` sustained
per GPU (printed; ``--tflops``): the features are the target's forward (2 FLOPs per weight,
attention ``2 L T H`` over the causal half, the LM head when the teacher summary is cached),
once with ``cached`` and ``hybrid``, every epoch with ``online``; training is the draft's
forward and backward (6 FLOPs per trainable weight, attention ``6 T H``) for each of
``loss.ttt_steps`` unrolled steps, every epoch. Ranks split both evenly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import LyannaError
from ..hotvocab.selection import size_for_ratio

GiB = 1024**3
# The throughput assumption: ~40 % of an H100 SXM's 989 dense bf16 TFLOP/s, what large-batch
# bf16 forward and backward passes of 7-8B models sustain; a plan prints it, --tflops changes it
DEFAULT_TFLOPS = 400.0
REFERENCE_TOKENS = 100_000_000  # what disk and time are given for when the run's tokens are unknown
# "auto" is bf16 on the GPUs a plan is made for (every one a 7B run would use has it natively)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


@dataclass
class Plan:
    target_params: int
    draft_params: int  # trainable
    hot_vocab: int
    vocab: int
    world: int
    zero_stage: int
    precision: str
    memory: dict = field(default_factory=dict)  # component -> bytes per rank
    bytes_per_token: int = 0  # feature cache, in the run's data.feature_dtype
    tokens: int | None = None  # configured training tokens (upper bound), None when unknown
    features: str = "cached"
    feature_dtype: str = "bfloat16"
    disk_per_token: dict = field(default_factory=dict)  # feature dtype -> cache bytes per token
    phase_flops: dict = field(default_factory=dict)  # phase -> FLOPs per training token, whole run
    tflops: float = DEFAULT_TFLOPS  # assumed sustained throughput per GPU

    def phase_hours(self, tokens: int) -> dict:
        """Phase -> wall-clock hours on ``world`` GPUs for ``tokens`` training tokens."""
        return {k: f * tokens / (self.world * self.tflops * 1e12) / 3600 for k, f in self.phase_flops.items()}

    @property
    def memory_per_rank(self) -> int:
        return sum(self.memory.values())

    @property
    def cache_bytes(self) -> int | None:
        return None if self.tokens is None else self.tokens * self.bytes_per_token


def target_config(spec: str):
    """The target's ``transformers`` config from its ``config.json`` (no weights read): a local
    directory, GGUF header or cached download, else the copy shipped for a recipe's hub id."""
    from transformers import AutoConfig

    from ..target.source import resolve_target
    from ..target.support import check_target_config
    from ..target.shipped_configs import shipped_config

    try:
        ref = resolve_target(spec)
        if ref.gguf_file is None and ref.path == spec and not _in_hub_cache(spec):
            shipped = shipped_config(spec)  # a hub id that is not on disk: no network is ever tried
            if shipped is not None:
                return shipped
        extra = {"gguf_file": ref.gguf_file} if ref.gguf_file else {}  # read from the GGUF header
        config = AutoConfig.from_pretrained(ref.path, local_files_only=True, **extra)
    except LyannaError as err:
        raise LyannaError(f"cannot read the config of target {spec}: {err}") from None
    except Exception as err:  # noqa: BLE001 - transformers raises many types
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise LyannaError(f"cannot read the config of target {spec}: {first}") from None
    check_target_config(config)  # what the draft is built from must exist (a GPT-2 config has no intermediate_size)
    return config


def _in_hub_cache(hub_id: str) -> bool:
    """Whether the local Hugging Face cache holds ``hub_id``'s config.json (a file lookup only)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(hub_id, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


def _meta_params(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _draft_params(cfg, config, hot: int) -> int:
    from ..models.config import DraftConfig
    from ..models.draft_head import DraftHead
    from ..target.capture import check_layer_ids, default_layer_ids
    from .setup import draft_overrides

    layers = check_layer_ids(cfg.target.aux_layers or default_layer_ids(config.num_hidden_layers),
                             config.num_hidden_layers)
    draft_cfg = DraftConfig.from_target(config, hot, **draft_overrides(cfg.draft),
                                        other_bucket=cfg.loss.out_of_vocab == "other", num_aux_layers=len(layers),
                                        aux_layer_ids=tuple(layers))
    with torch.device("meta"):
        draft = DraftHead(draft_cfg, torch.arange(hot), torch.empty(config.vocab_size, config.hidden_size))
    return sum(p.numel() for p in draft.parameters() if p.requires_grad)


def hot_vocab_size(cfg, vocab: int) -> int:
    """The hot vocabulary the run will build or load (``hotvocab.size``, else the ratio)."""
    if cfg.hotvocab.full_vocab:
        return vocab
    return int(cfg.hotvocab.size or size_for_ratio(cfg.hotvocab.ratio, vocab))


def phase_flops(cfg, config, target_params: int, draft_params: int) -> dict:
    """Phase -> FLOPs per training token over the whole run (see the module docstring)."""
    vocab, h, t = config.vocab_size, config.hidden_size, cfg.data.max_length
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # the input embedding is a lookup, not a matmul; the LM head runs for the teacher summary
    matmul = target_params - vocab * h * (0 if tied else 1) - (0 if cfg.data.teacher_summary else vocab * h)
    features = 2 * matmul + 2 * config.num_hidden_layers * t * h
    passes = cfg.train.epochs if cfg.data.features == "online" else 1
    steps, draft_h = cfg.loss.ttt_steps, cfg.draft.hidden_size or h
    where = "every epoch" if passes > 1 else "once"
    return {f"features: the target's forward, {where} (data.features={cfg.data.features})": features * passes,
            f"training: {cfg.train.epochs} epoch(s) x {steps} unrolled step(s)":
                cfg.train.epochs * steps * (6 * draft_params + 6 * t * draft_h)}


def make_plan(cfg, world: int = 1, tokens: int | None = None, config=None, tflops: float = DEFAULT_TFLOPS) -> Plan:
    """The plan of the composed config ``cfg`` on ``world`` ranks (``config``: the target's,
    read from ``target.name`` when not given; ``tflops``: the assumed throughput per GPU)."""
    from ..data.feature_cache import bytes_per_token
    from ..data.feature_dtype import FEATURE_DTYPES

    config = config if config is not None else target_config(cfg.target.name)
    vocab, h, layers = config.vocab_size, config.hidden_size, config.num_hidden_layers
    hot = hot_vocab_size(cfg, vocab)
    target_params, draft_params = _meta_params(config), _draft_params(cfg, config, hot)
    on_gpu_bf16 = cfg.deepspeed.precision in ("bf16", "auto")
    precision = "bf16" if cfg.deepspeed.precision == "bf16" else "fp32" if cfg.deepspeed.precision == "fp32" \
        else "bf16 on GPU"
    weight_bytes = 2 if on_gpu_bf16 else 4
    optimizer_bytes = (4 + 4 + 4) if on_gpu_bf16 else (4 + 4)  # (fp32 master +) exp_avg + exp_avg_sq
    stage = cfg.deepspeed.zero_stage
    shard = lambda n: n / world  # noqa: E731 - ZeRO's partitioning, inline
    aux = (len(cfg.target.aux_layers) if cfg.target.aux_layers else 3) * h
    rows = max(cfg.data.batch_tokens // cfg.data.max_length, 1)
    t, steps = cfg.data.max_length, cfg.loss.ttt_steps
    heads = cfg.draft.num_attention_heads or config.num_attention_heads
    act_bytes = 2 if cfg.train.autocast in ("auto", "bfloat16", "float16") or on_gpu_bf16 else 4
    memory = {
        "target weights": target_params * _DTYPE_BYTES.get(cfg.target.dtype, 4),
        "draft weights": draft_params * weight_bytes,
        "draft gradients": draft_params * weight_bytes / (world if stage >= 2 else 1),
        "optimizer state": draft_params * optimizer_bytes / (world if stage >= 1 else 1),
        "attention scores (TTT)": rows * heads * t * t * 4 * (steps + 1),
        "draft activations": rows * t * (12 * h + 2 * hot) * act_bytes * steps,
        "batch features": rows * t * (aux + h) * 2,
    }
    if cfg.data.features in ("online", "hybrid"):
        memory[f"target forward ({cfg.data.features})"] = rows * t * (4 * h + config.intermediate_size) * 2
    if tokens is None and cfg.data.max_samples:
        tokens = int(cfg.data.max_samples) * int(cfg.data.max_length)
    disk = {dtype: bytes_per_token(aux, h, dtype) for dtype in FEATURE_DTYPES}
    return Plan(target_params, draft_params, hot, vocab, world, stage, precision,
                {k: int(v) for k, v in memory.items()}, disk[cfg.data.feature_dtype], tokens, cfg.data.features,
                cfg.data.feature_dtype, disk, phase_flops(cfg, config, target_params, draft_params), tflops)


def _gib(n: float) -> str:
    return f"{n / GiB:,.1f} GiB"


def describe(plan: Plan, gpu_memory: float | None = None) -> str:
    """The plan as a short table (what ``lyanna-plan`` prints)."""
    lines = [f"target: {plan.target_params / 1e9:,.2f} B parameters, vocabulary {plan.vocab:,}; "
             f"hot vocabulary {plan.hot_vocab:,} tokens ({plan.hot_vocab / plan.vocab:.1%})",
             f"draft: {plan.draft_params / 1e6:,.1f} M trainable parameters; {plan.world} rank(s), "
             f"ZeRO stage {plan.zero_stage}, {plan.precision}",
             "", "| memory per rank (estimate) | |", "|---|---:|"]
    lines += [f"| {name} | {_gib(n)} |" for name, n in plan.memory.items()]
    lines.append(f"| **total** | **{_gib(plan.memory_per_rank)}** |")
    if gpu_memory:
        lines.append(f"| GPU memory | {gpu_memory:,.1f} GiB |")
    tokens = plan.tokens or REFERENCE_TOKENS
    counted = (f"{tokens:,} tokens (at most)" if plan.tokens else
               f"{tokens:,} tokens (data.max_samples is null: set it, or pass --tokens N, for the run's)")
    lines += ["", f"for {counted}:", "",
              "| feature cache (data.features=cached or hybrid; online keeps none) | bytes per token | on disk |",
              "|---|---:|---:|"]
    for dtype, size in plan.disk_per_token.items():
        mark = " (this run)" if dtype == plan.feature_dtype else ""
        lines.append(f"| data.feature_dtype={dtype}{mark} | {size:,} | {_gib(size * tokens)} |")
    hours = plan.phase_hours(tokens)
    lines += ["", f"| phase, at an assumed {plan.tflops:,.0f} TFLOP/s sustained per GPU (--tflops) | "
              f"GFLOP per token | hours on {plan.world} GPU(s) | GPU-hours |", "|---|---:|---:|---:|"]
    for phase, flops in plan.phase_flops.items():
        lines.append(f"| {phase} | {flops / 1e9:,.1f} | {hours[phase]:,.2f} | {hours[phase] * plan.world:,.2f} |")
    total = sum(hours.values())
    lines.append(f"| **total** | | **{total:,.2f}** | **{total * plan.world:,.2f}** |")
    return "\n".join(lines)


def check_fits(plan: Plan, gpu_memory: float) -> None:
    """One line, naming the largest term, when the estimate exceeds ``gpu_memory`` GiB."""
    need = plan.memory_per_rank / GiB
    if need > gpu_memory:
        largest = max(plan.memory, key=plan.memory.get)
        raise LyannaError(f"the plan needs ~{need:,.1f} GiB per rank, more than the {gpu_memory:,.1f} GiB given "
                          f"(largest: {largest}, {_gib(plan.memory[largest])}); lower data.batch_tokens or "
                          f"data.max_length, raise deepspeed.zero_stage, or use more GPUs")
