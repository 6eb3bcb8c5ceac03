"""The typed training configuration: one dataclass per Hydra group, checked as a whole.

Each field is declared once, here: its default, its allowed range (``ranged(default,
rule)``, which :func:`validate` checks it against) and a comment saying what it is for;
:func:`validate` adds the cross-field checks that a range cannot express. The Hydra tree in
``conf/`` holds only the groups that choose between alternatives (``draft=no_pool``,
``deepspeed=zero2_bf16``...); every other value comes from these defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..errors import LyannaError
from ..ranges import check_values, flag, integer, number, off_or, one_of, one_of_names, optional, ranged, text
from .validation import beta_pair, check_paths, corpus_list, feature_dtypes, layer_list, resume_spec

_DIMENSION = optional(integer(1))  # a draft dimension; None = the target's


@dataclass
class TargetConf:
    name: str = ranged("smollm2", text())  # embedded name, GGUF file or Hugging Face directory of the target
    # compute dtype of the frozen target; auto: bfloat16 where the device has it natively
    dtype: str = ranged("float32", one_of("auto", "float32", "bfloat16", "float16"))
    # decoder layers fused by fc; None = EAGLE-3's (1, L/2-1, L-4)
    aux_layers: Optional[list] = ranged(None, optional(layer_list()))


@dataclass
class TargetInitConf:
    # lm_head <- the target's output embeddings at the hot ids; norm <- its final norm
    lm_head: bool = ranged(False, flag())
    # decoder layer <- this target layer (embedding half of q/k/v at zero); None = random
    layer: Optional[int] = ranged(None, optional(integer(0)))
    # random, or top_layer: fc passes the highest captured layer through
    fc: str = ranged("random", one_of("random", "top_layer"))


@dataclass
class DraftConf:
    # draft width; None = the target's (needed for SGLang/vLLM EAGLE-3)
    hidden_size: Optional[int] = ranged(None, _DIMENSION)
    intermediate_size: Optional[int] = ranged(None, _DIMENSION)  # None = the target's
    num_attention_heads: Optional[int] = ranged(None, _DIMENSION)  # None = the target's
    num_key_value_heads: Optional[int] = ranged(None, _DIMENSION)  # None = the target's
    head_dim: Optional[int] = ranged(None, _DIMENSION)  # None = the target's
    # state-pool size (0 = pool off; 128 minimum; 256 code / 1024 long text)
    pool_size: int = ranged(512, off_or(integer(128), "pool"))
    pool_threshold: float = ranged(0.85, number(-1, 1))  # cosine similarity a pooled state needs to be fused
    alpha_max: float = ranged(0.3, number(0, 1))  # upper bound of α (0 = gate off)
    gate_hidden: int = ranged(64, integer(1))  # width of the α-gating network
    target_init: TargetInitConf = field(default_factory=TargetInitConf)  # start from the target's weights
    freeze_lm_head: bool = ranged(False, flag())  # keep the LM head as initialised (fewer parameters to over-fit)
    # the layer's residual is the normed state (outlier dims kept out of it)
    norm_before_residual: bool = ranged(False, flag())
    # scale each target-feature dimension by 1/RMS before fc (folded into fc on export)
    aux_scale: bool = ranged(False, flag())
    # fine-tune an existing head: an export dir (lyanna or eagle3; `lyanna-export import` for other toolkits')
    init_from: Optional[str] = ranged(None, optional(text()))
    # keep: the head's vocabulary map; rebuild: the run's hot vocabulary, shared rows kept
    init_vocab: str = ranged("keep", one_of("keep", "rebuild"))


@dataclass
class HotVocabConf:
    # lyanna-hotvocab output dir or hot-*.safetensors; None = build from data.corpus
    path: Optional[str] = ranged(None, optional(text()))
    # which selection (fraction of the vocabulary) to use or build
    ratio: float = ranged(0.05, number(0, 1, low_open=True))
    size: Optional[int] = ranged(None, optional(integer(1)))  # exact size instead of ratio
    full_vocab: bool = ranged(False, flag())  # ablation: score the whole vocabulary (no hot vocabulary)


@dataclass
class DataConf:
    corpus: list = ranged(["sharegpt"], corpus_list())  # training corpora (never mtbench)
    # tokens per sample (longer ones keep their head; data.samples.MAX_LENGTH)
    max_length: int = ranged(2048, integer(2))
    max_samples: Optional[int] = ranged(None, optional(integer(1)))  # use only the first N samples
    # cached: precompute target features once; online: inside each step; hybrid: inside the
    # steps of the first epoch, which write them to the cache that later epochs (and a resumed run) read
    features: str = ranged("cached", one_of("cached", "online", "hybrid"))
    # how the cache stores the target's hidden states: bfloat16, or float8_e4m3fn with a scale per
    # token and layer (half the disk; data/feature_dtype.py says why that scale)
    feature_dtype: str = ranged("bfloat16", one_of_names(feature_dtypes))
    cache_dir: Optional[str] = ranged(None, optional(text()))  # feature cache; None = <train.out_dir>/features
    batch_tokens: int = ranged(4096, integer(2))  # padded tokens per micro-batch
    shard_tokens: int = ranged(32768, integer(1))  # tokens per cache shard
    # cache the teacher's top-1 + logsumexp: slower extraction, faster epochs
    teacher_summary: bool = ranged(True, flag())
    # train on the cache's first shards up to this many tokens (scaling runs)
    max_tokens: Optional[int] = ranged(None, optional(integer(1)))


@dataclass
class LossConf:
    ttt_steps: int = ranged(7, integer(1))  # training-time-test unroll depth (EAGLE-3 uses 7)
    step_weight: float = ranged(0.8, number(0, 1, low_open=True))  # step j is weighted step_weight**j
    # mask: drop positions whose target top-1 is not hot; other: an extra bucket
    out_of_vocab: str = ranged("mask", one_of("mask", "other"))
    # weight of the smooth-L1 regression toward the target's next state
    hidden_weight: float = ranged(0.0, number(0))
    # weight of the total-variation distance to the teacher (1 - TV bounds acceptance)
    tv_weight: float = ranged(0.0, number(0))
    # which positions are trained: assistant (what is served) or all (user turns too)
    positions: str = ranged("assistant", one_of("assistant", "all"))
    # Gaussian noise on the target features, x each dimension's RMS (EAGLE's data noise): against over-fitting
    feature_noise: float = ranged(0.0, number(0))


@dataclass
class TrainConf:
    # run directory: checkpoints, metrics, hot vocabulary, features (resolved by Hydra: checkpoints/<run_name>)
    out_dir: str = ranged("checkpoints/${run_name}", text())
    epochs: int = ranged(1, integer(1))  # passes over the data (max_steps wins when set)
    max_steps: Optional[int] = ranged(None, optional(integer(1)))  # optimizer steps in all
    lr: float = ranged(3e-4, number(0, 1, low_open=True))  # peak learning rate
    min_lr_ratio: float = ranged(0.1, number(0, 1))  # cosine decay floor, as a fraction of lr
    warmup_steps: int = ranged(20, integer(0))  # linear warm-up
    weight_decay: float = ranged(0.0, number(0))
    grad_clip: float = ranged(0.5, number(0))  # max gradient norm (0 = off)
    grad_accum: int = ranged(1, integer(1))  # micro-batches per optimizer step
    seed: int = ranged(0, integer(0, 2**32 - 1))  # data order, initialisation
    log_every: int = ranged(10, integer(1))  # steps between logged metrics (the only host syncs)
    save_every: int = ranged(200, integer(0))  # steps between checkpoints (0 = only at the end)
    keep_last: int = ranged(2, integer(0))  # checkpoints kept
    # auto: latest checkpoint, same config only; force: continue it with a changed one; never; or a path
    resume: str = ranged("auto", resume_spec())
    threads: Optional[int] = ranged(None, optional(integer(1)))  # torch CPU threads per rank (None = torch's default)
    # minutes the whole run may take here (features, training, held-out, evaluation): measured
    # at the start, the run trains on the samples that fit (training/budget.py: a count); None = no limit
    time_budget_min: Optional[float] = ranged(None, optional(number(0, low_open=True)))
    # the draft's forward and losses under torch.autocast in this dtype (master weights and
    # optimizer stay fp32); bfloat16 trains ~3x faster on CPUs with AVX512-BF16 / AMX but
    # ~5x slower on CPUs without (emulated); auto: bfloat16 where native, else off
    autocast: Optional[str] = ranged(None, one_of(None, "auto", "bfloat16", "float16"))


@dataclass
class DeepSpeedConf:
    zero_stage: int = ranged(0, one_of(0, 1, 2))  # ZeRO stage 0/1/2
    precision: str = ranged("auto", one_of("auto", "fp32", "bf16"))  # auto (bf16 on GPU, fp32 on CPU), fp32 or bf16
    backend: str = ranged("auto", one_of("auto", "gloo", "nccl"))  # auto (nccl on GPU, gloo on CPU), gloo, nccl
    betas: list = ranged([0.9, 0.95], beta_pair())  # AdamW betas
    eps: float = ranged(1e-8, number(0, low_open=True))


@dataclass
class WandbConf:
    # tracked in W&B (offline automatically when there is no API key)
    enabled: bool = ranged(True, flag())
    project: str = ranged("lyanna-train", text())
    entity: Optional[str] = ranged(None, optional(text()))  # never a default account
    mode: str = ranged("auto", one_of("auto", "online", "offline"))  # auto | online | offline


@dataclass
class TrackingConf:
    wandb: WandbConf = field(default_factory=WandbConf)
    metrics_jsonl: bool = ranged(True, flag())  # always-on local log: <out_dir>/metrics.jsonl


@dataclass
class EvalConf:
    every: int = ranged(200, integer(0))  # steps between τ evaluations (0 = only at the end)
    prompts: str = ranged("mtbench", text())  # held-out prompts (first turns)
    num_prompts: int = ranged(8, integer(0))
    depth: int = ranged(5, integer(1))  # chain-drafting depth
    max_new_tokens: int = ranged(64, integer(1))
    # teacher-forced top-1 agreement on samples the head never trains on (and on as many it
    # does: the over-fit gap); they follow the training range in the corpus stream
    heldout_samples: int = ranged(64, integer(0))  # 0 = off
    # stream position of the first held-out sample; None = data.max_samples
    heldout_from: Optional[int] = ranged(None, optional(integer(0)))
    agreement_steps: int = ranged(3, integer(1))  # unroll steps whose agreement is reported


@dataclass
class Config:
    run_name: str = ranged("lyanna", text())
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
    """Every field against the range it declares, then the cross-field checks, then (``paths``)
    the paths the run reads and the refusal of evaluation sets as training data.

    Raises :class:`LyannaError` naming the offending field; runs before any work.
    ``paths=False`` checks a config written for another machine (a recipe's header command).
    """
    check_values(cfg, Config)

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
