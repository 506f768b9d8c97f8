"""What the engine's OpenAPI document says each route answers: statuses, media types and bodies, as SGLang does.

FastAPI infers JSON answers and a 422 for every route with a body or a query; this engine answers as SGLang does
(docs/sglang-protocol.md), which the declarations here state: a request that breaks the schema is a 400 with SGLang's
OpenAI-style body (`SchemaError`), never a 422; /flush_cache answers text/plain (200 flushed, 400 not idle);
/health, /health_generate and /abort_request answer an empty body; /generate answers JSON or, with `stream`,
`text/event-stream`; control routes answer `{"success", "message"}` with 200 or 400. Errors the engine raises
on purpose (BadRequestError ...) carry the common `Error` body of miles.common.http, which holds SGLang's
`error.message`. A schemathesis run over a live engine (tests/test_engine_openapi.py) checks every answer
against this document. Transport-free apart from the pydantic models it publishes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from miles.common.contracts.headers import MIN_WEIGHT_VERSION_HEADER
from miles.engine.planning import Limits
from miles.engine.protocol import (
    DiskUpdateResponse,
    GenerateRequest,
    PauseResponse,
    SchemaErrorBody,
    SuccessResponse,
    WeightsCheckerResponse,
)

Responses = dict[int | str, dict[str, Any]]

MIN_WEIGHT_VERSION_PATTERN = r"^\s*[+-]?\d+\s*$"
"""What the header may hold: an integer (Python's int() reading, surrounding blanks allowed)."""
SCHEMA_ERROR = "SchemaError"
_SCHEMA_ERROR_REF = {"$ref": f"#/components/schemas/{SCHEMA_ERROR}"}
_ERROR_REF = {"$ref": "#/components/schemas/Error"}
_PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
_BAD_SCHEMA = "The request breaks the schema (SGLang's OpenAI-style `SchemaError` body)"

GENERATE_EVENT_SCHEMA: dict[str, Any] = {
    "description": "One server-sent event `data: <json>`: a cumulative chunk (`text`, `output_ids`, `meta_info`; "
    '`index` in batches), an in-band `{"error": {...}}`, and last `data: [DONE]`',
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "pattern": r"^(\[DONE\]|\{.*\})$"}},
}
_GENERATE_RESULT_SCHEMA: dict[str, Any] = {
    "description": "One response object (`text`, `output_ids`, `meta_info`), or a list of them for a batch or n > 1. "
    "With `return_routed_experts` and --enable-return-routed-experts, `meta_info.routed_experts` is base64 of "
    "little-endian int32 (prompt_tokens + completion_tokens - 1 - routed_experts_start_len, MoE layers, experts "
    "per token); in a stream only the last chunk of a sequence carries it. `meta_info.miles_weight_version_spans` "
    "(a miles extension) is `[[start, end, weight_version], ...]` over `output_ids`: the weights that sampled each "
    "token (several when an in_place or retract pause carried the request across a weight update)",
    "anyOf": [
        {"type": "object", "required": ["meta_info"]},
        {"type": "array", "items": {"type": "object", "required": ["meta_info"]}},
    ],
}
GENERATE_RESPONSES: Responses = {
    200: {
        "description": "The generation: JSON, or with `stream: true` server-sent events ending with `data: [DONE]`",
        "content": {
            "application/json": {"schema": _GENERATE_RESULT_SCHEMA},
            "text/event-stream": {"schema": GENERATE_EVENT_SCHEMA},
        },
    },
    400: {
        "description": "The body is not JSON or breaks the schema (`SchemaError`), or cannot be served as sent: no "
        "prompt, token ids outside the vocabulary, too long for the context or the KV cache, bad sampling "
        "parameters, a routed_experts_start_len outside [0, prompt length] with return_routed_experts, a rid "
        "already in flight, an unsupported field, a malformed X-Miles-Min-Weight-Version (`Error`, with SGLang's "
        "`error.message`)",
        "content": {"application/json": {"schema": {"anyOf": [_ERROR_REF, _SCHEMA_ERROR_REF]}}},
    },
    409: {
        "description": "min_weight_version (or X-Miles-Min-Weight-Version) is newer than the served weights; "
        "retry once the engine is updated"
    },
}
GENERATE_EXAMPLES: dict[str, Any] = {
    "tokens": {
        "summary": "Token ids in, 8 tokens out, with their logprobs and (MoE model, --enable-return-routed-experts) "
        "the experts of positions 3 to 9",
        "value": {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            "return_logprob": True,
            "return_routed_experts": True,
            "routed_experts_start_len": 3,
        },
    },
    "streamed": {
        "summary": "A text prompt, streamed",
        "value": {"text": "Hello", "sampling_params": {"max_new_tokens": 4}, "stream": True},
    },
    "batch": {
        "summary": "A batch of two prompts, two samples each",
        "value": {"text": ["a", "b"], "sampling_params": {"n": 2, "max_new_tokens": 2}},
    },
}
GENERATE_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": GenerateRequest.model_json_schema(), "examples": GENERATE_EXAMPLES}},
    },
    "parameters": [
        {
            "name": MIN_WEIGHT_VERSION_HEADER,
            "in": "header",
            "required": False,
            "schema": {"type": "string", "pattern": MIN_WEIGHT_VERSION_PATTERN},
            "description": "miles extension: refuse with 409 unless the engine serves at least this weight version "
            "(wins over the body's min_weight_version)",
        }
    ],
}

