"""OpenAI chat messages as TITO sees them: validation, the append-only check, and the view templates render.

Owns: role and field validation with errors that say what to fix (strings that are not text - a lone UTF-16
surrogate, valid in JSON - are refused naming the field, also inside an arguments JSON string), tool-call argument
checking (a JSON object, given as a JSON string or an object), the strict-with-JSON-arguments message matcher that
decides whether a request extends the stored history, and the normalised copy handed to jinja (None values dropped
like transformers does, text-part lists joined, arguments as objects or as JSON strings per family; a dict given
where the family renders a string becomes the templates' `tojson`, non-ASCII kept). Does not own multimodal
content: image/audio parts are rejected.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from miles.common.errors import InvalidArgumentError
from miles.session.tito.errors import (
    InvalidMessageError,
    InvalidToolCallArgumentsError,
    NonAppendHistoryError,
    UnsupportedRoleError,
)
from miles.session.tito.render import tojson

Message = Mapping[str, Any]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
_COMPARED_KEYS = ("role", "content", "reasoning_content", "tool_calls")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def first_json_path(value: Any, problem: Callable[[Any], str | None], path: str = "") -> tuple[str, str] | None:
    """(where, what) for the first leaf or mapping key of a JSON value that `problem` describes; None if none.
    `where` is a path such as `messages[1].content` (keys that are not identifiers in brackets, repr-escaped)."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, Mapping):
            children: list[tuple[str, Any]] = []
            for key, child in item.items():
                plain = isinstance(key, str) and key.isidentifier()
                child_path = (f"{where}.{key}" if where else str(key)) if plain else f"{where}[{key!r}]"
                found = problem(key)
                if found is not None:
                    return child_path, found
                children.append((child_path, child))
            stack.extend(reversed(children))
        elif isinstance(item, list | tuple):
            stack.extend(reversed([(f"{where}[{i}]", child) for i, child in enumerate(item)]))
        else:
            found = problem(item)
            if found is not None:
                return where or "body", found
    return None


def lone_surrogate(value: Any) -> str | None:
    """Why a string is not text: it holds a lone UTF-16 surrogate (`"\\ud800"` is valid JSON, but no tokenizer,
    store or response can encode it); None for anything else."""
    if isinstance(value, str) and _LONE_SURROGATE.search(value):
        return (
            "holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text; send valid Unicode (a surrogate "
            "pair, or the character itself)"
        )
    return None


def _holds_lone_surrogate(value: Any) -> bool:
    """Whether any string or key of a JSON value holds a lone surrogate: `first_json_path`'s answer without
    building a path for every node (a turn checks every message it renders, so this runs on each request)."""
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                return True
        elif isinstance(item, dict | Mapping):  # dict first: the ABC check is the slow one
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return False


def check_text(value: Any, *, where: str, error: type[InvalidArgumentError] = InvalidMessageError) -> None:
    """Raise `error` naming the field when a string or key of `value` is not text (see `lone_surrogate`)."""
    if not _holds_lone_surrogate(value):
        return
    found = first_json_path(value, lone_surrogate, where)
    if found is not None:
        raise error(f"{found[0]} {found[1]}", field=found[0])


def content_text(content: Any, *, where: str) -> str:
    """Message content as text: a string, None (""), or a list of `{"type": "text", "text": ...}` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise InvalidMessageError(
                    f"{where}.content has a non-text part; TITO sessions accept text only (string or text parts)",
                    field=f"{where}.content",
                )
        return "".join(parts)
    raise InvalidMessageError(f"{where}.content must be a string, null or a list of text parts", field=where)


def parse_arguments(arguments: Any, *, where: str) -> dict[str, Any]:
    """Tool-call arguments as a dict; they must be a JSON object (string or mapping). "" and None mean {}."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise InvalidToolCallArgumentsError(
                f"{where}.function.arguments is not valid JSON ({exc.msg} at char {exc.pos}); send the arguments "
                'as a JSON object string, e.g. "{\\"city\\": \\"Paris\\"}"',
                field=f"{where}.function.arguments",
            ) from exc
        if isinstance(value, dict):
            check_text(value, where=f"{where}.function.arguments", error=InvalidToolCallArgumentsError)
            return value
    raise InvalidToolCallArgumentsError(
        f"{where}.function.arguments must be a JSON object (got {type(arguments).__name__} "
        f"{str(arguments)[:40]!r}); wrap scalar values in an object",
        field=f"{where}.function.arguments",
    )


