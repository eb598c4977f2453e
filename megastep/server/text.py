"""Token ids -> streamed text: incremental detokenization and stop strings.

Byte-level BPE can split one UTF-8 character across tokens (an emoji is often two or three), and
decoding such a prefix gives U+FFFD. `IncrementalDetokenizer` therefore decodes a short window of
recent tokens and only releases text once the window decodes without a trailing U+FFFD; at the end
of a request `flush()` releases whatever is left. `StopMatcher` holds back the longest tail of the
text that could still become a stop string, so no part of a stop string is ever streamed.
"""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never end inside a UTF-8 character."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0      # window start: text up to here has been released
        self._read = 0        # tokens up to here are covered by released text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            delta = new_text[len(prefix_text):]
            self._prefix = self._read
            self._read = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """The remaining text at the end of the stream (may end in U+FFFD if the model stopped
        inside a character: the bytes are genuinely incomplete)."""
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""


class StopMatcher:
    """Finds the first stop string in generated text and holds back possible partial matches."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0          # characters of `text` already released
        self.stopped = False

    def push(self, delta: str) -> str:
        """Add decoded text; return what can be released now. Sets `stopped` on a match."""
        if self.stopped or not delta:
            return ""
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        self.text += delta
        if self.stops:
            hits = [p for p in (self.text.find(s, start) for s in self.stops) if p >= 0]
            if hits:
                self.stopped = True
                end = min(hits)
                out = self.text[self.sent:end] if end > self.sent else ""
                self.text = self.text[:end]
                self.sent = len(self.text)
                return out
        hold = self._holdback()
        end = len(self.text) - hold
        if end <= self.sent:
            return ""
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def flush(self) -> str:
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out

    def _holdback(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best


class ReasoningSplitter:
    """Thinking-mode chat output: text before `</think>` is reasoning, the rest is the answer.
    A possible partial `</think>` at the end of the reasoning is held back until it resolves."""

    def __init__(self, end: str = "</think>") -> None:
        self.end = end
        self.in_reasoning = True
        self._buf = ""

    def push(self, text: str) -> tuple[str, str]:
        """-> (reasoning delta, content delta)."""
        if not self.in_reasoning:
            return "", text
        self._buf += text
        i = self._buf.find(self.end)
        if i >= 0:
            reasoning, content = self._buf[:i], self._buf[i + len(self.end):]
            self.in_reasoning = False
            self._buf = ""
            return reasoning, content
        hold = next((n for n in range(min(len(self.end) - 1, len(self._buf)), 0, -1)
                     if self._buf.endswith(self.end[:n])), 0)
        cut = len(self._buf) - hold
        reasoning, self._buf = self._buf[:cut], self._buf[cut:]
        return reasoning, ""

    def flush(self) -> tuple[str, str]:
        out, self._buf = self._buf, ""
        return (out, "") if self.in_reasoning else ("", out)
