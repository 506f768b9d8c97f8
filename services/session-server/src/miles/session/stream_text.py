"""What of a completion still being generated may reach the agent already: safe prefixes of the final message.

A streamed turn's deltas must add up to exactly the assistant message the session stores (the agent resends it
next turn), and that message is only known once the family parser has seen the whole completion
(`TitoTokenizer.parse_completion`). So while tokens arrive, only text that is a prefix of the final
`reasoning_content` / `content` whatever comes next is released; the rest is held until the stream ends:
- a trailing piece that may still become a family stop token (stripped at the end), a request `stop` string (cut
  at the end) or `</think>`;
- reasoning's leading and trailing whitespace (the parser strips it) and the text before `<think>` is certain;
- content from the family's tool-call opener on (a tool call is sent as a parsed `tool_calls` delta at the end, or
  as content when it does not parse), trailing newlines (stripped before a tool call), and all content when it
  starts with a newline (kept without a tool call, stripped before one) or is a JSON object (Llama's bare call).
`ids -> text` is detokenized incrementally (the offsets technique of SGLang/vLLM: a window decoded twice, a piece
released only when it does not end in an incomplete UTF-8 character), so each chunk costs a few tokens' decode.
Limit: the prefix property is exact for byte-level BPE vocabularies (every family served today); a tokenizer whose
decode of a longer sequence rewrites earlier text would make the end check fail, which `StreamedMessage.rest`
reports (the caller counts it) instead of sending a wrong delta.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from miles.session.tito import TitoTokenizer
from miles.session.tito.parsers import THINK_CLOSE, THINK_OPEN, ToolCallFormat, section_opener

_PENDING_LIMIT = 8
"""Ids held at most for an incomplete character (4 UTF-8 bytes cannot span more tokens than that)."""


class IncrementalDetokenizer:
    """Text of a growing id sequence, decoded a small window at a time."""

    def __init__(self, tito: TitoTokenizer) -> None:
        self._codec = tito.codec
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""

    def add(self, ids: Sequence[int]) -> None:
        self._ids.extend(ids)
        prefix = self._codec.decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._codec.decode(self._ids[self._prefix_offset :])
        incomplete = window.endswith("\ufffd") and len(self._ids) - self._read_offset < _PENDING_LIMIT
        if len(window) > len(prefix) and not incomplete:
            self.text += window[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)


def _held_tail(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the start (or the whole) of one of `markers`."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker), len(text)), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest


@dataclass(frozen=True)
class SafeParts:
    reasoning: str
    content: str


class StreamedMessage:
    """The deltas of one streamed turn: `advance(ids)` gives (reasoning, content) text to send now; `rest(final)`
    what completes the final message, or None when the sent text is not a prefix of it (see the module doc)."""

    def __init__(self, tito: TitoTokenizer, *, reasoning_open: bool, stop: str | list[str] | None) -> None:
        self._text = IncrementalDetokenizer(tito)
        self._stop_tokens = tito.family.stop_tokens
        self._stops = [stop] if isinstance(stop, str) else [s for s in stop or () if s]
        self._reasoning = tito.family.reasoning
        self._reasoning_open = reasoning_open
        self._format = tito.family.tool_call_format
        self._opener = section_opener(self._format)
        self.sent = SafeParts("", "")

    def advance(self, ids: Sequence[int]) -> SafeParts:
        """The new safe text after `ids` arrived ("" where nothing new is certain)."""
        self._text.add(ids)
        safe = self._safe(self._visible(self._text.text))
        sent = self.sent
        reasoning = safe.reasoning[len(sent.reasoning) :] if safe.reasoning.startswith(sent.reasoning) else ""
        content = safe.content[len(sent.content) :] if safe.content.startswith(sent.content) else ""
        if reasoning and sent.content:  # never reasoning after content: the final message could not add up
            reasoning = ""
        self.sent = SafeParts(sent.reasoning + reasoning, sent.content + content)
        return SafeParts(reasoning, content)

    def rest(self, reasoning: str | None, content: str) -> SafeParts | None:
        """What completes the final message's reasoning and content after what was sent; None when impossible."""
        reasoning = reasoning or ""
        if not reasoning.startswith(self.sent.reasoning) or not content.startswith(self.sent.content):
            return None
        return SafeParts(reasoning[len(self.sent.reasoning) :], content[len(self.sent.content) :])

    def _visible(self, text: str) -> str:
        """`text` without what a stop string or a trailing stop token may still remove."""
        for stop in self._stops:
            if stop in text:
                text = text[: text.index(stop)]
        stripped = True
        while stripped:
            stripped = False
            for token in self._stop_tokens:
                if token and text.endswith(token):
                    text, stripped = text[: -len(token)], True
        return text[: len(text) - _held_tail(text, [*self._stops, *self._stop_tokens])]

    def _safe(self, text: str) -> SafeParts:
        if not self._reasoning:
            return SafeParts("", self._safe_content(text))
        body = text
        if not self._reasoning_open:
            stripped = text.lstrip()
            if not stripped or (THINK_OPEN.startswith(stripped) and stripped != THINK_OPEN):
                return SafeParts("", "")
            if not stripped.startswith(THINK_OPEN):
                return SafeParts("", self._safe_content(text))
            body = stripped[len(THINK_OPEN) :]
        if THINK_CLOSE not in body:
            held = body[: len(body) - _held_tail(body, [THINK_CLOSE])]
            return SafeParts(held.strip(), "")
        reasoning, rest = body.split(THINK_CLOSE, 1)
        return SafeParts(reasoning.strip(), self._safe_content(rest.lstrip("\n")))

    def _safe_content(self, rest: str) -> str:
        if self._format is ToolCallFormat.LLAMA_JSON:
            stripped = rest.lstrip()
            return "" if not stripped or stripped.startswith("{") else stripped.rstrip()
        if self._opener is None:
            return rest
        if rest.startswith("\n"):
            return ""
        if self._opener in rest:
            return rest.split(self._opener, 1)[0].rstrip("\n")
        return rest[: len(rest) - _held_tail(rest, [self._opener])].rstrip("\n")