def _tool_call_view(call: Any, *, where: str, arguments_as_string: bool) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise InvalidMessageError(f"{where} must be an object with a `function`", field=where)
    function: Mapping[str, Any] = call["function"] if isinstance(call.get("function"), Mapping) else call
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidMessageError(f"{where}.function.name must be a non-empty string", field=f"{where}.function.name")
    raw_arguments = function.get("arguments")
    arguments = parse_arguments(raw_arguments, where=where)
    rendered: Any = arguments
    if arguments_as_string:  # a dict is rendered as the vendor templates' `tojson` renders it (non-ASCII kept)
        rendered = raw_arguments if isinstance(raw_arguments, str) and raw_arguments else tojson(arguments)
    view: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": rendered}}
    if call.get("id"):
        view["id"] = str(call["id"])
    return view


def render_view(message: Message, *, index: int, arguments_as_string: bool = False) -> dict[str, Any]:
    """Validated, normalised copy of one message for a chat template."""
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise InvalidMessageError(f"{where} must be an object with `role` and `content`", field=where)
    check_text(message, where=where)
    role = message.get("role")
    if role not in ROLES:
        raise UnsupportedRoleError(
            f"{where}.role {role!r} is not a chat role; use one of {', '.join(ROLES)}",
            field=f"{where}.role",
            details={"role": str(role), "index": index},
        )
    view: dict[str, Any] = {"role": role, "content": content_text(message.get("content"), where=where)}
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str):
        view["reasoning_content"] = reasoning
    calls = message.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise InvalidMessageError(f"{where}.tool_calls must be a list on an assistant message", field=where)
        view["tool_calls"] = [
            _tool_call_view(call, where=f"{where}.tool_calls[{i}]", arguments_as_string=arguments_as_string)
            for i, call in enumerate(calls)
        ]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            view[key] = message[key]
    return view


def canonical_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """Tools as `{"type": "function", "function": {...}}` (bare function objects are wrapped)."""
    result: list[dict[str, Any]] = []
    check_text(list(tools or ()), where="tools")
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        function = function if isinstance(function, Mapping) else tool
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidMessageError(f"tools[{i}] must be a function tool with a name", field=f"tools[{i}]")
        result.append({"type": "function", "function": dict(function)})
    return result


def _json_equal(a: Any, b: Any) -> bool:
    """JSON equality that keeps types apart (`true` is not `1`, `1` is not `"1"`)."""
    if type(a) is not type(b) and not (isinstance(a, int | float) and isinstance(b, int | float)):
        return False
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _calls_equal(stored: Any, request: Any) -> bool:
    stored_calls, request_calls = list(stored or []), list(request or [])
    if len(stored_calls) != len(request_calls):
        return False
    for s, r in zip(stored_calls, request_calls, strict=True):
        if not isinstance(s, Mapping) or not isinstance(r, Mapping):
            return False
        sf, rf = s.get("function") or {}, r.get("function") or {}
        if (s.get("id") or None) != (r.get("id") or None) or sf.get("name") != rf.get("name"):
            return False
        try:
            if not _json_equal(
                parse_arguments(sf.get("arguments"), where=""), parse_arguments(rf.get("arguments"), where="")
            ):
                return False
        except InvalidToolCallArgumentsError:
            if sf.get("arguments") != rf.get("arguments"):
                return False
    return True


def first_difference(stored: Message, request: Message) -> str | None:
    """The compared key in which two messages differ, or None when they match.

    Compared: role, content, reasoning_content, tool_calls (ids, names, arguments as JSON). None, "" and []
    count as equal; other keys (name, tool_call_id, index) are ignored like Miles' strict matcher does.
    """
    for key in _COMPARED_KEYS:
        a, b = stored.get(key), request.get(key)
        if key == "tool_calls":
            if not _calls_equal(a, b):
                return key
        elif key == "content":
            if content_text(a, where="") != content_text(b, where=""):
                return key
        elif (a or None) != (b or None):
            return key
    return None


def split_appended(stored: Sequence[Message], request: Sequence[Message]) -> list[Message]:
    """The messages `request` appends to `stored`; NonAppendHistoryError when it does not extend it."""
    if len(request) < len(stored):
        raise NonAppendHistoryError(
            f"the request has {len(request)} messages but the session already holds {len(stored)}; send the whole "
            "history you received (every earlier message unchanged) followed by the new messages",
            field="messages",
            details={"num_stored": len(stored), "num_request": len(request)},
        )
    for index, (old, new) in enumerate(zip(stored, request, strict=False)):
        key = first_difference(old, new)
        if key is not None:
            raise NonAppendHistoryError(
                f"messages[{index}] differs from the stored history in `{key}`; a session only accepts appended "
                "messages: resend earlier messages exactly as stored (start a new session to edit history)",
                field=f"messages[{index}].{key}",
                details={"index": index, "key": key},
            )
    return list(request[len(stored) :])
