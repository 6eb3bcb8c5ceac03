"""Records of any supported schema -> one normalised :class:`Document`.

Schemas: ShareGPT (``conversations`` of ``from``/``value``), OpenAI (``messages`` of
``role``/``content``, content may be a list of text parts), plain ``text``, and
prompt/completion pairs (``prompt`` + ``completion``/``response``/``canonical_solution``,
e.g. HumanEval), and user-only ``turns`` lists (MT-Bench questions). Roles are mapped onto
``system``/``user``/``assistant``; anything that cannot be mapped is reported as a
:class:`Skip` with its reason, never dropped silently. An assistant turn's optional
``token_ids`` (see :data:`TOKEN_IDS`) are kept with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "model": "assistant",
}
# An assistant turn may carry the ids the target emitted for its content (regeneration writes
# them on the turn it recorded features for): a decoded answer can tokenize otherwise (the
# target writes "\n\n" + "1" where the tokenizer reads "\n", "\n1"), and a draft should learn
# the ids the target emits, not a re-tokenization it never sees while serving.
TOKEN_IDS = "token_ids"
_COMPLETION_KEYS = ("completion", "response", "canonical_solution", "output")


@dataclass
class Document:
    """One unit of the corpus: a conversation (``messages``) or raw ``text``.

    ``index`` is the position in the corpus stream (malformed records included), which
    makes sharding and the held-out split independent of how work is distributed.
    """

    index: int
    messages: Optional[list[dict]] = None
    text: Optional[str] = None

    @property
    def is_conversation(self) -> bool:
        return self.messages is not None


@dataclass(frozen=True)
class Skip:
    """A record that yields no document, and why (counted and reported)."""

    index: int
    reason: str
    malformed: bool = False  # unparseable input (an error under --strict), not just unusable


def _content_text(content) -> Optional[str]:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text"]
        return "".join(parts)
    return None


def _messages(turns, role_key: str, content_key: str) -> Union[list[dict], str]:
    if not isinstance(turns, list):
        return f"'{role_key}' turns are not a list"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return "a turn is not an object"
        raw_role = turn.get(role_key)
        role = ROLE_ALIASES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            return f"unknown role {raw_role!r}"
        text = _content_text(turn.get(content_key))
        if text is None:
            return f"turn without text '{content_key}'"
        message = {"role": role, "content": text}
        if TOKEN_IDS in turn:
            ids = turn[TOKEN_IDS]
            if role != "assistant" or not isinstance(ids, list) or not ids \
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                return f"'{TOKEN_IDS}' must be a non-empty list of token ids on an assistant turn"
            message[TOKEN_IDS] = ids
        messages.append(message)
    if not messages:
        return "empty conversation"
    return messages


def to_document(index: int, record) -> Union[Document, Skip]:
    """Normalise one parsed record; return :class:`Skip` with a reason if impossible."""
    if isinstance(record, str):
        return Document(index, text=record)
    if not isinstance(record, dict):
        return Skip(index, "record is not an object")
    if "conversations" in record:
        result = _messages(record["conversations"], "from", "value")
    elif "messages" in record:
        result = _messages(record["messages"], "role", "content")
    elif isinstance(record.get("turns"), list) and all(isinstance(t, str) for t in record["turns"]):
        # evaluation prompt sets (MT-Bench): user turns only, answers come from the model
        result = [{"role": "user", "content": t} for t in record["turns"]] or "empty conversation"
    elif isinstance(record.get("text"), str):
        return Document(index, text=record["text"])
    elif isinstance(record.get("prompt"), str) and any(isinstance(record.get(k), str) for k in _COMPLETION_KEYS):
        answer = next(record[k] for k in _COMPLETION_KEYS if isinstance(record.get(k), str))
        result = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": answer}]
    else:
        return Skip(index, "no 'conversations', 'messages', 'text' or 'prompt' field")
    if isinstance(result, str):
        return Skip(index, result)
    return Document(index, messages=result)
