"""What serving needs, loaded together: the target, its tokenizer and an exported draft.

The draft's export names the target it was made for; another one can be given, and the
export reader then checks its fingerprint. Used by ``lyanna-generate``, ``lyanna-bench``
and the scripts in ``bench/``.
"""

from __future__ import annotations

import torch

from ..errors import LyannaError


def load_models(draft_dir: str | None, target_spec: str | None, need_draft: bool = True, threads: int | None = None):
    """(target, tokenizer, draft or None): the target is the one the draft was exported for
    unless ``target_spec`` says otherwise (the export reader then checks its fingerprint). The
    target goes to the GPU where there is one (the draft follows it). Tuning for the machine
    is the caller's next step (:func:`.cpu_tuning.tune`)."""
    from transformers.utils import logging as hf_logging

    from ..export.reader import load_exported, read_manifest
    from ..target.precision import default_device_type
    from ..target.source import load_tokenizer
    from ..target.model import load_target_model

    if threads is not None:
        if threads < 1:
            raise LyannaError("--threads must be at least 1")
        torch.set_num_threads(threads)
    if draft_dir is None and target_spec is None:
        raise LyannaError("give --draft EXPORT_DIR (or --target SPEC to decode with prompt lookup only)")
    manifest = read_manifest(draft_dir) if draft_dir is not None else {}
    spec = target_spec or (manifest.get("target") or {}).get("name")
    if not spec:
        raise LyannaError(f"{draft_dir}/manifest.json does not name its target: pass --target")
    hf_logging.disable_progress_bar()  # "Loading weights" would interleave with the generated text
    try:
        tokenizer, target = load_tokenizer(spec), load_target_model(spec).to(default_device_type())
    finally:
        hf_logging.enable_progress_bar()
    draft = load_exported(draft_dir, target, tokenizer)[0] if draft_dir is not None and need_draft else None
    return target, tokenizer, draft


def without_pool(draft):
    """The same head with its state pool and α-gate off (the design's EAGLE baseline): a
    shallow copy sharing every layer, so the linear forms tuned for ``draft``
    (:mod:`.small_linear`) serve it too. Decoding keys the pool off ``draft.gate``."""
    import copy
    import dataclasses

    if draft is None or draft.gate is None:
        return draft
    bare = copy.copy(draft)
    bare._modules = dict(draft._modules)  # copy.copy shares the dict: the original keeps its gate
    bare._modules["gate"] = None
    bare.cfg = dataclasses.replace(draft.cfg, pool_size=0)
    return bare
