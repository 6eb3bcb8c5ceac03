"""Prompts to decode: the embedded MT-Bench and HumanEval sets or a user's file, and how
they become token ids (the tokenizer's chat template)."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import LyannaError

EMBEDDED_PROMPTS = ("mtbench", "humaneval", "tasks")
_TEXT_KEYS = ("prompt", "text", "instruction")


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: tuple[str, ...]  # user turns; turn t is asked after the answers to turns < t


def _question(rec, path: Path, lineno: int) -> Question:
    turns = rec.get("turns") if isinstance(rec, dict) else None
    if turns is None and isinstance(rec, dict):
        turns = next(([rec[k]] for k in _TEXT_KEYS if isinstance(rec.get(k), str)), None)
    if not turns or not isinstance(turns, list) or not all(isinstance(t, str) and t.strip() for t in turns):
        raise LyannaError(f'{path}:{lineno}: expected an object with "turns" (non-empty strings) '
                          f'or a "prompt"/"text"/"instruction" string')
    qid = rec.get("question_id", rec.get("task_id", lineno))
    return Question(qid, str(rec.get("category") or path.name.split(".")[0]), tuple(turns))


def read_questions(source: str, limit: int | None = None, categories: tuple[str, ...] = ()) -> list[Question]:
    """Questions from ``mtbench``/``humaneval`` (embedded), a JSONL(.gz) file, or a .txt file
    (one single-turn prompt per blank-line-separated block). A malformed line stops with file:line."""
    from ..embedded import EMBEDDED_CORPORA

    path = EMBEDDED_CORPORA[source].path() if source in EMBEDDED_PROMPTS and not Path(source).exists() \
        else Path(source)
    if not path.is_file():
        raise LyannaError(f"prompt file not found: {source} (or use {', '.join(EMBEDDED_PROMPTS)})")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise LyannaError(f"cannot read {path}: {err}") from None
    if path.suffix == ".txt":
        blocks = [b.strip() for b in text.split("\n\n") if b.strip()]
        questions = [Question(i + 1, path.stem, (b,)) for i, b in enumerate(blocks)]
    else:
        questions = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as err:
                    raise LyannaError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
                questions.append(_question(rec, path, lineno))
    if not questions:
        raise LyannaError(f"{path} holds no prompts")
    if categories:  # e.g. MT-Bench's writing, roleplay and humanities, where prompt lookup finds little
        known = sorted({q.category for q in questions})
        if unknown := [c for c in categories if c not in known]:
            raise LyannaError(f"{path}: no questions in categories {unknown} (categories: {', '.join(known)})")
        questions = [q for q in questions if q.category in categories]
    if not limit or limit >= len(questions):
        return questions
    # spread over the whole set, not its head: MT-Bench is ordered by category
    return [questions[i * len(questions) // limit] for i in range(limit)]


def render_prompt(tokenizer, messages: list[dict], chat: bool = True) -> list[int]:
    """Prompt ids: the tokenizer's chat template with the generation prompt, or (``chat`` False
    or no template) the contents joined by blank lines, tokenized as plain text."""
    if chat and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]
