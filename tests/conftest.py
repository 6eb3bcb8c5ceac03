"""Shared fixtures: the embedded SmolLM2 tokenizer (loaded once), a second chat template, corpora."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# DeepSpeed JIT-builds a CPU communication op into TORCH_EXTENSIONS_DIR (default: one folder in
# ~/.cache shared by every checkout); each virtual environment's include paths differ, so
# checkouts sharing a machine rebuild it for each other (minutes each). One folder per venv.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
# ...with the environment's own ninja first on PATH, as `make install` built it: a system ninja
# of another version hashes build commands differently, and the op would be rebuilt each run.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.prefix) / "bin"), os.environ.get("PATH", "")])
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    # pytest-xdist workers share the cores: each one's torch (and every process it starts)
    # gets its share of them, as OpenMP threads waiting on a busy core spin instead of working.
    _THREADS = max(1, len(os.sched_getaffinity(0)) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
if not torch.cuda.is_available():
    # Triton kernels run on the CPU through its interpreter, which must be chosen before
    # triton is first imported (transformers imports it): here, before any test module.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A Llama-3-style template (headers, <|im_end|> as end-of-turn, nothing after it), so mask
# derivation is checked on a template that differs from SmolLM2's ChatML.
HEADER_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}<|endoftext|>\n\n{{ m['content'] | trim }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant<|endoftext|>\n\n{% endif %}"
)


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from intra-op threads, and with the other core busy
    (a benchmark, a parallel test run) OpenMP's spin-waiting makes them ~40x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from lyanna_train.target.source import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="session")
def header_template_dir(smollm2_tokenizer, tmp_path_factory) -> Path:
    """The SmolLM2 tokenizer saved with :data:`HEADER_TEMPLATE` as its chat template."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("header-template-tokenizer")
    smollm2_tokenizer.save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = HEADER_TEMPLATE
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def sharegpt_records() -> list[dict]:
    """The first 60 ShareGPT conversations that open with a user turn, plus hand-made edge cases."""
    from lyanna_train.data.json_stream import iter_json_array
    from lyanna_train.embedded import EMBEDDED_CORPORA

    records = []
    for rec in iter_json_array(EMBEDDED_CORPORA["sharegpt"].path()):
        conv = rec.get("conversations") or []
        if conv and conv[0]["from"] == "human" and len(records) < 60:
            records.append(rec)
        if len(records) >= 60:
            break
    records += [
        {"conversations": [{"from": "system", "value": "Be terse."}, {"from": "human", "value": "Ünïcödé 🚀 ok?"},
                           {"from": "gpt", "value": "  Yes — ✓ 東京.  "}]},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                      {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": ""}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "joined"}]},
                      {"role": "assistant", "content": "def f(x):\n    return x  # <|im_end|> inside text"}]},
    ]
    return records


def leaf_fields(cls, prefix: str = "") -> list[str]:
    """Every leaf field of the dataclass ``cls``, dotted, nested dataclasses walked: found
    apart from :func:`lyanna_train.ranges.rules`, so a test can hold the two against each other."""
    import dataclasses

    out = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out += leaf_fields(type(default), f"{prefix}{f.name}.") if dataclasses.is_dataclass(default) else [prefix + f.name]
    return out


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


DAMAGED = {  # corpus file -> the words the one-line refusal has (issue 24: each was a traceback)
    "truncated.jsonl.gz": "is truncated: the compressed stream ends before its end marker",
    "random.jsonl.gz": "is not valid gzip data",
    "corrupt.parquet": "is not a readable Parquet file",
}


