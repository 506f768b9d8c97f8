"""Request bodies: parsed and checked before a route sees them, and bounded in size.

`parse_body` reads a JSON body into a pydantic model; invalid JSON or fields, NaN / Infinity, lone surrogates and
nesting deeper than MAX_JSON_DEPTH -> the route's InvalidRequestError subclass (400 by default), naming the field.
`BodyLimitMiddleware` answers 413 for bodies over max_body_bytes.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from miles.common.errors import MilesError
from miles.common.http import error_response
from miles.session.errors import InvalidRequestError, RequestTooLargeError
from miles.session.tito.messages import first_json_path, lone_surrogate

M = TypeVar("M", bound=BaseModel)
MAX_JSON_DEPTH = 64


class BodyLimitMiddleware:
    """413 for bodies over max_bytes: by Content-Length up front, else while the body is read."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await error_response(self._error())(scope, receive, send)
            return
        num_received = 0

        async def limited_receive() -> Message:
            nonlocal num_received
            message = await receive()
            num_received += len(message.get("body", b""))
            if num_received > self.max_bytes:
                raise self._error()  # a MilesError: the app's handler answers 413
            return message

        await self.app(scope, limited_receive, send)

    def _error(self) -> RequestTooLargeError:
        return RequestTooLargeError(f"the request body is larger than max_body_bytes={self.max_bytes}")


def _not_json(value: Any) -> str | None:
    """Why a parsed leaf is not JSON text or number: NaN / Infinity (Python's json reads the literals and turns
    1e999 into inf; JSON has neither) or a lone surrogate."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"is {value}, which is not a JSON number; send a finite number"
    return lone_surrogate(value)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _loads(raw: bytes) -> tuple[Any, bool]:
    """The parsed body, and False only when nothing in it can be NaN, infinite or a lone surrogate, so that the walk
    over every value (~0.1 ms for an 8-turn history, growing with it) is skipped for an ordinary body. Numbers are
    checked as they are parsed; for surrogates the bytes are searched for their UTF-8 spellings: an escape, or a
    raw UTF-8-encoded one (json.loads decodes bytes with surrogatepass). A match, even inside a string, only means
    the body is walked."""
    non_finite = False

    def number(text: str) -> float:
        nonlocal non_finite
        value = float(text)
        non_finite = non_finite or not math.isfinite(value)  # 1e999 parses to inf
        return value

    def constant(text: str) -> float:  # NaN, Infinity, -Infinity: refused after the walk names the field
        nonlocal non_finite
        non_finite = True
        return float(text)

    data = json.loads(raw, parse_float=number, parse_constant=constant)
    if non_finite or b"\x00" in raw[:4] or b"\xed" in raw:  # \x00: UTF-16/32, whose surrogates look otherwise
        return data, True
    return data, b"\\u" in raw and _SURROGATE_ESCAPE.search(raw) is not None


def _depth_exceeds(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
    return False


async def parse_body(
    request: Request, model: type[M], *, allow_empty: bool = False, error: type[MilesError] = InvalidRequestError
) -> M:
    """The body as `model`; `error` (InvalidRequestError, 400, by default) naming the problem otherwise. NaN,
    Infinity and valid JSON that is not text (a lone UTF-16 surrogate anywhere) are refused here, naming the field."""
    raw = await request.body()
    if not raw.strip():
        if not allow_empty:
            raise error("the request body is empty; send a JSON object", field="body")
        data: Any = {}
        suspicious = False
    else:
        try:
            data, suspicious = _loads(raw)  # NaN / Infinity are refused below, naming the field
        except (ValueError, RecursionError) as exc:
            raise error(f"the request body is not valid JSON ({type(exc).__name__}: {exc})", field="body") from None
    if _depth_exceeds(data, MAX_JSON_DEPTH):
        raise error(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", field="body")
    not_json = first_json_path(data, _not_json) if suspicious else None
    if not_json is not None:
        raise error(f"{not_json[0]} {not_json[1]}", field=not_json[0])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = [{"field": ".".join(str(p) for p in e["loc"]), "message": e["msg"]} for e in exc.errors()]
        first = problems[0]
        raise error(
            f"{first['field'] or 'body'}: {first['message']}",
            field=first["field"] or "body",
            details={"errors": problems[:20]},
        ) from None
