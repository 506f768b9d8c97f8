"""TokenSeqComparator: classify how a TITO token sequence differs from a fresh render of the same messages.

Algorithm (Miles' comparator, reimplemented): strip trailing "junction" ids from both tails; cut each
sequence into segments, every boundary special token its own segment and every run between them one content
segment; if the special/content pattern differs, report one `special_token_count` mismatch and stop; else
compare aligned specials by id (`special_token_type`) and content segments by decoded text, exact
(`assistant_text` when the segment is assistant output in both sequences, else `non_assistant_text`).

Severity: `assistant_text` is not critical - assistant tokens are what the engine sampled, and a canonical
re-tokenisation (or a canonical re-serialisation of tool-call JSON) of the same turn may differ. Nor is
`assistant_special`: the patterns differ and the engine itself sampled a boundary token inside a completion (a
degenerate policy writing `<|im_start|>` mid-answer, text after a tool call): no fresh render can align with
that, and the tokens trained on are still exactly those sampled. The three other kinds mean TITO or the template
produced a prompt the model would not get from a fresh render: critical.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from miles.session.tito.codec import TokenCodec

_MAX_TEXT_CHARS = 200
_ASSISTANT_PROBE_TOKENS = 20


class MismatchKind(StrEnum):
    SPECIAL_TOKEN_COUNT = "special_token_count"
    SPECIAL_TOKEN_TYPE = "special_token_type"
    NON_ASSISTANT_TEXT = "non_assistant_text"
    ASSISTANT_TEXT = "assistant_text"
    ASSISTANT_SPECIAL = "assistant_special"

    @property
    def critical(self) -> bool:
        return self not in (MismatchKind.ASSISTANT_TEXT, MismatchKind.ASSISTANT_SPECIAL)


@dataclass(frozen=True)
class Mismatch:
    """One difference. `segment_index` is -1 for a structural (count) mismatch."""

    kind: MismatchKind
    segment_index: int
    expected_text: str
    actual_text: str
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.kind.value,
            "segment_index": self.segment_index,
            "expected_text": self.expected_text[:_MAX_TEXT_CHARS],
            "actual_text": self.actual_text[:_MAX_TEXT_CHARS],
            "detail": self.detail,
        }


@dataclass(frozen=True)
class ComparisonResult:
    """All mismatches of one comparison; `to_metadata()` is what a session stores and returns."""

    mismatches: tuple[Mismatch, ...] = ()
    num_expected_tokens: int = 0
    num_actual_tokens: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def num_critical(self) -> int:
        return sum(1 for m in self.mismatches if m.kind.critical)

    @property
    def ok(self) -> bool:
        """No critical mismatch."""
        return self.num_critical == 0

    def to_metadata(self, max_listed: int = 5) -> dict[str, Any]:
        """JSON-ready session metadata: counts per kind (all kinds present), critical flag, first mismatches."""
        return {
            "mismatch_counts": {kind.value: self.counts.get(kind.value, 0) for kind in MismatchKind},
            "num_critical": self.num_critical,
            "num_expected_tokens": self.num_expected_tokens,
            "num_actual_tokens": self.num_actual_tokens,
            "mismatches": [m.to_dict() for m in self.mismatches[:max_listed]],
        }


@dataclass(frozen=True)
class _Segment:
    ids: tuple[int, ...]
    special: bool


class TokenSeqComparator:
    """Compares token sequences of one model family (see module docstring)."""

    def __init__(
        self,
        codec: TokenCodec,
        *,
        boundary_ids: Iterable[int],
        assistant_starts: Sequence[str] = (),
        trailing_ids: Iterable[int] = (),
    ) -> None:
        self._codec = codec
        self._boundaries = frozenset(boundary_ids)
        self._assistant_starts = tuple(assistant_starts)
        self._trailing = frozenset(trailing_ids)

    def _trim(self, ids: Sequence[int], extra: frozenset[int]) -> Sequence[int]:
        end = len(ids)
        while end > 0 and (ids[end - 1] in self._trailing or ids[end - 1] in extra):
            end -= 1
        return ids[:end]

    def _segments(self, ids: Sequence[int]) -> list[_Segment]:
        segments: list[_Segment] = []
        run: list[int] = []
        for token_id in ids:
            if token_id in self._boundaries:
                if run:
                    segments.append(_Segment(tuple(run), special=False))
                    run = []
                segments.append(_Segment((token_id,), special=True))
            else:
                run.append(token_id)
        if run:
            segments.append(_Segment(tuple(run), special=False))
        return segments

    def _describe(self, segments: Sequence[_Segment]) -> str:
        parts = [f"[{self._codec.decode(s.ids)}]" if s.special else f"({len(s.ids)} tokens)" for s in segments[:40]]
        return " ".join(parts) + (" ..." if len(segments) > 40 else "")

    def _is_assistant(self, segments: Sequence[_Segment], index: int) -> bool:
        if not self._assistant_starts or index == 0 or not segments[index - 1].special:
            return False
        head = self._codec.decode(segments[index - 1].ids + segments[index].ids[:_ASSISTANT_PROBE_TOKENS])
        return head.startswith(self._assistant_starts)

    def compare(
        self,
        expected: Sequence[int],
        actual: Sequence[int],
        *,
        trim_ids: Iterable[int] = (),
        sampled_spans: Iterable[tuple[int, int]] = (),
    ) -> ComparisonResult:
        """Compare `actual` (TITO ids) with `expected` (a fresh render's ids). `sampled_spans` are the [start, end)
        positions of `actual` the engine sampled (the completions)."""
        extra = frozenset(trim_ids)
        expected_segments = self._segments(self._trim(expected, extra))
        actual_segments = self._segments(self._trim(actual, extra))
        mismatches: list[Mismatch] = []
        if [s.special for s in expected_segments] != [s.special for s in actual_segments]:
            sampled_boundary = self._sampled_boundary(actual, sampled_spans)
            mismatches.append(
                Mismatch(
                    MismatchKind.SPECIAL_TOKEN_COUNT if sampled_boundary < 0 else MismatchKind.ASSISTANT_SPECIAL,
                    -1,
                    self._describe(expected_segments),
                    self._describe(actual_segments),
                    f"{len(expected_segments)} expected segments vs {len(actual_segments)} actual",
                )
            )
        else:
            mismatches.extend(self._compare_aligned(expected_segments, actual_segments))
        counts: dict[str, int] = {}
        for mismatch in mismatches:
            counts[mismatch.kind.value] = counts.get(mismatch.kind.value, 0) + 1
        return ComparisonResult(tuple(mismatches), len(expected), len(actual), counts)

    def _sampled_boundary(self, actual: Sequence[int], sampled_spans: Iterable[tuple[int, int]]) -> int:
        """Position of a boundary token the engine sampled before the last token of its completion (-1: none)."""
        for start, end in sampled_spans:
            for position in range(max(0, start), min(end - 1, len(actual))):
                if actual[position] in self._boundaries:
                    return position
        return -1

    def _compare_aligned(self, expected: list[_Segment], actual: list[_Segment]) -> list[Mismatch]:
        mismatches: list[Mismatch] = []
        for index, (exp, act) in enumerate(zip(expected, actual, strict=True)):
            if exp.ids == act.ids:
                continue
            exp_text, act_text = self._codec.decode(exp.ids), self._codec.decode(act.ids)
            if exp.special:
                mismatches.append(Mismatch(MismatchKind.SPECIAL_TOKEN_TYPE, index, exp_text, act_text))
            elif exp_text != act_text:
                assistant = self._is_assistant(expected, index) and self._is_assistant(actual, index)
                kind = MismatchKind.ASSISTANT_TEXT if assistant else MismatchKind.NON_ASSISTANT_TEXT
                mismatches.append(Mismatch(kind, index, exp_text, act_text, _first_difference(exp_text, act_text)))
        return mismatches


def first_difference_position(a: str, b: str) -> int:
    """Index of the first character where `a` and `b` differ (the shorter length when one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _first_difference(expected: str, actual: str) -> str:
    position = first_difference_position(expected, actual)
    expected_part, actual_part = expected[position : position + 30], actual[position : position + 30]
    return f"first difference at char {position}: {expected_part!r} vs {actual_part!r}"
