"""What the router's OpenAPI document says each route answers: request bodies, headers, statuses and media types.

The data-plane routes read their bodies themselves and pass them to an engine untouched, and the engine's answer
comes back unchanged, so FastAPI can infer neither: the body is the engine's (SGLang's) with the fields the router
reads typed here, and the answers are the router's own decisions (the common `Error` body of miles.common.http)
or the engine's, passed through. A schemathesis run over a live router in front of a live engine
(tests/test_router_openapi.py) checks every answer against this document. Plain data: no web framework here.
"""

from __future__ import annotations

from typing import Any

from miles.common.contracts.headers import MIN_WEIGHT_VERSION_HEADER, POOL_HEADER, ROUTING_KEY_HEADER
from miles.router.routing_input import MIN_VERSION_FIELD

Responses = dict[int | str, dict[str, Any]]

_ERROR_REF = {"$ref": "#/components/schemas/Error"}
_ENGINE_BODY: dict[str, Any] = {"type": "object", "description": "The engine's own body, passed through unchanged"}
_ROUTER_OR_ENGINE = {"application/json": {"schema": {"anyOf": [_ERROR_REF, _ENGINE_BODY]}}}
_INTEGER_TEXT = r"^\s*[+-]?\d+\s*$"

ROUTING_HEADERS: list[dict[str, Any]] = [
    {
        "name": POOL_HEADER,
        "in": "header",
        "required": False,
        "schema": {"type": "string"},
        "description": 'The engine pool to route to ("" or absent: the default pool); 503 when the router knows no '
        "such pool (yet)",
    },
    {
        "name": ROUTING_KEY_HEADER,
        "in": "header",
        "required": False,
        "schema": {"type": "string"},
        "description": "Routing key (e.g. a session id): requests with one key stay on one engine (session "
        "affinity); else the body's `session_id`, then `session_params.id`",
    },
    {
        "name": MIN_WEIGHT_VERSION_HEADER,
        "in": "header",
        "required": False,
        "schema": {"type": "string", "pattern": _INTEGER_TEXT},
        "description": "Route only to engines serving at least this weight version (an integer; wins over the "
        "body's min_weight_version); also passed to the engine",
    },
]

_ROUTED_FIELDS: dict[str, Any] = {
    MIN_VERSION_FIELD: {
        "type": ["integer", "null"],
        "description": "Route only to engines serving at least this weight version (400 when not an integer)",
    },
    "session_id": {"type": "string", "description": "Routing key when X-SMG-Routing-Key is absent"},
    "session_params": {
        "type": "object",
        "properties": {"id": {"type": "string"}},
        "description": "SGLang's session parameters; `id` is a routing key when nothing else gives one",
    },
    "input_ids": {
        "type": "array",
        "description": "Token ids (or a batch of them): the prefix key of cache-aware routing",
        "items": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "array", "items": {"type": "integer"}}]},
    },
    "stream": {"type": "boolean", "description": "Ask the engine for server-sent events (relayed chunk by chunk)"},
}


def _passed_body(description: str, prompt_fields: dict[str, Any], examples: dict[str, Any]) -> dict[str, Any]:
    schema = {
        "type": "object",
        "description": f"{description}. Passed to the engine untouched; the router reads only the fields below",
        "properties": {**_ROUTED_FIELDS, **prompt_fields},
        "additionalProperties": True,
    }
    content = {"application/json": {"schema": schema, "examples": examples}}
    return {"parameters": ROUTING_HEADERS, "requestBody": {"required": True, "content": content}}


