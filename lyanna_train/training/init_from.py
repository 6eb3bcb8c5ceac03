"""Fine-tune a head that already exists: ``lyanna-train draft.init_from=DIR``.

DIR is an export (``lyanna`` or ``eagle3``), including heads imported from speculators,
SpecForge or EAGLE with ``lyanna-export import``. The head must have been made for this
run's target and tokenizer (the export's fingerprints are checked), and its shapes, layer
ids and EAGLE-3 variants are kept. Its vocabulary map is kept too (``draft.init_vocab=keep``):
other toolkits' fine-tuning scripts rebuild the map from their own data and silently lose
the head's LM head rows. ``rebuild`` takes the run's own hot vocabulary instead and carries
over the rows of every token the two maps share. The state pool and α-gate follow the run's
``draft.*`` settings (a gate the export had is kept when its width matches).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch

from ..errors import LyannaError
from ..models.draft_head import DraftHead

INIT_VOCABS = ("keep", "rebuild")
_SHAPES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def _check_run_settings(cfg, head_cfg, where: Path) -> None:
    """Settings that would silently reshape the head are refused, naming the field."""
    for name in _SHAPES:
        wanted = getattr(cfg.draft, name)
        if wanted is not None and wanted != getattr(head_cfg, name):
            raise LyannaError(f"draft.{name}={wanted} but the head in {where} has {getattr(head_cfg, name)}: "
                              f"leave draft.{name} unset with draft.init_from")
    if cfg.target.aux_layers is not None and tuple(cfg.target.aux_layers) != tuple(head_cfg.aux_layer_ids):
        raise LyannaError(f"target.aux_layers={list(cfg.target.aux_layers)} but the head in {where} reads layers "
                          f"{list(head_cfg.aux_layer_ids)}: leave target.aux_layers unset with draft.init_from")


def _carry_over(new: DraftHead, head: DraftHead) -> int:
    """Copy every tensor the two heads share; the LM head row by row, by target token. Returns rows kept."""
    theirs, ours = head.state_dict(), new.state_dict()
    with torch.no_grad():
        for name, tensor in theirs.items():
            if name in ("d2t", "t2d", "lm_head.weight") or name not in ours or ours[name].shape != tensor.shape:
                continue
            ours[name].copy_(tensor)
        row_of = {int(t): r for r, t in enumerate(head.hot_ids.tolist())}
        pairs = [(i, row_of[int(t)]) for i, t in enumerate(new.hot_ids.tolist()) if int(t) in row_of]
        if pairs:
            mine, old = (torch.tensor(p) for p in zip(*pairs))
            # the exported head sits on the target's device, the new one is built on the host
            new.lm_head.weight[mine] = head.lm_head.weight[old].to(new.lm_head.weight)
    return len(pairs)


def draft_from_export(cfg, target, tokenizer, run_hot_ids: Callable[[], torch.Tensor],
                      say: Callable = print) -> tuple[DraftHead, torch.Tensor, tuple]:
    """(draft to train, its hot ids, the target layers it reads) from ``cfg.draft.init_from``."""
    from ..export.reader import load_exported

    where = Path(cfg.draft.init_from)
    if cfg.draft.init_vocab not in INIT_VOCABS:
        raise LyannaError(f"draft.init_vocab must be one of {', '.join(INIT_VOCABS)}, not {cfg.draft.init_vocab!r}")
    head, manifest = load_exported(where, target, tokenizer)
    head = head.float()
    _check_run_settings(cfg, head.cfg, where)
    hot_ids = head.hot_ids.cpu() if cfg.draft.init_vocab == "keep" else run_hot_ids()
    d = cfg.draft
    draft_cfg = dataclasses.replace(
        head.cfg, draft_vocab_size=len(hot_ids), pool_size=d.pool_size, pool_threshold=d.pool_threshold,
        alpha_max=d.alpha_max, gate_hidden=d.gate_hidden, other_bucket=cfg.loss.out_of_vocab == "other")
    torch.manual_seed(cfg.train.seed)
    draft = DraftHead(draft_cfg, hot_ids, target.get_input_embeddings().weight)
    kept = _carry_over(draft, head)
    source = (manifest.get("imported") or {}).get("layout") or manifest.get("format")
    say(f"draft initialised from {where} ({source}): vocabulary map "
        + (f"kept ({len(hot_ids)} tokens; hotvocab.* unused)" if d.init_vocab == "keep"
           else f"rebuilt from the run's hot vocabulary ({kept} of {len(hot_ids)} LM head rows carried over)"))
    return draft, hot_ids, tuple(head.cfg.aux_layer_ids)
