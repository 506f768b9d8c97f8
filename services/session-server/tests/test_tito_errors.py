"""Bad input raises a specific error type (a miles.common.errors subclass) whose message says what to fix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from miles.common.errors import InvalidArgumentError, NotFoundError, UnprocessableError
from miles.session.tito import (
    ChatTemplateKwargConflictError,
    InvalidToolCallArgumentsError,
    NonAppendHistoryError,
    TemplateNotPrefixError,
    TitoTokenizer,
    UnknownFamilyError,
    UnsupportedRoleError,
    get_family,
    split_appended,
)

HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
]


def _stored(tito: TitoTokenizer) -> list[int]:
    return [*tito.first_prompt(HISTORY[:2]).prompt_ids, *tito.codec.encode("Hello!<|im_end|>")]


def test_non_append_history_names_the_changed_message() -> None:
    edited = [HISTORY[0], {"role": "user", "content": "Hi there"}, HISTORY[2], {"role": "user", "content": "?"}]
    with pytest.raises(NonAppendHistoryError, match=r"messages\[1\] differs .* in `content`.*resend") as info:
        split_appended(HISTORY, edited)
    assert isinstance(info.value, InvalidArgumentError)
    assert info.value.field == "messages[1].content"
    with pytest.raises(NonAppendHistoryError, match="send the whole history"):
        split_appended(HISTORY, HISTORY[:2])


def test_append_matching_accepts_equivalent_arguments_and_returns_the_suffix(
    weather_call: Callable[..., dict[str, Any]],
) -> None:
    stored = [*HISTORY[:2], {"role": "assistant", "content": None, "tool_calls": [weather_call()]}]
    replayed = [
        *HISTORY[:2],
        {"role": "assistant", "content": "", "tool_calls": [weather_call(arguments='{"city":"Paris"}')]},
    ]
    tool = {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}
    assert split_appended(stored, [*replayed, tool]) == [tool]
    changed = [*HISTORY[:2], {"role": "assistant", "content": "", "tool_calls": [weather_call("Rome")]}]
    with pytest.raises(NonAppendHistoryError, match="tool_calls"):
        split_appended(stored, changed)


def test_unknown_role_is_rejected(qwen3: TitoTokenizer) -> None:
    with pytest.raises(UnsupportedRoleError, match=r"messages\[3\]\.role 'critic' is not a chat role; use one of"):
        qwen3.extend(_stored(qwen3), HISTORY, [{"role": "critic", "content": "meh"}])


def test_role_outside_the_family_set_names_family_and_role(make_tito: Callable[..., TitoTokenizer]) -> None:
    tito = make_tito("deepseek-v3")
    stored = [*tito.first_prompt(HISTORY[:2]).prompt_ids, *tito.codec.encode("Hello!<｜end▁of▁sentence｜>")]  # noqa: RUF001
    with pytest.raises(UnsupportedRoleError, match=r"family 'deepseek-v3' cannot append a 'system' message") as info:
        tito.extend(stored, HISTORY, [{"role": "system", "content": "Reminder."}])
    assert "appendable roles: assistant, tool, user" in info.value.message
    assert info.value.details == {"family": "deepseek-v3", "role": "system"}


def test_template_that_rerenders_history_is_not_a_prefix(make_tito: Callable[..., TitoTokenizer]) -> None:
    """GLM-4.7's vendor template without clear_thinking=false empties earlier think blocks after a user turn."""
    tito = make_tito("glm-4.7", template_kwargs={})
    stored = tito.codec.encode(
        tito.render(HISTORY[:2], add_generation_prompt=True) + "Greet back.</think>Hello!<|user|>"
    )
    with pytest.raises(
        TemplateNotPrefixError, match=r"changes earlier text at char .* use a family with a fixed"
    ) as info:
        tito.extend(stored, HISTORY, [{"role": "user", "content": "Again?"}])
    assert isinstance(info.value, UnprocessableError)


@pytest.mark.parametrize(
    ("arguments", "pattern"),
    [
        ('{"city": "Paris"', "is not valid JSON"),
        ('["Paris"]', "must be a JSON object"),
        ("42", "must be a JSON object"),
    ],
)
def test_tool_call_arguments_must_be_a_json_object(
    qwen3: TitoTokenizer, weather_call: Callable[..., dict[str, Any]], arguments: str, pattern: str
) -> None:
    injected = {"role": "assistant", "content": "", "tool_calls": [weather_call(arguments=arguments)]}
    with pytest.raises(InvalidToolCallArgumentsError, match=pattern) as info:
        qwen3.extend(_stored(qwen3), HISTORY, [{"role": "user", "content": "example:"}, injected])
    assert info.value.field == "messages[4].tool_calls[0].function.arguments"
    assert isinstance(info.value, InvalidArgumentError)


def test_request_kwargs_cannot_undo_the_family_fix(qwen3: TitoTokenizer) -> None:
    with pytest.raises(ChatTemplateKwargConflictError, match="clear_thinking=True contradicts family 'qwen3'"):
        qwen3.extend(
            _stored(qwen3), HISTORY, [{"role": "user", "content": "?"}], chat_template_kwargs={"clear_thinking": True}
        )


def test_unknown_family_lists_the_registered_ones() -> None:
    with pytest.raises(UnknownFamilyError, match="unknown TITO family 'qwen9'; registered: qwen3, ") as info:
        get_family("qwen9")
    assert isinstance(info.value, NotFoundError)
