"""Draft-head configuration, derived from the target's config and a hot vocabulary."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import LyannaError


@dataclass(frozen=True)
class DraftConfig:
    """Shapes and Lyanna switches of a draft head (all fields are serialised in exports)."""

    target_hidden_size: int  # H of the target (features are 3·H wide)
    vocab_size: int  # target vocabulary (embedding rows)
    draft_vocab_size: int  # hot-vocabulary size scored by the LM head
    hidden_size: int  # draft width; equals the target's H for SGLang/vLLM EAGLE-3 loading
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    num_aux_layers: int = 3  # target layers fused by ``fc``
    aux_layer_ids: tuple = ()  # which ones: "output of decoder layer i" (0-based), recorded for serving
    # the layer's residual is the normed incoming state (EAGLE-3's norm_before_residual, which
    # vLLM and speculators read): the target's outlier dimensions then never enter the residual
    norm_before_residual: bool = False
    aux_scale: bool = False  # a fixed per-dimension scale on the target features before fc (folded into fc on export)
    # Lyanna parts (each can be switched off for ablations)
    pool_size: int = 512  # states kept in the pool (0 = pool off); 128 minimum when on
    pool_threshold: float = 0.85  # cosine similarity needed to use a retrieved state
    alpha_max: float = 0.3  # α = alpha_max · sigmoid(gate(...)); 0 = gate off
    gate_hidden: int = 64  # width of the α-gating network
    other_bucket: bool = False  # train an extra "outside the hot vocabulary" logit
    # EAGLE-3 variants of heads imported from speculators' trainer (its defaults turn the first
    # and last on); heads trained here leave all three off, as SGLang and vLLM expect
    norm_before_fc: bool = False  # one RMSNorm over the concatenated features before fc ("input_norm")
    fc_norm: bool = False  # an RMSNorm per fused layer's features before fc ("fc_norm.i")
    norm_output: bool = False  # the next draft step reads the normed state ("Eagle 3.1")

    def __post_init__(self):
        if self.hidden_size % 2 or self.head_dim % 2:
            raise LyannaError("draft hidden_size and head_dim must be even (rotary embeddings)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise LyannaError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise LyannaError(f"draft_vocab_size {self.draft_vocab_size} must be in (0, {self.vocab_size}]")
        if self.pool_size and self.pool_size < 128:
            raise LyannaError(f"pool_size {self.pool_size} is below the minimum of 128 (use 0 to turn the pool off)")
        if self.aux_layer_ids and len(self.aux_layer_ids) != self.num_aux_layers:
            raise LyannaError(f"aux_layer_ids {tuple(self.aux_layer_ids)} do not match num_aux_layers {self.num_aux_layers}")
        if not 0.0 <= self.alpha_max <= 1.0:
            raise LyannaError(f"alpha_max must be in [0, 1], not {self.alpha_max}")
        if self.norm_before_fc and self.fc_norm:
            raise LyannaError("norm_before_fc and fc_norm are alternatives: set one at most")
        if not -1.0 <= self.pool_threshold <= 1.0:
            raise LyannaError(f"pool_threshold is a cosine similarity in [-1, 1], not {self.pool_threshold}")

    @property
    def pool_enabled(self) -> bool:
        return self.pool_size > 0 and self.alpha_max > 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, **overrides) -> "DraftConfig":
        """One decoder layer shaped like the target's (the EAGLE-3 choice), overridable."""
        heads = target_config.num_attention_heads
        base = dict(
            target_hidden_size=target_config.hidden_size,
            vocab_size=target_config.vocab_size,
            draft_vocab_size=draft_vocab_size,
            hidden_size=target_config.hidden_size,
            intermediate_size=target_config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
            rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-5),
            rope_theta=_rope_theta(target_config),
            max_position_embeddings=getattr(target_config, "max_position_embeddings", 4096),
        )
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    def llama_config(self):
        """A ``LlamaConfig`` for the pieces borrowed from transformers (norms, MLP, rotary)."""
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           max_position_embeddings=self.max_position_embeddings, vocab_size=self.vocab_size,
                           hidden_act="silu")


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", 10000.0))
