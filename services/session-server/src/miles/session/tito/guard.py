"""Control-token strings in untrusted text are encoded as plain text (a job's `split_special_tokens` option).

Why: a chat template pastes user, system and tool text verbatim between its own control tokens, and a plain
`encode` of the rendered text cannot tell them apart: a tool output holding `<|im_end|>\\n<|im_start|>assistant\\n`
becomes real turn boundaries, so a tool (or a user) can forge turns. The vendor templates and Miles behave so.

How: before rendering, every added/special token string inside an untrusted string is replaced by a marker, an
escape character followed by one private-use character naming the token (the escape character itself, should
the text hold it, is doubled). The template renders the markers as ordinary characters. `encode` then splits
the rendered text at the template's own token strings (their ids) and encodes each run between them, markers
turned back into their token strings, with the codec's plain-text encoding (`TokenCodec.encode_plain`), so the
untrusted token strings get the ids of their characters and BPE sees each run whole. `unmark` gives the text.

Limits: a template that inspects untrusted text for a token string (Qwen3's check that a user message starts
with `<tool_response>`) sees the marker instead; a template that escapes non-ASCII characters of untrusted text
(`tojson(ensure_ascii=True)`) renders the markers' escapes instead of the token strings; a token string that
only appears by joining untrusted text to the template text or the next field is not marked (no shipped
template puts a partial token string next to a field).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from miles.session.tito.codec import TokenCodec

ESCAPE = "\U0010ffff"
"""Starts every marker (a noncharacter: never in a token string or a template)."""
_NAME_BASE = 0x100000
"""Supplementary Private Use Area-B: the character after ESCAPE names token `ord(c) - _NAME_BASE`."""
_MAX_TOKENS = 0xFFFF


class SpecialTokenGuard:
    """Marks untrusted strings before rendering and encodes the marked render. Stateless after construction.

    Disabled (`enabled=False`), it marks nothing and encodes with the codec's ordinary `encode`."""

    def __init__(self, codec: TokenCodec, *, enabled: bool = True) -> None:
        self._codec = codec
        self.enabled = enabled
        added = codec.added_token_strings() if enabled else ()
        self._tokens = tuple(dict.fromkeys(t for t in added if t))[:_MAX_TOKENS]
        self._index = {token: i for i, token in enumerate(self._tokens)}
        ordered = sorted(self._tokens, key=len, reverse=True)  # longest first: `</think>` before a shorter prefix
        self._pattern = re.compile("|".join(re.escape(t) for t in ordered)) if ordered else None
        self._marker = re.compile(f"{re.escape(ESCAPE)}(.)", re.DOTALL)

    # --- before rendering ---------------------------------------------------------------------------------

    def mark(self, text: str) -> str:
        """`text` with its token strings replaced by markers."""
        if ESCAPE in text:
            text = text.replace(ESCAPE, ESCAPE + ESCAPE)
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda m: ESCAPE + chr(_NAME_BASE + self._index[m.group(0)]), text)

    def mark_value(self, value: Any) -> Any:
        """A JSON-like value with every string in it (mapping keys included) marked."""
        if not self.enabled:
            return value
        if isinstance(value, str):
            return self.mark(value)
        if isinstance(value, Mapping):
            return {self.mark(k) if isinstance(k, str) else k: self.mark_value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.mark_value(v) for v in value]
        return value

    def mark_views(self, views: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Message views with every string of the non-assistant ones marked (assistant text keeps its tokens)."""
        if not self.enabled:
            return views
        return [view if view.get("role") == "assistant" else self.mark_value(view) for view in views]

    def mark_tools(self, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """The tool list with every string marked (names, descriptions, schemas)."""
        return tools if tools is None or not self.enabled else list(self.mark_value(tools))

    # --- after rendering ----------------------------------------------------------------------------------

    def _restore(self, match: re.Match[str]) -> str:
        named = match.group(1)
        if named == ESCAPE:
            return ESCAPE
        index = ord(named) - _NAME_BASE
        return self._tokens[index] if 0 <= index < len(self._tokens) else match.group(0)

    def unmark(self, text: str) -> str:
        """The rendered text the model sees (markers turned back into their token strings)."""
        return self._marker.sub(self._restore, text) if self.enabled and ESCAPE in text else text

    def encode(self, text: str) -> list[int]:
        """Ids of a marked render: the template's token strings as their ids, every run between them as text."""
        if not self.enabled:
            return self._codec.encode(text)
        if self._pattern is None:
            return self._codec.encode_plain(self.unmark(text))
        ids: list[int] = []
        position = 0
        for match in self._pattern.finditer(text):
            ids += self._encode_run(text[position : match.start()])
            ids += self._codec.encode(match.group(0))
            position = match.end()
        ids += self._encode_run(text[position:])
        return ids

    def _encode_run(self, run: str) -> list[int]:
        if not run:
            return []
        if ESCAPE not in run:
            return self._codec.encode(run)  # no token string in it: the ordinary encoding is the plain one
        return self._codec.encode_plain(self.unmark(run))
