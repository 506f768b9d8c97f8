"""Completion parsers: an assistant completion (text the engine sampled) -> an OpenAI assistant message.

One parser per tool-call syntax of the families we serve, plus `<think>` reasoning splitting. They never raise
on model output: text that does not parse as a tool call stays in `content` (and `parse_error` says why), so a
malformed call reaches the agent as text, which is what lets it answer "could not parse, try again".
Argument values are kept as the model wrote them where the syntax carries JSON text (`arguments` is then the
exact JSON string sampled), so a later render of the message reproduces the sampled text.
"""

# ruff: noqa: RUF001, RUF003 - DeepSeek's special tokens use fullwidth bars, and the corpus is deliberately multilingual

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class ToolCallFormat(StrEnum):
    """Tool-call syntaxes; the value is the SGLang parser name closest to it."""

    NONE = "none"
    HERMES = "qwen25"  # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
    QWEN_XML = "qwen3_coder"  # <tool_call>\n<function=f>\n<parameter=k>\nv\n</parameter>\n</function>\n</tool_call>
    GLM = "glm45"  # <tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call> (newlines in 4.5)
    KIMI = "kimi_k2"  # <|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}<|tool_call_end|>
    DEEPSEEK = "deepseekv3"  # <｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{...}\n```<｜tool▁call▁end｜>
    LLAMA_JSON = "llama3"  # the whole turn is {"name": f, "parameters": {...}}
    MINIMAX = "minimax-m2"  # <minimax:tool_call>\n<invoke name="f"><parameter name="k">v</parameter>\n</invoke>


@dataclass(frozen=True)
class ParsedToolCall:
    """One tool call; `arguments` is a JSON object string (exactly as sampled when the syntax carries JSON)."""

    name: str
    arguments: str
    id: str | None = None

    def to_openai(self, index: int) -> dict[str, Any]:
        return {
            "id": self.id or f"call_{index}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedCompletion:
    """An assistant turn split into reasoning, visible content and tool calls."""

    content: str
    reasoning_content: str | None = None
    tool_calls: tuple[ParsedToolCall, ...] = ()
    parse_error: str | None = None
    """Why tool-call text was left in `content` (None when everything parsed)."""

    def to_openai_message(self) -> dict[str, Any]:
        """The `message` object of a chat completion choice."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai(i) for i, call in enumerate(self.tool_calls)]
        return message


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_reasoning(text: str, *, reasoning_open: bool) -> tuple[str | None, str]:
    """(reasoning, rest). `reasoning_open`: the prompt already opened `<think>` (the text starts inside it)."""
    if not reasoning_open:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            return None, text
        text = stripped[len(THINK_OPEN) :]
    if THINK_CLOSE not in text:
        return text.strip(), ""  # cut off while still thinking
    reasoning, rest = text.split(THINK_CLOSE, 1)
    return reasoning.strip(), rest.lstrip("\n")


ParamTypes = dict[str, dict[str, str]]
"""function name -> parameter name -> JSON-schema type, from the request's tools."""


def param_types(tools: Sequence[Mapping[str, Any]] | None) -> ParamTypes:
    """Parameter types of `tools` (OpenAI function tools), used to read XML-style argument values back."""
    types: ParamTypes = {}
    for tool in tools or ():
        function = tool.get("function", tool)
        properties = (function.get("parameters") or {}).get("properties") or {}
        types[str(function.get("name"))] = {
            str(name): str(spec.get("type")) for name, spec in properties.items() if isinstance(spec, Mapping)
        }
    return types


def _value_text(raw: str, schema_type: str | None = None) -> Any:
    """An XML-style parameter value: the text for string parameters, else JSON when it parses, else the text.

    Templates write string values verbatim and other values as JSON, so `true` is ambiguous without the
    tool's schema (a string parameter keeps it as text).
    """
    if schema_type == "string":
        return raw
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    return raw if isinstance(value, str) else value


def _json_args(mapping: dict[str, Any]) -> str:
    return json.dumps(mapping, ensure_ascii=False)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_ARGUMENTS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def _hermes_call(block: str) -> ParsedToolCall:
    obj = json.loads(block)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call needs a string `name`")
    match = _ARGUMENTS_KEY.search(block)
    if match is None:
        return ParsedToolCall(name=obj["name"], arguments="{}")
    value, end = json.JSONDecoder().raw_decode(block, match.end())
    if not isinstance(value, dict):
        raise ValueError("`arguments` must be a JSON object")
    return ParsedToolCall(name=obj["name"], arguments=block[match.end() : end])


_QWEN_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>\n?(.*?)</function>", re.S)
_QWEN_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _qwen_xml_call(block: str, types: ParamTypes) -> ParsedToolCall:
    match = _QWEN_XML_FUNCTION.search(block)
    if match is None:
        raise ValueError("no <function=...> block")
    name = match.group(1).strip()
    schema = types.get(name, {})
    args = {key: _value_text(value, schema.get(key)) for key, value in _QWEN_XML_PARAM.findall(match.group(2))}
    return ParsedToolCall(name=name, arguments=_json_args(args))


_GLM_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _glm_call(block: str, types: ParamTypes) -> ParsedToolCall:
    name = block.split("<arg_key>", 1)[0].strip()
    if not name:
        raise ValueError("a GLM tool call needs a function name")
    schema = types.get(name, {})
    args = {key.strip(): _value_text(value, schema.get(key.strip())) for key, value in _GLM_ARG.findall(block)}
    return ParsedToolCall(name=name, arguments=_json_args(args))


_MINIMAX_INVOKE = re.compile(r'<invoke name="([^"]+)">(.*?)</invoke>', re.S)
_MINIMAX_PARAM = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.S)


