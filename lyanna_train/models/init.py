"""Start a draft head from the target's own weights instead of from noise.

A CPU recipe sees a few hundred thousand tokens, too few to learn an LM head and a
decoder layer from scratch. Much of what the draft needs already exists in the target:

* ``lm_head``: the target's output embeddings over the hot ids, with the target's final
  norm as the draft's ``norm``, so a draft state that equals the target's final hidden
  state scores exactly what the target would (over the hot vocabulary);
* ``layer``: the decoder layer from one of the target's layers (attention, MLP, norms). The
  draft's attention reads ``[norm(embedding); norm(state)]`` (2·H wide): the state half
  gets the target layer's projections, the embedding half starts at zero so the layer
  first behaves exactly like the copied one and learns to use the next token from there;
* ``fc``: passes the highest captured target layer through unchanged (the others at zero),
  so the draft's first state is a real target state rather than a random mixture.
"""

from __future__ import annotations

import torch

from ..errors import LyannaError
from .draft_head import DraftHead

FC_INITS = ("random", "top_layer")


def _final_norm(target):
    norm = getattr(target.base_model, "norm", None)
    if norm is None or not hasattr(norm, "weight"):
        raise LyannaError(f"{type(target).__name__}: cannot find its final norm (expected base_model.norm)")
    return norm


def _same_shape(draft: DraftHead, target, what: str) -> None:
    cfg, tc = draft.cfg, target.config
    mine = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    heads = tc.num_attention_heads
    theirs = (tc.hidden_size, tc.intermediate_size, heads, getattr(tc, "num_key_value_heads", None) or heads,
              getattr(tc, "head_dim", None) or tc.hidden_size // heads)
    if mine != theirs:
        raise LyannaError(f"cannot initialise the draft's {what} from the target: draft (hidden, intermediate, heads, "
                          f"kv heads, head dim) {mine} differ from the target's {theirs}")


@torch.no_grad()
def init_lm_head(draft: DraftHead, target) -> None:
    """lm_head rows <- the target's output embeddings at the hot ids; norm <- its final norm."""
    if draft.cfg.hidden_size != target.config.hidden_size:
        raise LyannaError(f"cannot initialise the draft's lm_head from the target: draft hidden size "
                          f"{draft.cfg.hidden_size} differs from the target's {target.config.hidden_size}")
    weight = target.get_output_embeddings().weight
    hot = draft.hot_ids.to(weight.device)
    draft.lm_head.weight[: len(hot)].copy_(weight[hot].to(draft.lm_head.weight))
    draft.norm.weight.copy_(_final_norm(target).weight.to(draft.norm.weight))


@torch.no_grad()
def init_layer(draft: DraftHead, target, layer: int) -> None:
    """The draft's decoder layer <- target decoder layer ``layer`` (embedding half of q/k/v at zero)."""
    _same_shape(draft, target, "decoder layer")
    layers = target.base_model.layers
    if not -len(layers) <= layer < len(layers):
        raise LyannaError(f"draft.init.layer {layer} is out of range for a target with {len(layers)} layers")
    source, mid = layers[layer], draft.midlayer
    h = draft.cfg.hidden_size
    for name in ("q_proj", "k_proj", "v_proj"):
        dst, src = getattr(mid.self_attn, name).weight, getattr(source.self_attn, name).weight
        dst.zero_()
        dst[:, h:].copy_(src.to(dst))
    mid.self_attn.o_proj.weight.copy_(source.self_attn.o_proj.weight.to(mid.self_attn.o_proj.weight))
    for dst, src in ((mid.hidden_norm, source.input_layernorm), (mid.input_layernorm, source.input_layernorm),
                     (mid.post_attention_layernorm, source.post_attention_layernorm)):
        dst.weight.copy_(src.weight.to(dst.weight))
    mid.mlp.load_state_dict({k: v.to(mid.mlp.gate_proj.weight) for k, v in source.mlp.state_dict().items()})


@torch.no_grad()
def init_fc_top_layer(draft: DraftHead) -> None:
    """fc <- [0 … 0 I]: the draft's first state is the highest captured target layer's output."""
    cfg = draft.cfg
    if cfg.hidden_size != cfg.target_hidden_size:
        raise LyannaError("draft.init.fc=top_layer needs the draft's hidden size to equal the target's")
    draft.fc.weight.zero_()
    h = cfg.target_hidden_size
    draft.fc.weight[:, (cfg.num_aux_layers - 1) * h:].copy_(torch.eye(h))


@torch.no_grad()
def feature_scale(aux: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
    """Per-dimension 1/RMS of target features aux [N, k·H] (rows where ``first`` [N] is set —
    a sequence's first token, whose activations are thousands of times larger — left out)."""
    aux = aux.float()
    if first is not None and bool((~first).any()):
        aux = aux[~first]
    return aux.pow(2).mean(0).sqrt().clamp(min=1e-3).reciprocal()


@torch.no_grad()
def set_aux_scale(draft: DraftHead, scale: torch.Tensor, keep_function: bool = False) -> None:
    """Install a per-dimension feature scale; with ``keep_function`` fc is rescaled so that
    fc(aux · scale) computes what it did before (e.g. after a pass-through initialisation).
    ``scale`` comes from features wherever they are (cache shards: the host) and moves to the draft."""
    if not draft.cfg.aux_scale:
        raise LyannaError("this draft has no feature scale (draft.aux_scale is off)")
    scale = scale.to(draft.aux_scale.device)
    if keep_function:
        draft.fc.weight.mul_((draft.aux_scale / scale).to(draft.fc.weight)[None, :])
    draft.aux_scale.copy_(scale)


def init_from_target(draft: DraftHead, target, lm_head: bool = False, layer: int | None = None,
                     fc: str = "random") -> DraftHead:
    """Apply the chosen initialisations (see the module docstring); returns ``draft``."""
    if fc not in FC_INITS:
        raise LyannaError(f"draft.init.fc must be one of {FC_INITS}, not {fc!r}")
    if lm_head:
        init_lm_head(draft, target)
    if layer is not None:
        init_layer(draft, target, layer)
    if fc == "top_layer":
        init_fc_top_layer(draft)
    return draft
