"""Render conversations with the tokenizer's own chat template and find assistant spans.

The spans are derived from the template itself, so any model's template works
without per-model offsets: for assistant turn *i*, render the conversation up to the
turn with the generation prompt (``P``) and up to and including it (``Q``); when
``Q`` extends ``P`` the assistant text is ``Q[len(P):]``, cut just after the first special
token that follows the content (the end-of-turn token the target must generate;
whatever the template appends after it, like a newline, is not generated).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LyannaError


class TemplateRenderError(Exception):
    """The template refused a conversation (e.g. roles that do not alternate)."""


@dataclass(frozen=True)
class RenderedConversation:
    text: str
    spans: list[tuple[int, int]]  # [start, end) character spans of assistant tokens
    unaligned_turns: int = 0  # assistant turns whose span could not be derived
    turns: tuple[int, ...] = ()  # the message each span belongs to (its index in ``messages``)


def _compiled_template(template):
    """transformers' own compiled (and cached) jinja template, when its helper is available."""
    if not isinstance(template, str):
        return None
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None
    return _compile_jinja_template(template)


class ChatRenderer:
    """Chat-template rendering with assistant spans for one tokenizer."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise LyannaError(
                "the tokenizer has no chat template, so assistant turns cannot be found "
                "(use --count all, or a tokenizer that ships a chat template)"
            )
        self.tokenizer = tokenizer
        self._compiled = _compiled_template(tokenizer.chat_template)
        self._template_kwargs = dict(tokenizer.special_tokens_map)  # what apply_chat_template passes
        specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
        specials |= set(tokenizer.all_special_tokens)
        self._specials = sorted((s for s in specials if s), key=len, reverse=True)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for plain ``{role, content}`` string messages.

        Renders the compiled template directly (about half the cost of
        ``apply_chat_template``, whose per-call message normalisation plain messages do
        not need); any failure goes through ``apply_chat_template`` for its own error.
        """
        if self._compiled is not None:
            try:
                return self._compiled.render(messages=messages, tools=None, documents=None,
                                             add_generation_prompt=add_generation_prompt, **self._template_kwargs)
            except Exception:  # noqa: BLE001 - re-rendered below for the public error message
                pass
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as err:  # noqa: BLE001 - jinja raises arbitrary template errors
            raise TemplateRenderError(f"chat template: {str(err).splitlines()[0][:120]}") from None

    def _end_of_turn(self, suffix: str, content: str) -> int:
        """Length of ``suffix`` up to and including the end-of-turn special token."""
        start = suffix.find(content) + len(content) if content and content in suffix else 0
        hits = [(suffix.find(s, start), -len(s)) for s in self._specials]
        hits = [(pos, neg) for pos, neg in hits if pos >= 0]
        if not hits:
            return len(suffix)
        pos, neg = min(hits)
        return pos - neg

    def render_with_spans(self, messages: list[dict]) -> RenderedConversation:
        """Render ``messages`` and locate every assistant turn's tokens as character spans."""
        text = self.render(messages)
        spans, turns, unaligned = [], [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            upto = self.render(messages[: i + 1])
            if not text.startswith(upto):  # the template re-renders earlier turns later on
                unaligned += 1
                continue
            before = self.render(messages[:i], add_generation_prompt=True) if i else None
            content = message["content"]
            if before is not None and upto.startswith(before):
                start = len(before)
            elif content and content in upto:  # e.g. a conversation that opens with the assistant
                start = upto.rfind(content)
            else:
                unaligned += 1
                continue
            end = start + self._end_of_turn(upto[start:], message["content"])
            if end > start:
                spans.append((start, end))
                turns.append(i)
        return RenderedConversation(text, spans, unaligned, tuple(turns))

    def _probe(self) -> tuple[str, str]:
        """An answer's rendered span and what the template writes after it, from a probe render."""
        probe = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
        rendered = self.render_with_spans(probe)
        if not rendered.spans:
            return "", ""
        start, end = rendered.spans[0]
        return rendered.text[start:end], rendered.text[end:]

    def end_of_turn_tokens(self) -> list[str]:
        """The special token(s) that close an assistant turn, found by a probe render."""
        span, _ = self._probe()
        return [s for s in self._specials if span.endswith(s)][:1]

    def closing_text(self) -> str:
        """What follows an answer's content when it is the conversation's last turn: the
        end-of-turn token and whatever the template appends after it (a newline, say)."""
        span, after = self._probe()
        return "".join(self.end_of_turn_tokens()) + after


def token_range(encoding, start: int, end: int) -> tuple[int, int]:
    """Tokens whose first character lies in ``[start, end)``, as a slice ``[a, b)``."""
    s = start
    a = encoding.char_to_token(s)
    while a is None and s < end - 1:  # characters a normaliser dropped map to no token
        s += 1
        a = encoding.char_to_token(s)
    e = end - 1
    b = encoding.char_to_token(e)
    while b is None and e > s:
        e -= 1
        b = encoding.char_to_token(e)
    if a is None or b is None:
        return 0, 0
    if encoding.token_to_chars(a)[0] < start:  # straddles the start: begun before the span
        a += 1
    return a, max(a, b + 1)