def _minimax_calls(section: str, types: ParamTypes) -> list[ParsedToolCall]:
    calls = [
        ParsedToolCall(
            name=name,
            arguments=_json_args(
                {k: _value_text(v, types.get(name, {}).get(k)) for k, v in _MINIMAX_PARAM.findall(body)}
            ),
        )
        for name, body in _MINIMAX_INVOKE.findall(section)
    ]
    if not calls:
        raise ValueError('no <invoke name="..."> block')
    return calls


_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*(.*?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.S)


def _kimi_call(call_id: str, arguments: str) -> ParsedToolCall:
    # Kimi writes `functions.<name>:<index>` as the id and has no separate name field.
    name = call_id.split(".", 1)[-1].rsplit(":", 1)[0]
    if not isinstance(json.loads(arguments), dict):
        raise ValueError("arguments must be a JSON object")
    return ParsedToolCall(name=name, arguments=arguments, id=call_id)


_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)\n```json\n(.*?)\n```<｜tool▁call▁end｜>", re.S
)


def _deepseek_call(name: str, arguments: str) -> ParsedToolCall:
    if not isinstance(json.loads(arguments), dict):
        raise ValueError("arguments must be a JSON object")
    return ParsedToolCall(name=name.strip(), arguments=arguments)


# (section opener, parse(section) -> calls); the content is the text before the opener.
_SECTION_OPENERS: dict[ToolCallFormat, str] = {
    ToolCallFormat.HERMES: "<tool_call>",
    ToolCallFormat.QWEN_XML: "<tool_call>",
    ToolCallFormat.GLM: "<tool_call>",
    ToolCallFormat.KIMI: "<|tool_calls_section_begin|>",
    ToolCallFormat.DEEPSEEK: "<｜tool▁calls▁begin｜>",
    ToolCallFormat.MINIMAX: "<minimax:tool_call>",
}


def section_opener(fmt: ToolCallFormat) -> str | None:
    """The text that opens `fmt`'s tool-call section (None: the format has none); text before it is content."""
    return _SECTION_OPENERS.get(fmt)


def _calls_in_section(fmt: ToolCallFormat, section: str, types: ParamTypes) -> list[ParsedToolCall]:
    if fmt is ToolCallFormat.HERMES:
        return [_hermes_call(block) for block in _HERMES.findall(section)]
    if fmt is ToolCallFormat.QWEN_XML:
        return [_qwen_xml_call(block, types) for block in _HERMES.findall(section)]
    if fmt is ToolCallFormat.GLM:
        return [_glm_call(block, types) for block in _GLM_CALL.findall(section)]
    if fmt is ToolCallFormat.KIMI:
        return [_kimi_call(call_id, args) for call_id, args in _KIMI_CALL.findall(section)]
    if fmt is ToolCallFormat.DEEPSEEK:
        return [_deepseek_call(name, args) for _, name, args in _DEEPSEEK_CALL.findall(section)]
    return _minimax_calls(section, types)


def _llama_json(text: str) -> ParsedCompletion | None:
    stripped = text.strip()
    if not (stripped.startswith("{") and stripped.endswith("}")):
        return None
    try:
        call = _hermes_call(stripped)
    except (ValueError, json.JSONDecodeError):
        return None
    return ParsedCompletion(content="", tool_calls=(call,))


def parse_completion(
    text: str,
    fmt: ToolCallFormat,
    *,
    reasoning_open: bool,
    reasoning: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> ParsedCompletion:
    """Parse a completion text (stop tokens already removed) in one family's syntax.

    `tools` (the request's) types XML-style argument values; without them a value that parses as JSON is JSON.
    """
    reasoning_content, rest = split_reasoning(text, reasoning_open=reasoning_open) if reasoning else (None, text)
    if fmt is ToolCallFormat.LLAMA_JSON:
        parsed = _llama_json(rest)
        if parsed is not None:
            return ParsedCompletion(content="", reasoning_content=reasoning_content, tool_calls=parsed.tool_calls)
        return ParsedCompletion(content=rest.strip(), reasoning_content=reasoning_content)
    opener = _SECTION_OPENERS.get(fmt)
    if opener is None or opener not in rest:
        return ParsedCompletion(content=rest, reasoning_content=reasoning_content)
    before, section = rest.split(opener, 1)
    try:
        calls = _calls_in_section(fmt, opener + section, param_types(tools))
        if not calls:
            raise ValueError("no complete tool call")
    except (ValueError, json.JSONDecodeError) as exc:
        return ParsedCompletion(content=rest, reasoning_content=reasoning_content, parse_error=str(exc))
    return ParsedCompletion(content=before.strip("\n"), reasoning_content=reasoning_content, tool_calls=tuple(calls))