GENERATE_OPENAPI = _passed_body(
    "SGLang's /generate body (GenerateReqInput)",
    {"text": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}},
    {
        "tokens": {
            "summary": "Token ids in, 4 tokens out",
            "value": {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        },
        "streamed": {
            "summary": "A session's turn, streamed, on an engine with at least weight version 0",
            "value": {
                "text": "Hello",
                "session_id": "episode-1",
                MIN_VERSION_FIELD: 0,
                "sampling_params": {"max_new_tokens": 4},
                "stream": True,
            },
        },
    },
)
CHAT_OPENAPI = _passed_body(
    "An OpenAI chat completion request",
    {"messages": {"type": "array", "items": {"type": "object"}}},
    {
        "turn": {
            "summary": "One user turn",
            "value": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
        }
    },
)
COMPLETIONS_OPENAPI = _passed_body(
    "An OpenAI completion request",
    {"prompt": {"anyOf": [{"type": "string"}, {"type": "array"}]}},
    {"prompt": {"summary": "A text prompt", "value": {"prompt": "Hello", "max_tokens": 4}}},
)

_EVENT_SCHEMA: dict[str, Any] = {
    "description": "One server-sent event `data: <json>` of the engine, relayed as it came; the last one "
    '`data: [DONE]`. An engine dying mid-stream ends it with a `data: {"error": {...}}` event and `data: [DONE]`',
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}},
}
DATA_PLANE_RESPONSES: Responses = {
    200: {
        "description": "The engine's answer, unchanged: JSON, or server-sent events when the body asks to stream",
        "content": {
            "application/json": {"schema": {"anyOf": [{"type": "object"}, {"type": "array"}]}},
            "text/event-stream": {"schema": _EVENT_SCHEMA},
        },
    },
    400: {
        "description": "A routing input the router reads is invalid (X-Miles-Min-Weight-Version or the body's "
        "min_weight_version is not an integer: `invalid_routing_input`), or the engine refused the body",
        "content": _ROUTER_OR_ENGINE,
    },
    401: {"description": "The engine wants a token (passed through)", "content": _ROUTER_OR_ENGINE},
    403: {"description": "The engine refused the token (passed through)", "content": _ROUTER_OR_ENGINE},
    404: {
        "description": "The engine does not serve this route (passed through; miles-engine serves /generate only)",
        "content": _ROUTER_OR_ENGINE,
    },
    409: {
        "description": "No available engine serves the requested weight version yet (`weight_version_too_old`, "
        "Retry-After), or the engine refused the version (passed through); retry",
        "content": _ROUTER_OR_ENGINE,
    },
    429: {
        "description": "Every engine queue of the pool is full, or the request waited beyond queue_timeout_s "
        "(`backpressure`, Retry-After); retry",
        "content": _ROUTER_OR_ENGINE,
    },
    503: {
        "description": "No pool of that name (yet), no available engine in it (`no_routable_engine`), or no "
        "engine answered (`engine_unreachable`); retry",
        "content": _ROUTER_OR_ENGINE,
    },
    "5XX": {
        "description": "The engine's own server error on the last attempt (statuses in retry_on_status are first "
        "retried on other engines), passed through",
        "content": _ROUTER_OR_ENGINE,
    },
}

ENGINE_URL_PATTERN = r"^\s*[hH][tT][tT][pP][sS]?://[^/?#]"
"""What `normalize_engine_url` accepts: an http(s) URL with a host (blanks around and trailing slashes dropped)."""
REGISTER_EXAMPLES: dict[str, Any] = {
    "spare": {
        "summary": "An engine of pool `spare` (probed once: registered unhealthy when it does not answer)",
        "value": {"pool": "spare", "url": "http://127.0.0.1:9", "max_concurrency": 8},
    }
}

ADMIN_ENGINE_RESPONSES: Responses = {
    400: {"description": "`url` is not http(s)://host[:port] (`invalid_routing_input`)"},
    404: {"description": "The router has no such pool, or no such engine in it (`engine_not_found`)"},
}
ADMIN_REGISTER_RESPONSES: Responses = {400: ADMIN_ENGINE_RESPONSES[400]}
ADMIN_STATS_RESPONSES: Responses = {404: {"description": "The router has no such pool (`engine_not_found`)"}}