NO_BODY: dict[str, Any] = {}
"""`content` of an answer without a body (an empty `content` map is dropped from the document)."""
ONE_TENSOR_PAYLOAD = "NgAAAAAAAAB7InciOnsiZHR5cGUiOiJGMzIiLCJzaGFwZSI6WzFdLCJkYXRhX29mZnNldHMiOlswLDRdfX0AAIA/"
"""base64 of a safetensors payload holding one float32 tensor `w` = [1.0] (a real model refuses the name)."""
TENSOR_EXAMPLES: dict[str, Any] = {
    "one_tensor": {
        "summary": "One safetensors chunk, and the version it makes",
        "value": {"serialized_named_tensors": [ONE_TENSOR_PAYLOAD], "weight_version": "7"},
    }
}
STAGE_EXAMPLES: dict[str, Any] = {
    "one_tensor": {
        "summary": "Stage one chunk of version 7",
        "value": {"serialized_named_tensors": [ONE_TENSOR_PAYLOAD], "stage_id": "v7"},
    }
}
APPLY_EXAMPLES: dict[str, Any] = {
    "staged": {"summary": "Swap in what was staged as v7", "value": {"stage_id": "v7", "weight_version": "7"}}
}

HEALTH_RESPONSES: Responses = {200: {"description": "The engine has started (no body)", "content": NO_BODY}}
HEALTH_GENERATE_RESPONSES: Responses = {
    200: {"description": "One token was generated (no body)", "content": NO_BODY},
    503: {"description": "Paused, or no token within health_generate_timeout_s (no body)", "content": NO_BODY},
}
FLUSH_MESSAGE_SCHEMA: dict[str, Any] = {"type": "string"}
FLUSH_RESPONSES: Responses = {
    200: {"description": "The prefix cache was flushed", "content": {"text/plain": {"schema": FLUSH_MESSAGE_SCHEMA}}},
    400: {
        "description": "Requests were running or waiting until `timeout` passed: nothing was flushed (text/plain); "
        "or `timeout` is not a finite number >= 0 (`SchemaError`)",
        "content": {
            "text/plain": {"schema": FLUSH_MESSAGE_SCHEMA},
            "application/json": {"schema": _SCHEMA_ERROR_REF},
        },
    },
}
EMPTY_OK: Responses = {200: {"description": "Done (no body, as SGLang)", "content": NO_BODY}}
PAUSE_RESPONSES: Responses = {200: {"model": PauseResponse, "description": "The engine is paused"}}
CONTINUE_RESPONSES: Responses = {200: {"model": PauseResponse, "description": "The engine generates again"}}
REFUSED: Responses = {
    400: {"model": SuccessResponse, "description": "Refused or failed (`success` false); nothing was changed"}
}
DISK_UPDATE_RESPONSES: Responses = {
    200: {"model": DiskUpdateResponse, "description": "The new weights are served"},
    400: {"model": DiskUpdateResponse, "description": "Refused or failed (`success` false); nothing was changed"},
}
MEMORY_RESPONSES: Responses = {
    200: {"description": "Done: JSON null, as SGLang", "content": {"application/json": {"schema": {"type": "null"}}}},
}
RELEASE_REFUSED: Responses = {
    400: {"description": "Requests are running or waiting, so the KV cache cannot be released (`Error`)"}
}
CHECK_REFUSED: Responses = {
    400: {"model": WeightsCheckerResponse, "description": "Unknown action or dtype, or a model without weights"}
}


