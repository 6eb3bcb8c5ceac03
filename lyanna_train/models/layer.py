"""The draft's single decoder layer (EAGLE-3 layout) and its two attention modes.

The layer reads the normed token embedding and the normed incoming state side by side
([e; h], 2·H wide) and adds its output to the incoming state. Names follow SGLang's and
vLLM's ``LlamaForCausalLMEagle3`` (``midlayer.*``) so exported weights load there.

Attention runs either *unrolled* (training-time test: step *j* at anchor *t* attends to
the step-0 keys of positions ≤ t and to its own keys of steps 1..j at the same anchor,
which is what a chain draft sees at serving time) or *cached* (serving: explicit keys
and a boolean mask). Both compute the same softmax; a parity test checks it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from .config import DraftConfig


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, n_kv, T, d] -> [B, n_kv * groups, T, d] (grouped-query attention)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.scale = cfg.head_dim ** -0.5
        self.q_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, 2H] -> q [B, nh, T, d], k/v [B, nkv, T, d] with rotary applied to q, k."""
        b, t, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_proj(x).view(b, t, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """[B, nh, T, d] -> [B, T, H]."""
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))

    def attend_unrolled(self, q, keys: list, values: list, causal: torch.Tensor) -> torch.Tensor:
        """Training-time-test attention. keys[0]/values[0]: step-0 [B, nkv, T, d] at every
        position (attended causally via ``causal`` [T, T] bool); keys[i>0]: step-i keys at
        the same anchor (attended on the diagonal only)."""
        k0, v0 = repeat_kv(keys[0], self.groups), repeat_kv(values[0], self.groups)
        scores = [(q @ k0.transpose(-1, -2) * self.scale).masked_fill(~causal, float("-inf"))]
        scores += [(q * repeat_kv(k, self.groups)).sum(-1, keepdim=True) * self.scale for k in keys[1:]]
        probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        t = k0.shape[2]
        out = probs[..., :t] @ v0
        for i, v in enumerate(values[1:]):
            out = out + probs[..., t + i: t + i + 1] * repeat_kv(v, self.groups)
        return out

    def attend_cached(self, q, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Serving attention over explicit keys k/v [B, nkv, S, d] (a view of the cache: the
        query heads share them in place, nothing is repeated) with ``mask`` [B|1, 1|nh, T, S] bool."""
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                                                enable_gqa=self.groups > 1)


class DraftDecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        lcfg = cfg.llama_config()
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(lcfg)
        self.rotary = LlamaRotaryEmbedding(lcfg)
        self.norm_before_residual = cfg.norm_before_residual

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """embeds, hidden [B, T, H]; positions [B, T] -> (q, k, v)."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        cos, sin = self.rotary(x, positions)
        return self.self_attn.project(x, cos, sin)

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + attention output, then the MLP block: [B, T, H]."""
        residual = self.hidden_norm(hidden) if self.norm_before_residual else hidden
        h = residual + self.self_attn.output(attn)
        return h + self.mlp(self.post_attention_layernorm(h))
