"""The Lyanna draft head: EAGLE-3 layout, hot-vocabulary LM head, state pool and α-gate.

Anchor *t* of a sequence x_0..x_{T-1}: step 0 reads the target's fused features at t
(``fc`` of three layers) and the embedding of x_{t+1}, and predicts x_{t+2}; step *j*
reads the fused state of step *j-1* and the embedding of x_{t+1+j} at position t+j, and
predicts x_{t+2+j}. After the decoder layer, the state is fused with the most similar
pooled step-0 state (cosine ≥ threshold) by the α-gate, then scored by the hot-vocabulary
LM head; the fused state is what the next step reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from .alpha_gate import AlphaGate, fuse
from .config import DraftConfig
from .layer import DraftDecoderLayer
from .state_pool import retrieve_causal


@dataclass
class StepOutput:
    logits: torch.Tensor  # [B, T, draft_vocab (+1 with the other bucket)]
    hidden: torch.Tensor  # [B, T, H] fused state (the next step reads ``DraftHead.carry`` of it)
    alpha: torch.Tensor  # [B, T] α used (0 where the pool missed)
    hit: torch.Tensor  # [B, T] bool: a pooled state passed the threshold


class DraftHead(nn.Module):
    def __init__(self, cfg: DraftConfig, hot_ids: torch.Tensor, target_embeddings: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        features = cfg.num_aux_layers * cfg.target_hidden_size
        self.input_norm = LlamaRMSNorm(features, eps=cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList(LlamaRMSNorm(cfg.target_hidden_size, eps=cfg.rms_norm_eps)
                                     for _ in range(cfg.num_aux_layers)) if cfg.fc_norm else None
        self.fc = nn.Linear(features, cfg.hidden_size, bias=False)
        self.embed_proj = (nn.Linear(cfg.target_hidden_size, cfg.hidden_size, bias=False)
                           if cfg.hidden_size != cfg.target_hidden_size else None)
        self.midlayer = DraftDecoderLayer(cfg)
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size + int(cfg.other_bucket), bias=False)
        self.gate = AlphaGate(cfg.hidden_size, cfg.gate_hidden, cfg.alpha_max) if cfg.pool_enabled else None
        hot_ids = torch.as_tensor(hot_ids, dtype=torch.int64)
        if len(hot_ids) != cfg.draft_vocab_size:
            raise ValueError(f"{len(hot_ids)} hot ids for draft_vocab_size {cfg.draft_vocab_size}")
        self.register_buffer("d2t", hot_ids - torch.arange(len(hot_ids)))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool).scatter_(0, hot_ids, True))
        if cfg.aux_scale:  # set from data by the trainer (training.setup); 1 = the plain EAGLE-3 fc
            self.register_buffer("aux_scale", torch.ones(cfg.num_aux_layers * cfg.target_hidden_size))
        # The target's own embeddings, frozen and not part of the draft's weights: a reference
        # to the target's table, not a copy (~1 GB in bf16 for Llama-3-8B).
        self.register_buffer("embed_weight", target_embeddings.detach(), persistent=False)

    @property
    def hot_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def fuse_features(self, aux: torch.Tensor) -> torch.Tensor:
        """Target features [..., L·Ht] -> the step-0 state [..., H] (``fc``, after the optional norms)."""
        x = aux.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], -1)
        if self.cfg.aux_scale:
            x = x * self.aux_scale.to(x.dtype)
        return self.fc(x)

    def carry(self, fused: torch.Tensor) -> torch.Tensor:
        """The state the next draft step reads: the fused state, or its normed form (``norm_output``)."""
        return self.norm(fused) if self.cfg.norm_output else fused

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        e = nn.functional.embedding(input_ids, self.embed_weight).to(self.fc.weight.dtype)
        return self.embed_proj(e) if self.embed_proj is not None else e

    def pool_fuse(self, current: torch.Tensor, similarity: torch.Tensor, retrieved: torch.Tensor):
        """(fused [B, T, H], α [B, T], hit [B, T]) from a retrieval result."""
        hit = similarity >= self.cfg.pool_threshold
        alpha = self.gate(current, retrieved, similarity.clamp(min=-1.0)) * hit
        return fuse(current, retrieved, alpha), alpha, hit

    def score(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hot-vocabulary logits of a (fused) state: [..., H] -> [..., V_hot(+1)]."""
        return self.lm_head(self.norm(hidden))

    def forward_unrolled(self, aux: torch.Tensor, input_ids: torch.Tensor, steps: int,
                         valid: torch.Tensor | None = None) -> list[StepOutput]:
        """Training forward with training-time test: aux [B, T, 3·Ht], input_ids [B, T],
        ``valid`` [B, T] bool (padding excluded from the pool) -> one StepOutput per step.

        Anchors whose input token lies past the end see a zero embedding; their losses are
        masked by the caller (no target token exists for them).
        """
        b, t, _ = aux.shape
        embeds = self.embed(input_ids)
        positions = torch.arange(t, device=aux.device).expand(b, t)
        causal = torch.ones(t, t, dtype=torch.bool, device=aux.device).tril()
        hidden = self.fuse_features(aux)
        keys, values, outputs, step0 = [], [], [], None
        for j in range(steps):
            shifted = torch.zeros_like(embeds)
            shifted[:, : max(t - 1 - j, 0)] = embeds[:, 1 + j:]
            q, k, v = self.midlayer.qkv(shifted, hidden, positions + j)
            keys.append(k)
            values.append(v)
            current = self.midlayer.finish(hidden, self.midlayer.self_attn.attend_unrolled(q, keys, values, causal))
            if self.gate is not None:
                if step0 is None:
                    step0 = current.detach()  # the pool is memory: no gradient through it
                sim, retrieved = retrieve_causal(current, step0, self.cfg.pool_size, valid)
                fused, alpha, hit = self.pool_fuse(current, sim, retrieved)
            else:
                fused = current
                alpha = torch.zeros(b, t, device=aux.device)
                hit = torch.zeros(b, t, dtype=torch.bool, device=aux.device)
            outputs.append(StepOutput(self.score(fused), fused, alpha, hit))
            hidden = self.carry(fused)
        return outputs

    def forward_cached(self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                       keys: torch.Tensor, values: torch.Tensor, start: int, mask: torch.Tensor) -> torch.Tensor:
        """Serving forward of N new entries: hidden [B, N, H] (``fc`` output or a fused
        state), input_ids / positions [B, N], the preallocated cache keys/values
        [B, nkv, capacity, d] whose slots 0..start-1 the entries may attend to, mask
        [B, 1, N, start + N] bool -> state before pool fusion [B, N, H]. The new keys and
        values are written in place at slots start..start+N-1; attention reads a view."""
        q, k, v = self.midlayer.qkv(self.embed(input_ids), hidden, positions)
        end = start + k.shape[2]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        attn = self.midlayer.self_attn.attend_cached(q, keys[:, :, :end], values[:, :, :end], mask)
        return self.midlayer.finish(hidden, attn)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