def complete_openapi(limits: Limits) -> Callable[[dict[str, Any]], None]:
    """The app's OpenAPI hook: SGLang's 400 for schema errors instead of FastAPI's 422 on every route that reads
    a body or a query, the `SchemaError` body, no body where the engine answers none, and /generate's bounds that
    come from the model and the settings (`limits`)."""

    def complete(document: dict[str, Any]) -> None:
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        schemas[SCHEMA_ERROR] = SchemaErrorBody.model_json_schema()
        for path, path_item in document.get("paths", {}).items():
            if path in _PROBE_PATHS:
                continue
            for operation in path_item.values():
                _schema_errors_are_400(operation)
                _no_content_where_empty(operation)
        for operation in document.get("paths", {}).get("/generate", {}).values():
            # A new requestBody: FastAPI's document shares GENERATE_OPENAPI's objects, which must stay unbounded.
            body = operation["requestBody"]
            media_type = body["content"]["application/json"]
            bounded = {**media_type, "schema": bounded_generate_schema(media_type["schema"], limits)}
            operation["requestBody"] = {**body, "content": {**body["content"], "application/json": bounded}}

    return complete


def bounded_generate_schema(schema: dict[str, Any], limits: Limits) -> dict[str, Any]:
    """A copy of GenerateRequest's schema with what the engine checks against its model and settings: token ids
    below the vocabulary size, a prompt shorter than the context, max_new_tokens that fits the context and the KV
    cache, at most `max_sequences_per_request` prompts and samples (planning.py)."""
    bounded = copy.deepcopy(schema)
    properties = bounded["properties"]
    max_sequences = limits.max_sequences_per_request
    token_id = {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}
    prompt = {"type": "array", "minItems": 1, "maxItems": limits.context_length - 1, "items": token_id}
    properties["input_ids"]["anyOf"][:2] = [prompt, {**prompt, "maxItems": max_sequences, "items": prompt}]
    token_ids = {"type": "array", "items": token_id}
    properties["token_ids_logprob"]["anyOf"][:2] = [token_ids, {"type": "array", "items": token_ids}]
    properties["text"]["anyOf"][1]["maxItems"] = max_sequences
    one, batch = properties["sampling_params"]["anyOf"][:2]
    batch["maxItems"] = max_sequences
    max_new_tokens = min(limits.context_length - 2, limits.max_total_tokens - 1)  # with a prompt of one token
    for sampling in (one, batch["items"]):
        sampling["properties"]["n"]["maximum"] = max_sequences
        sampling["properties"]["max_new_tokens"]["maximum"] = max_new_tokens
    return bounded


def _schema_errors_are_400(operation: dict[str, Any]) -> None:
    """FastAPI's 422 becomes SGLang's 400 with the `SchemaError` body (next to the route's own 400 bodies)."""
    responses = operation.get("responses", {})
    if responses.pop("422", None) is None:
        return  # FastAPI adds 422 exactly where it validates a body or a query
    bad = responses.get("400")
    if bad is None:
        responses["400"] = {
            "description": _BAD_SCHEMA,
            "headers": dict(responses.get("200", {}).get("headers", {})),
            "content": {"application/json": {"schema": _SCHEMA_ERROR_REF}},
        }
        return
    # New objects, never edited in place: the shared answers (miles.common.http) reuse theirs across operations.
    content = bad.get("content") or {}
    schema = content.get("application/json", {}).get("schema", _ERROR_REF)
    options = schema.get("anyOf", [schema])
    if _SCHEMA_ERROR_REF not in options:
        json_body = {**content.get("application/json", {}), "schema": {"anyOf": [*options, _SCHEMA_ERROR_REF]}}
        responses["400"] = {
            **bad,
            "description": f"{bad.get('description', '')}; or: {_BAD_SCHEMA}",
            "content": {**content, "application/json": json_body},
        }


def _no_content_where_empty(operation: dict[str, Any]) -> None:
    """An answer declared with `content: NO_BODY` has no body, so no media type (an empty map says the same,
    less plainly)."""
    for response in operation.get("responses", {}).values():
        if response.get("content") == NO_BODY:
            del response["content"]
