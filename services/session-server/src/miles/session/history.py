"""Phase 1's pure part: how a request's messages relate to the stored history, and the prompt ids it gets.

- Append: the request repeats the stored history (same role, content, reasoning_content and tool calls; tool-call
  arguments compared as JSON) and adds messages; TITO extends the stored ids with only the added ones.
- Retry: the request repeats the history only up to an earlier generated turn (the agent retried its last call
  with different messages). At most one generated turn is rolled back (Miles' limit): the prompt extends the
  checkpoint before it. Deeper divergence is a 400 naming the first differing message.
- First turn (or a rollback to nothing): a full render.
The tool list is part of the rendered prompt, so later turns must send the first turn's tools or none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from miles.session.errors import ToolsChangedError
from miles.session.records import Json, SessionState, TurnRecord, dumps
from miles.session.tito import TitoPrompt, TitoTokenizer, split_appended
from miles.session.tito.messages import canonical_tools, first_difference

MAX_ROLLBACK_TURNS = 1


@dataclass(frozen=True)
class TurnPlan:
    """What phase 1 decided: the prompt, and what phase 3 commits if the turn is recorded."""

    prompt: TitoPrompt
    base_messages: list[Json]
    """The stored history the turn extends (shorter than the stored one after a rollback)."""
    appended: list[Json]
    num_kept_records: int
    tools: list[Json] | None
    state_version: int
    """The session version phase 1 read: phase 3 commits only if it is still current (fencing)."""
    kept_message_ends: list[int]


def num_records_to_keep(state: SessionState, messages: Sequence[Json]) -> int:
    """How many records the request builds on (all of them unless it retries the last generated turn)."""
    stored = state.messages
    if not stored:
        return 0
    num_matching = 0
    for old, new in zip(stored, messages, strict=False):
        if not isinstance(new, dict) or first_difference(old, new) is not None:
            break
        num_matching += 1
    if num_matching >= len(stored):
        return state.num_records
    num_keep = sum(1 for end in state.message_ends if end <= num_matching)
    if state.num_records - num_keep > MAX_ROLLBACK_TURNS:
        split_appended(stored, messages)  # raises NonAppendHistoryError naming the first difference
    return num_keep


def resolve_tools(state: SessionState, num_keep: int, request_tools: list[Json] | None) -> list[Json] | None:
    """The session's tools: the first turn's; a later turn may repeat them or omit them, not change them."""
    requested = canonical_tools(request_tools) or None
    if num_keep == 0:
        return requested
    if requested is not None and dumps(requested) != dumps(state.tools):
        raise ToolsChangedError(
            "tools differ from the ones this session's first turn was rendered with; send the same tools (or "
            "none) on every turn, or start a new session",
            field="tools",
        )
    return state.tools


def plan_turn(
    tito: TitoTokenizer,
    state: SessionState,
    records: Sequence[TurnRecord],
    messages: list[Json],
    *,
    num_keep: int,
    request_tools: list[Json] | None,
    chat_template_kwargs: Json | None,
) -> TurnPlan:
    """The prompt of a turn that keeps `num_keep` records (`records` must hold them when it rolls back)."""
    tools = resolve_tools(state, num_keep, request_tools)
    if num_keep == 0:
        prompt = tito.first_prompt(messages, tools=tools, chat_template_kwargs=chat_template_kwargs)
        return TurnPlan(prompt, [], list(messages), 0, tools, state.version, [])
    if num_keep == state.num_records:
        base_messages, base_ids = state.messages, state.token_ids
    else:
        checkpoint = records[num_keep - 1]
        base_messages = state.messages[: state.message_ends[num_keep - 1]]
        base_ids = state.token_ids[: checkpoint.prompt_len] + checkpoint.completion_ids
    appended = [dict(m) for m in split_appended(base_messages, messages)]
    prompt = tito.extend(base_ids, base_messages, appended, tools=tools, chat_template_kwargs=chat_template_kwargs)
    return TurnPlan(prompt, base_messages, appended, num_keep, tools, state.version, state.message_ends[:num_keep])
