"""The typed training configuration: one dataclass per Hydra group, checked as a whole.

Every field has a comment saying what it is for; :func:`validate` adds the cross-field
checks that YAML cannot express. The Hydra tree in ``conf/`` mirrors these classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..errors import LyannaError


@dataclass
class TargetConf:
    name: str = "smollm2"  # embedded name, GGUF file or Hugging Face directory of the target
    dtype: str = "float32"  # compute dtype of the frozen target; auto: bfloat16 where the device has it natively
    aux_layers: Optional[list] = None  # decoder layers fused by fc; None = EAGLE-3's (1, L/2-1, L-4)


@dataclass
class TargetInitConf:
    lm_head: bool = False  # lm_head <- the target's output embeddings at the hot ids; norm <- its final norm
    layer: Optional[int] = None  # decoder layer <- this target layer (embedding half of q/k/v at zero); None = random
    fc: str = "random"  # random, or top_layer: fc passes the highest captured layer through


@dataclass
class DraftConf:
    hidden_size: Optional[int] = None  # draft width; None = the target's (needed for SGLang/vLLM EAGLE-3)
    intermediate_size: Optional[int] = None  # None = the target's
    num_attention_heads: Optional[int] = None  # None = the target's
    num_key_value_heads: Optional[int] = None  # None = the target's
    head_dim: Optional[int] = None  # None = the target's
    pool_size: int = 512  # state-pool size (0 = pool off; 128 minimum; 256 code / 1024 long text)
    pool_threshold: float = 0.85  # cosine similarity a pooled state needs to be fused
    alpha_max: float = 0.3  # upper bound of α (0 = gate off)
    gate_hidden: int = 64  # width of the α-gating network
    target_init: TargetInitConf = field(default_factory=TargetInitConf)  # start from the target's weights
    freeze_lm_head: bool = False  # keep the LM head as initialised (fewer parameters to over-fit)
    norm_before_residual: bool = False  # the layer's residual is the normed state (outlier dims kept out of it)
    aux_scale: bool = False  # scale each target-feature dimension by 1/RMS before fc (folded into fc on export)
    # fine-tune an existing head: an export dir (lyanna or eagle3; `lyanna-export import` for other toolkits')
    init_from: Optional[str] = None
    init_vocab: str = "keep"  # keep: the head's vocabulary map; rebuild: the run's hot vocabulary, shared rows kept


@dataclass
class HotVocabConf:
    path: Optional[str] = None  # lyanna-hotvocab output dir or hot-*.safetensors; None = build from data.corpus
    ratio: float = 0.05  # which selection (fraction of the vocabulary) to use or build
    size: Optional[int] = None  # exact size instead of ratio
    full_vocab: bool = False  # ablation: score the whole vocabulary (no hot vocabulary)


@dataclass
class DataConf:
    corpus: list = field(default_factory=lambda: ["sharegpt"])  # training corpora (never mtbench)
    max_length: int = 2048  # tokens per sample (longer ones keep their head; data.samples.MAX_LENGTH)
    max_samples: Optional[int] = None  # use only the first N samples
    # cached: precompute target features once; online: inside each step; hybrid: inside the
    # steps of the first epoch, which write them to the cache that later epochs (and a resumed run) read
    features: str = "cached"
    # how the cache stores the target's hidden states: bfloat16, or float8_e4m3fn with a scale per
    # token and layer (half the disk; data/feature_dtype.py says why that scale)
    feature_dtype: str = "bfloat16"
    cache_dir: Optional[str] = None  # feature cache; None = <train.out_dir>/features
    batch_tokens: int = 4096  # padded tokens per micro-batch
    shard_tokens: int = 32768  # tokens per cache shard
    teacher_summary: bool = True  # cache the teacher's top-1 + logsumexp: slower extraction, faster epochs
    max_tokens: Optional[int] = None  # train on the cache's first shards up to this many tokens (scaling runs)


@dataclass
class LossConf:
    ttt_steps: int = 7  # training-time-test unroll depth (EAGLE-3 uses 7)
    step_weight: float = 0.8  # step j is weighted step_weight**j
    out_of_vocab: str = "mask"  # mask: drop positions whose target top-1 is not hot; other: an extra bucket
    hidden_weight: float = 0.0  # weight of the smooth-L1 regression toward the target's next state
    tv_weight: float = 0.0  # weight of the total-variation distance to the teacher (1 - TV bounds acceptance)
    positions: str = "assistant"  # which positions are trained: assistant (what is served) or all (user turns too)
    feature_noise: float = 0.0  # Gaussian noise on the target features, x each dimension's RMS (EAGLE's data noise)


@dataclass
class TrainConf:
    out_dir: str = "checkpoints/lyanna"  # run directory: checkpoints, metrics, hot vocabulary, features
    epochs: int = 1  # passes over the data (max_steps wins when set)
    max_steps: Optional[int] = None  # optimizer steps in all
    lr: float = 3e-4  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decay floor, as a fraction of lr
    warmup_steps: int = 20  # linear warm-up
    weight_decay: float = 0.0
    grad_clip: float = 0.5  # max gradient norm (0 = off)
    grad_accum: int = 1  # micro-batches per optimizer step
    seed: int = 0  # data order, initialisation
    log_every: int = 10  # steps between logged metrics (the only host syncs)
    save_every: int = 200  # steps between checkpoints (0 = only at the end)
    keep_last: int = 2  # checkpoints kept
    resume: str = "auto"  # auto: latest checkpoint, same config only; force: continue it with a changed one; never; or a path
    threads: Optional[int] = None  # torch CPU threads per rank (None = torch's default)
    # minutes the whole run may take here (features, training, held-out, evaluation): measured
    # at the start, data.max_samples is cut to what fits (training/budget.py); None = no limit
    time_budget_min: Optional[float] = None
    # the draft's forward and losses under torch.autocast in this dtype (master weights and
    # optimizer stay fp32); bfloat16 trains ~3x faster on CPUs with AVX512-BF16 / AMX but
    # ~5x slower on CPUs without (emulated); auto: bfloat16 where native, else off
    autocast: Optional[str] = None


@dataclass
class DeepSpeedConf:
    zero_stage: int = 0  # ZeRO stage 0/1/2
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU), fp32 or bf16
    backend: str = "auto"  # auto (nccl on GPU, gloo on CPU), gloo, nccl
    betas: list = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    eps: float = 1e-8


@dataclass
class WandbConf:
    enabled: bool = True  # tracked in W&B (offline automatically when there is no API key)
    project: str = "lyanna-train"
    entity: Optional[str] = None  # never a default account
    mode: str = "auto"  # auto | online | offline


@dataclass
class TrackingConf:
    wandb: WandbConf = field(default_factory=WandbConf)
    metrics_jsonl: bool = True  # always-on local log: <out_dir>/metrics.jsonl


@dataclass
class EvalConf:
    every: int = 200  # steps between τ evaluations (0 = only at the end)
    prompts: str = "mtbench"  # held-out prompts (first turns)
    num_prompts: int = 8
    depth: int = 5  # chain-drafting depth
    max_new_tokens: int = 64
    # teacher-forced top-1 agreement on samples the head never trains on (and on as many it
    # does: the over-fit gap); they follow the training range in the corpus stream
    heldout_samples: int = 64  # 0 = off
    heldout_from: Optional[int] = None  # stream position of the first held-out sample; None = data.max_samples
    agreement_steps: int = 3  # unroll steps whose agreement is reported


@dataclass
class Config:
    run_name: str = "lyanna"
    target: TargetConf = field(default_factory=TargetConf)
    draft: DraftConf = field(default_factory=DraftConf)
    hotvocab: HotVocabConf = field(default_factory=HotVocabConf)
    data: DataConf = field(default_factory=DataConf)
    loss: LossConf = field(default_factory=LossConf)
    train: TrainConf = field(default_factory=TrainConf)
    deepspeed: DeepSpeedConf = field(default_factory=DeepSpeedConf)
    tracking: TrackingConf = field(default_factory=TrackingConf)
    eval: EvalConf = field(default_factory=EvalConf)


def validate(cfg, paths: bool = True) -> None:
    """Every field against its allowed range, then the cross-field checks, then (``paths``)
    the paths the run reads and the refusal of evaluation sets as training data.

    Raises :class:`LyannaError` naming the offending field; runs before any work.
    ``paths=False`` checks a config written for another machine (a recipe's header command).
    """
    from .validation import check_paths, check_values

    check_values(cfg)

    def bad(msg):
        raise LyannaError(f"config: {msg}")

    init = cfg.draft.target_init
    if cfg.draft.init_from and (init.lm_head or init.layer is not None or init.fc != "random"):
        bad("draft.init_from and draft.target_init are alternatives: a head to fine-tune is already initialised")
    if cfg.data.batch_tokens < cfg.data.max_length:
        bad(f"data.batch_tokens ({cfg.data.batch_tokens}) must hold one sample of data.max_length ({cfg.data.max_length})")
    if not paths:
        return
    from ..data.corpus import Corpus
    from ..data.samples import refuse_evaluation_sets

    check_paths(cfg)
    refuse_evaluation_sets(Corpus.resolve([str(c) for c in cfg.data.corpus]))  # the data stage's own check, early


def register() -> None:
    """Register the schema with Hydra so YAML is type-checked against it."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="lyanna_schema", node=Config)