def write_damaged(directory: Path, name: str, records) -> Path:
    """``name`` of :data:`DAMAGED` in ``directory``: a gzip cut in half, random bytes named .gz,
    or a Parquet file whose body is random bytes."""
    import gzip

    path = directory / name
    if name == "truncated.jsonl.gz":
        data = gzip.compress("".join(json.dumps(r) + "\n" for r in records * 50).encode())
        path.write_bytes(data[: len(data) // 2])
    elif name == "random.jsonl.gz":
        path.write_bytes(bytes(range(256)) * 16)
    else:
        path.write_bytes(b"PAR1" + bytes(range(256)) * 12 + b"PAR1")
    return path


@pytest.fixture(scope="session")
def tiny_llama_smollm2_vocab():
    """A tiny random Llama over the SmolLM2 vocabulary: real tokenizer, instant forward."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return LlamaForCausalLM(config).eval()


def _mount_tmpfs(options: str):
    """A fresh tmpfs with ``options`` (root on Linux only), or None where the machine does not allow it."""
    import subprocess
    import sys
    import tempfile

    if sys.platform != "linux" or os.geteuid() != 0:
        return None
    path = Path(tempfile.mkdtemp(prefix="lyanna-tmpfs-"))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        path.rmdir()
        return None
    return path


def _unmount(path: Path) -> None:
    import subprocess

    subprocess.run(["umount", "-l", str(path)], capture_output=True)
    path.rmdir()


@pytest.fixture
def small_disk():
    """A real 1 MiB disk (tmpfs) that fills up, or None where mounting is not allowed (then tests
    make the write raise ENOSPC themselves)."""
    path = _mount_tmpfs("size=1m,mode=1777")
    yield path
    if path is not None:
        _unmount(path)


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nothing can be written into: a read-only tmpfs as root, a mode-0555 folder
    otherwise; as root without mount rights, a 'directory' that is a regular file."""
    path = _mount_tmpfs("ro,size=64k")
    if path is not None:
        yield path
        _unmount(path)
        return
    if os.geteuid() != 0:
        path = tmp_path / "read-only"
        path.mkdir()
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    path = tmp_path / "not-a-directory"
    path.write_text("")
    yield path


def fit_draft(target, draft, sequences, steps: int, lr: float = 2e-3, threads: int | None = None):
    """Distil ``draft`` (in place, -> it in eval mode) on the target's own features over
    ``sequences`` (token-id lists: prompts with the target's greedy continuations), with
    the trainer's loss and 3 unroll steps, one sequence per step in turn. Memorising the
    continuations is the point: a lossless test then verifies draft nodes the target
    accepts, not only the target's own token. ``threads``: torch threads meanwhile (1 for
    tiny models, see ``one_thread``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return _fit(target, draft, sequences, steps, lr)
    finally:
        torch.set_num_threads(before)


def _fit(target, draft, sequences, steps: int, lr: float):
    from lyanna_train.data.features import FeatureExtractor, teacher_summary
    from lyanna_train.training.config import LossConf
    from lyanna_train.training.step import distill_loss

    extractor = FeatureExtractor(target, draft.cfg.aux_layer_ids)
    lm_weight = target.get_output_embeddings().weight.detach()
    batches = []
    for full in sequences:
        ids = torch.tensor([full])
        feats = extractor(ids)
        ones = torch.ones_like(ids, dtype=torch.bool)
        # the full-vocabulary summary once per sequence, as the feature cache keeps it: the
        # loss then reads it instead of forming the whole LM head's logits every step
        top1, lse = teacher_summary(feats.last[0].float(), lm_weight)
        batches.append({"aux": feats.aux.clone(), "last": feats.last.clone(), "input_ids": ids,
                        "loss_mask": ones, "valid": ones, "teacher_top1": top1[None], "teacher_lse": lse[None]})
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=lr)
    draft.train()
    for step in range(steps):
        loss, _ = distill_loss(draft, batches[step % len(batches)], lm_weight, LossConf(ttt_steps=3))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return draft.eval()


def once_per_run(tmp_path_factory, name: str, make):
    """``make()`` (a dict of tensors and plain values) computed once per test run: the first
    pytest-xdist worker to need it saves it beside the workers' temp folders, the others
    (waiting on its lock meanwhile) load it. For deterministic, seeded fits of several
    seconds that each worker would otherwise repeat."""
    folder = folder_once_per_run(tmp_path_factory, name, lambda out: torch.save(make(), out / "value.pt"))
    return torch.load(folder / "value.pt", weights_only=False)  # written by this run


def folder_once_per_run(tmp_path_factory, name: str, build) -> Path:
    """A folder ``build(folder)`` fills once per test run, shared by every pytest-xdist
    worker (it lies one level above their own temp folders; the others wait on its lock
    meanwhile): for pipelines whose outputs are files (a trained run, an export). Marked
    complete only once ``build`` returns, so a failed build is retried."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    done = folder.with_name(name + ".done")
    with FileLock(str(folder) + ".lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def smollm2_fitted(smollm2_tokenizer, tmp_path_factory):
    """The embedded SmolLM2 (fp32, torch's own linears), two prompts with its greedy
    continuations, and a draft head distilled (:func:`fit_draft`) on those continuations, so
    that its candidates ARE accepted. Fitted once per run: the first pytest-xdist worker to
    need it saves it beside the workers' temp folders, the others load it (a fit takes ~13 s
    on 2 Zen 4 cores: each worker fitting its own cost that again)."""
    from types import SimpleNamespace

    from lyanna_train.models.draft_head import DraftHead
    from lyanna_train.target.model import load_target_model

    target = load_target_model("smollm2")
    fitted = once_per_run(tmp_path_factory, "smollm2_fitted", lambda: _fit_smollm2(target, smollm2_tokenizer))
    draft = DraftHead(fitted["cfg"], fitted["hot"], target.get_input_embeddings().weight)
    draft.load_state_dict(fitted["state"])
    return SimpleNamespace(target=target, draft=draft.eval(), prompts=fitted["prompts"], refs=fitted["refs"])


def _fit_smollm2(target, tokenizer) -> dict:
    from lyanna_train.models.config import DraftConfig
    from lyanna_train.models.draft_head import DraftHead

    prompts = [tokenizer(text)["input_ids"] for text in ("The capital of France is", "def fibonacci(n):")]
    with torch.inference_mode():
        fulls = [target.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False)[0].tolist() for p in prompts]
    refs = [full[len(p):len(p) + 24] for p, full in zip(prompts, fulls)]
    torch.manual_seed(0)
    seen = sorted({t for full in fulls for t in full})
    rest = [t for t in torch.randperm(target.config.vocab_size).tolist() if t not in set(seen)]
    hot = torch.tensor(seen + rest[:2048 - len(seen)])
    cfg = DraftConfig.from_target(target.config, draft_vocab_size=2048, pool_size=128, pool_threshold=0.0,
                                  aux_layer_ids=(1, 14, 26))
    # 100 steps at 3e-3: 17 and 21 of 24 tokens drafted and accepted (150 at 2e-3: 20 and 18, 5 s more)
    draft = fit_draft(target, DraftHead(cfg, hot, target.get_input_embeddings().weight), fulls, steps=100, lr=3e-3)
    return {"cfg": cfg, "hot": hot, "state": draft.state_dict(), "prompts": prompts, "refs": refs}
