"""What the OpenAPI document says each route answers: request bodies, statuses, media types and headers.

The routes (http_api.py) parse their bodies themselves (to name the field of NaN, lone surrogates and over-deep
JSON), so FastAPI cannot infer these: they are stated here, next to each other, and a schemathesis run in the
tests (test_session_openapi.py) checks every answer of a live server against them. Error bodies get the common
`Error` schema from miles.common.http. Transport-free apart from the pydantic models it publishes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from miles.session.api_models import CreateSessionRequest, CreateSessionResponse

Responses = dict[int | str, dict[str, Any]]

PROTOBUF_MEDIA_TYPE = "application/x-protobuf"
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
MAX_IDEMPOTENCY_KEY_CHARS = 255

_UNAVAILABLE = "The store (Redis) cannot be reached, or the session's lock stayed taken (session_busy); retry"
OPERATOR_RESPONSES: Responses = {
    401: {"description": "No `Authorization: Bearer <token>` (when the server has an operator token)"},
    403: {"description": "The bearer token is not the operator token"},
    503: {"description": _UNAVAILABLE},
}
SESSION_RESPONSES: Responses = {
    401: {"description": "No `Authorization: Bearer <token>`"},
    403: {"description": "The bearer token is neither the session's capability token nor the operator token"},
    404: {"description": "No live session has this id (never created, deleted, or expired after its ttl_s)"},
    503: {
        "description": _UNAVAILABLE + "; or this replica cannot load the session's tokenizer (model_unavailable); "
        "or, for a long session's GET or samples, its export process failed (export_unavailable)"
    },
}
TOO_LARGE: Responses = {413: {"description": "The request body is larger than max_body_bytes"}}
JOB_NOT_FOUND: Responses = {404: {"description": "No model config is registered for this job"}}
BAD_BODY = "The body is not valid JSON, nests too deep, holds NaN / Infinity or a lone surrogate, or breaks the schema"

_BUDGET_HEADERS: dict[str, Any] = {
    "X-Miles-Max-New-Tokens": {
        "description": "The completion limit the turn ran with (tokens)",
        "schema": {"type": "string", "pattern": r"^\d+$"},
    },
    "X-Miles-Max-Tokens-Clamped-From": {
        "description": "The max_tokens asked for, when it was clamped to the limit",
        "schema": {"type": "string", "pattern": r"^\d+$"},
    },
}
CHAT_COMPLETION_SCHEMA: dict[str, Any] = {
    "description": "An OpenAI `chat.completion`, plus the `miles` object (turn_index, recorded, weight_version ...)",
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage", "miles"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "chat.completion"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "object"}},
        "usage": {"type": "object"},
        "miles": {"type": "object"},
    },
}
CHAT_EVENT_SCHEMA: dict[str, Any] = {
    "description": "One server-sent event: `data: <chat.completion.chunk JSON>`, the last one `data: [DONE]`",
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}},
}
CHAT_RESPONSES: Responses = {
    200: {
        "description": "The assistant's turn: a `chat.completion`, or with `stream: true` its server-sent events "
        "(assembled from the finished turn)",
        "headers": _BUDGET_HEADERS,
        "content": {
            "application/json": {"schema": CHAT_COMPLETION_SCHEMA},
            "text/event-stream": {"schema": CHAT_EVENT_SCHEMA},
        },
    },
    400: {
        "description": f"{BAD_BODY}; or the messages do not extend the session's history, name an unsupported role, "
        "change the tools, or leave no room to generate (prompt_too_long); or the engine refused the request"
    },
    409: {"description": "The engine answered 409 (e.g. behind a required weight version); retry"},
    422: {"description": "The session id breaks its bounds, or the chat template cannot render the history"},
    502: {
        "description": "The engine answered something that is not a valid SGLang /generate response; or, for a "
        "session that records routing, no routed experts or another number of rows than asked for "
        "(upstream_routing_mismatch)"
    },
    503: {
        "description": "The rollout router / engine cannot be reached, timed out, is overloaded or aborted the "
        "generation; or the store cannot be reached or the session is busy; or, for a LoRA job, no adapter "
        "version was published within adapter_wait_s (adapter_not_published); retry"
    },
}
SAMPLES_RESPONSES: Responses = {
    200: {
        "description": "A miles.session.v1.SessionSamples: protobuf binary with `Accept: application/x-protobuf`, "
        "else the protobuf JSON mapping",
        "content": {
            "application/json": {
                "schema": {"type": "object", "properties": {"samples": {"type": "array", "items": {"type": "object"}}}}
            },
            PROTOBUF_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
        },
    },
    400: {"description": BAD_BODY},
    422: {"description": "The session id breaks its bounds, or the records do not reconstruct its token buffer"},
}
ADAPTER_PUT_RESPONSES: Responses = {
    200: {"description": "The job's live adapter: this one (or the same version again, an idempotent repeat)"},
    400: {"description": f"{BAD_BODY}; or a lora_name that is not `<job_id>@<weight_version>`"},
    404: JOB_NOT_FOUND[404],
    409: {
        "description": "The job's config has lora_adapter false (adapter_not_enabled), or weight_version is lower "
        "than the live adapter's (adapter_version_regressed)"
    },
}
ADAPTER_GET_RESPONSES: Responses = {
    200: {"description": "The job's live adapter"},
    404: {"description": "The job has no live adapter: unknown job, or none published yet (adapter_not_found)"},
}
CREATE_RESPONSES: Responses = {
    201: {"description": "The new session: give `base_url` and `token` to the agent"},
    200: {
        "model": CreateSessionResponse,
        "description": "An Idempotency-Key replay: the key's session, its token rotated",
        "headers": {REPLAYED_HEADER: {"required": True, "schema": {"type": "string", "enum": ["true"]}}},
    },
    400: {
        "description": "A model_family that is not a TITO family or does not fit the model's tokenizer, "
        "chat_template_kwargs that the family pins otherwise, or no job_id while the server has no default model"
    },
    404: {"description": "No model config is registered for job_id and the server has no default model"},
    422: {
        "description": "The body or the Idempotency-Key header breaks the schema (invalid_session_request, e.g. "
        "no body or ttl_s out of range), or the Idempotency-Key came with another body (idempotency_key_reused)"
    },
}


CHAT_EXAMPLES: dict[str, Any] = {
    "first_turn": {
        "summary": "A first turn",
        "value": {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 16},
    },
    "streamed": {
        "summary": "The same turn, streamed, with a usage chunk",
        "value": {
            "messages": [{"role": "user", "content": "What is 2 + 2?"}],
            "max_tokens": 16,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    },
}
CREATE_EXAMPLES: dict[str, Any] = {
    "episode": {"summary": "A session of one episode", "value": {"episode_id": "g12/3", "ttl_s": 600}},
}


def body_schema(model: type[BaseModel], examples: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAPI requestBody (as `openapi_extra`) of a route that parses its body itself."""
    media_type: dict[str, Any] = {"schema": model.model_json_schema()}
    if examples:
        media_type["examples"] = examples
    return {"requestBody": {"required": True, "content": {"application/json": media_type}}}


def create_session_openapi(max_ttl_s: float) -> dict[str, Any]:
    """POST /v1/sessions in the OpenAPI (as `openapi_extra`): its body schema (ttl_s bounded by this server's
    max_ttl_s) and the Idempotency-Key header."""
    extra = body_schema(CreateSessionRequest, CREATE_EXAMPLES)
    ttl = extra["requestBody"]["content"]["application/json"]["schema"]["properties"]["ttl_s"]
    for option in ttl.get("anyOf", [ttl]):
        if option.get("type") == "number":
            option["maximum"] = max_ttl_s
    extra["parameters"] = [
        {
            "name": IDEMPOTENCY_KEY_HEADER,
            "in": "header",
            "required": False,
            "schema": {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_IDEMPOTENCY_KEY_CHARS,
                "pattern": "^[\\x20-\\x7e]+$",
            },
            "example": "episode-g12-3",
            "description": "Makes the create retryable: a replay with the same key and body answers 200 with the "
            "same session and a new token (the previous token stops working) and `Idempotent-Replayed: true`; "
            "the same key with another body is a 422 `idempotency_key_reused`. A key lives as long as its session",
        }
    ]
    return extra
