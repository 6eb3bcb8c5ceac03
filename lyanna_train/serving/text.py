"""Tokens -> text as they arrive, cut at the first stop string.

The whole completion is decoded again at every update and only what is settled goes out:
not a trailing incomplete character (U+FFFD, a multi-byte character split over tokens)
and not a tail that could still become a stop string. So streamed pieces always join to
exactly the text a whole response gives, and a stop string never leaks out half-sent.
"""

from __future__ import annotations


class StopText:
    """Text of one completion; ``add`` returns the new settled text, ``stopped`` once a stop
    string was found (the text ends just before it; OpenAI leaves the stop string out)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters handed out
        self.stopped = False

    def add(self, tokens: list[int]) -> str:
        if self.stopped or not tokens:
            return ""
        self.ids += tokens
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        longest = max((len(s) for s in self.stops), default=0)
        start = max(0, self.sent - longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.text = self.text[:min(hits)]
            return self._take(len(self.text))
        settled = len(self.text.rstrip("\ufffd"))
        return self._take(settled - self._held(settled))

    def finish(self) -> str:
        """The rest, held-back tail included (the completion ended without a stop string)."""
        return self._take(len(self.text))

    def _held(self, end: int) -> int:
        """Length of the longest tail of text[:end] that is a proper prefix of a stop string."""
        for size in range(min(end, max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            tail = self.text[end - size:end]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0

    def _take(self, end: int) -> str:
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out
