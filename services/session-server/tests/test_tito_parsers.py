"""Completion parsers turn each family's sampled text into an OpenAI assistant message."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from miles.session.tito import TitoTokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"q": {"type": "string"}, "n": {"type": "integer"}, "flag": {"type": "boolean"}},
            },
        },
    }
]


def _calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]


@pytest.mark.parametrize(
    ("family", "completion", "reasoning_open", "content", "reasoning", "calls"),
    [
        (
            "qwen3",
            '<think>\nR\n</think>\n\nHi\n<tool_call>\n{"name": "f", "arguments": {"q": "é"}}\n</tool_call>'
            '\n<tool_call>\n{"name": "f", "arguments": {"n": 2}}\n</tool_call><|im_end|>',
            False,
            "Hi",
            "R",
            [("f", {"q": "é"}), ("f", {"n": 2})],
        ),
        (
            "qwen3.5",
            "R\n</think>\n\n<tool_call>\n<function=f>\n<parameter=q>\ntrue\n</parameter>\n<parameter=n>\n3"
            "\n</parameter>\n</function>\n</tool_call><|im_end|>",
            True,
            "",
            "R",
            [("f", {"q": "true", "n": 3})],
        ),
        (
            "glm-4.5",
            "\n<think>R</think>\nOk\n<tool_call>f\n<arg_key>q</arg_key>\n<arg_value>x y</arg_value>\n"
            "<arg_key>flag</arg_key>\n<arg_value>true</arg_value>\n</tool_call><|observation|>",
            False,
            "Ok",
            "R",
            [("f", {"q": "x y", "flag": True})],
        ),
        (
            "kimi-k2",
            "A<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
            '{"q":"z"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
            False,
            "A",
            None,
            [("f", {"q": "z"})],
        ),
        (
            "deepseek-v3",
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"n": 1}\n```'  # noqa: RUF001
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",  # noqa: RUF001
            False,
            "",
            None,
            [("f", {"n": 1})],
        ),
        ("llama-3", '{"name": "f", "parameters": {"q": "w"}}<|eot_id|>', False, "", None, [("f", {"q": "w"})]),
        (
            "minimax-m2",
            'R\n</think>\n\n\n<minimax:tool_call>\n<invoke name="f"><parameter name="n">5</parameter>\n'
            "</invoke>\n</minimax:tool_call>[e~[",
            True,
            "",
            "R",
            [("f", {"n": 5})],
        ),
        ("nemotron-3", "R\n</think>\nDone.<|im_end|>", True, "Done.", "R", []),
    ],
)
def test_family_parser_extracts_content_reasoning_and_calls(
    make_tito: Callable[..., TitoTokenizer],
    family: str,
    completion: str,
    reasoning_open: bool,
    content: str,
    reasoning: str | None,
    calls: list[tuple[str, Any]],
) -> None:
    tito = make_tito(family)
    parsed = tito.parse_completion(tito.codec.encode(completion), reasoning_open=reasoning_open, tools=TOOLS)
    message = parsed.to_openai_message()
    assert (message["content"], message.get("reasoning_content"), _calls(message)) == (content, reasoning, calls)
    assert parsed.parse_error is None


def test_kimi_keeps_the_sampled_call_id(make_tito: Callable[..., TitoTokenizer]) -> None:
    tito = make_tito("kimi-k2")
    text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:7<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>"
    )
    assert tito.parse_completion(text).tool_calls[0].id == "functions.f:7"


def test_malformed_tool_call_stays_content_with_a_reason(qwen3: TitoTokenizer) -> None:
    parsed = qwen3.parse_completion('<tool_call>\n{"name": "f", "arguments": {"q": \n</tool_call><|im_end|>')
    assert parsed.tool_calls == ()
    assert parsed.content.startswith("<tool_call>")
    assert parsed.parse_error


def test_cut_off_reasoning_is_all_reasoning(make_tito: Callable[..., TitoTokenizer]) -> None:
    parsed = make_tito("qwen3-thinking-2507").parse_completion("still thinking about", reasoning_open=True)
    assert (parsed.reasoning_content, parsed.content) == ("still thinking about", "")
