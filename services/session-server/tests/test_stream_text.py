"""The early text of a streamed turn is always a prefix of the message the session stores (stream_text.py).

Each completion is fed token by token, as an engine streams it: after every token, what was released must be a
prefix of the final parsed reasoning / content, and at the end what was released plus `rest` must be exactly the
final message (what a non-streamed turn answers).
"""

from __future__ import annotations

from typing import Any

import pytest

from miles.session.stream_text import StreamedMessage
from miles.session.tito import TitoTokenizer

TOOL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QWEN3_CASES: list[tuple[str, str, bool, Any]] = [
    ("plain text", "Hello world, ünïcödé 🎉 and 中文 done.<|im_end|>", False, None),
    (
        "reasoning then a tool call",
        f"<think>\nI should look.\n</think>\n\nLet me check.\n{TOOL}<|im_end|>",
        False,
        None,
    ),
    ("content then a tool call", f"Checking the weather now.\n\n{TOOL}<|im_end|>", False, None),
    ("a leading newline", f"\nLeading newline, then a call.\n{TOOL}<|im_end|>", False, None),
    ("a leading newline, no call", "\nLeading newline only.<|im_end|>", False, None),
    ("cut inside a tool-call opener", "Almost a call <tool_c", False, None),
    ("a malformed tool call stays content", "Try: <tool_call>\n{not json}\n</tool_call><|im_end|>", False, None),
    ("cut while reasoning", "<think>unfinished reasoning  ", False, None),
    ("reasoning opened by the prompt", "I think so.\n</think>\n\nThe answer is 42.<|im_end|>", True, None),
    ("a stop string", "Count: one, two, STOP and more", False, ["STOP"]),
    ("a stop string as a str", "Alpha beta END gamma", False, "END"),
    ("whitespace before <think>", "  <think>plan</think>\nDone.<|im_end|>", False, None),
    ("a text that only looks like <think>", "<thinking aloud> is fine.<|im_end|>", False, None),
]


def final_message(tito: TitoTokenizer, ids: list[int], stop: Any, reasoning_open: bool) -> Any:
    """What a non-streamed turn answers (turns.TurnRunner._assistant_message, stop string cut included)."""
    text = tito.codec.decode(ids)
    stops = [stop] if isinstance(stop, str) else stop or []
    matched = next((s for s in stops if s in text), None)
    if matched is not None:
        text = text[: text.index(matched)]
    return tito.parse_completion(text, reasoning_open=reasoning_open)


def stream(tito: TitoTokenizer, text: str, stop: Any, reasoning_open: bool) -> tuple[list[str], list[str], Any]:
    ids = tito.codec.encode(text)
    final = final_message(tito, ids, stop, reasoning_open)
    message = StreamedMessage(tito, reasoning_open=reasoning_open, stop=stop)
    reasoning_deltas, content_deltas = [], []
    for token in ids:
        parts = message.advance([token])
        reasoning_deltas.append(parts.reasoning)
        content_deltas.append(parts.content)
        assert (final.reasoning_content or "").startswith(message.sent.reasoning)
        assert final.content.startswith(message.sent.content)
    rest = message.rest(final.reasoning_content, final.content)
    assert rest is not None
    assert message.sent.reasoning + rest.reasoning == (final.reasoning_content or "")
    assert message.sent.content + rest.content == final.content
    return reasoning_deltas, content_deltas, final


@pytest.mark.parametrize(("case", "text", "reasoning_open", "stop"), QWEN3_CASES, ids=[c[0] for c in QWEN3_CASES])
def test_released_text_is_always_a_prefix_of_the_stored_message_for_qwen3(
    qwen3: TitoTokenizer, case: str, text: str, reasoning_open: bool, stop: Any
) -> None:
    stream(qwen3, text, stop, reasoning_open)


def test_text_streams_before_the_last_token_and_tool_calls_are_held(qwen3: TitoTokenizer) -> None:
    reasoning, content, final = stream(
        qwen3, f"<think>\nI should look.\n</think>\n\nLet me check.\n{TOOL}", None, False
    )
    first_reasoning = next(i for i, d in enumerate(reasoning) if d)
    first_content = next(i for i, d in enumerate(content) if d)
    assert first_reasoning < first_content < len(content) // 2  # both flow long before the end
    assert "".join(content) == "Let me check." == final.content  # nothing of the call was released as text
    assert final.tool_calls and final.tool_calls[0].name == "get_weather"


def test_a_stop_token_and_a_stop_string_are_never_released(qwen3: TitoTokenizer) -> None:
    _, content, _ = stream(qwen3, "Plain answer.<|im_end|>", None, False)
    assert "".join(content) == "Plain answer."
    _, content, _ = stream(qwen3, "keep this STO", ["STOP"], False)
    assert "".join(content) == "keep this "  # "STO" may still become the stop string


@pytest.mark.parametrize(
    "text",
    [
        "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
        "<think>hmm</think>Plain GLM answer with ümlauts.",
    ],
)
def test_released_text_is_always_a_prefix_of_the_stored_message_for_glm47(glm47: TitoTokenizer, text: str) -> None:
    stream(glm47, text, None, False)
    stream(glm47, text, None, True)
