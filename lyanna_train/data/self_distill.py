"""Self-distillation: regenerate assistant turns with the target itself.

A draft learns to predict what *the target* says, so training on the target's own
answers (rather than another model's) raises acceptance. Conversations are processed in
batches, turn by turn: each assistant turn is regenerated from the conversation so far
(user turns kept, earlier assistant turns already regenerated), with left-padded
batched ``generate``. Output is ShareGPT-format JSONL, appended and flushed per batch,
so an interrupted run resumes by skipping the ids already written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from ..errors import LyannaError
from .chat_template import ChatRenderer, TemplateRenderError

_TO_SHAREGPT = {"user": "human", "assistant": "gpt", "system": "system"}


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    max_prompt_tokens: int = 1024  # longer prompts end the conversation there
    max_turns: int = 1  # assistant turns regenerated per conversation (later ones are cut)
    batch_size: int = 8


def done_ids(path: Path) -> set[str]:
    """Ids already in an output file; a torn last line (interrupted write) is cut off."""
    if not path.exists():
        return set()
    ids, good_bytes = set(), 0
    with open(path, "rb") as fh:
        for line in fh:
            try:
                ids.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                break
            good_bytes += len(line)
    if good_bytes < path.stat().st_size:
        with open(path, "r+b") as fh:
            fh.truncate(good_bytes)
    return ids


class SelfDistiller:
    """Regenerates assistant turns of conversations with a target model."""

    def __init__(self, model, tokenizer, settings: GenerationSettings = GenerationSettings()):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.renderer = ChatRenderer(tokenizer)
        eot = [tokenizer.convert_tokens_to_ids(t) for t in self.renderer.end_of_turn_tokens()]
        self.stop_ids = sorted({i for i in eot + [tokenizer.eos_token_id] if i is not None})
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]

    def _generate(self, prompts: list[list[int]]) -> list[list[int]]:
        longest = max(map(len, prompts))
        ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(prompts), longest), dtype=torch.int64)
        for row, p in enumerate(prompts):  # left padding: every prompt ends at the same column
            ids[row, longest - len(p):] = torch.tensor(p)
            mask[row, longest - len(p):] = 1
        s = self.settings
        sampling = dict(do_sample=True, temperature=s.temperature, top_p=s.top_p) if s.temperature > 0 else dict(do_sample=False)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=s.max_new_tokens,
                                      eos_token_id=self.stop_ids, pad_token_id=self.pad_id, **sampling)
        answers = []
        for row in out[:, longest:].tolist():
            cut = next((k for k, t in enumerate(row) if t in self.stop_ids), len(row))
            answers.append(row[:cut])
        return answers

    def regenerate(self, batch: list[tuple[str, list[dict]]]) -> Iterator[tuple[str, list[dict], int]]:
        """Yield ``(id, messages, new_tokens)`` with assistant turns replaced by the target's."""
        convs = {cid: list(msgs) for cid, msgs in batch}
        out: dict[str, list[dict]] = {cid: [] for cid in convs}
        cursor = {cid: 0 for cid in convs}
        new_tokens = {cid: 0 for cid in convs}
        active = set(convs)
        for _ in range(self.settings.max_turns):
            prompts, owners = [], []
            for cid in sorted(active):
                msgs = convs[cid]
                while cursor[cid] < len(msgs) and msgs[cursor[cid]]["role"] != "assistant":
                    out[cid].append(msgs[cursor[cid]])
                    cursor[cid] += 1
                if cursor[cid] >= len(msgs) or not out[cid]:
                    active.discard(cid)
                    continue
                try:
                    text = self.renderer.render(out[cid], add_generation_prompt=True)
                except TemplateRenderError:
                    active.discard(cid)
                    continue
                ids = self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
                if len(ids) > self.settings.max_prompt_tokens:
                    active.discard(cid)
                    continue
                prompts.append(ids)
                owners.append(cid)
            if not prompts:
                break
            for cid, answer in zip(owners, self._generate(prompts)):
                out[cid].append({"role": "assistant", "content": self.tokenizer.decode(answer)})
                new_tokens[cid] += len(answer)
                cursor[cid] += 1
        for cid in convs:
            if any(m["role"] == "assistant" for m in out[cid]):
                while out[cid] and out[cid][-1]["role"] != "assistant":  # end on an answer
                    out[cid].pop()
                yield cid, out[cid], new_tokens[cid]


def to_sharegpt(cid: str, messages: list[dict]) -> dict:
    return {"id": cid, "conversations": [{"from": _TO_SHAREGPT[m["role"]], "value": m["content"]} for m in messages]}


def append_jsonl(path: Path, records: Iterable[dict]) -> None:
    """Append whole lines and fsync, so a crash leaves at most one torn line (cut on resume)."""
    with open(path, "a", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def check_output_path(path: Path) -> None:
    if path.exists() and path.is_dir():
        raise LyannaError(f"--out {path} is a directory; give a .jsonl file")
    path.parent.mkdir(parents=True, exist_ok=True)
