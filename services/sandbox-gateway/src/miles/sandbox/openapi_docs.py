"""What the HTTP facade's OpenAPI document says each route answers, and the request bounds it states.

Statuses, media types (the exec route's `application/x-ndjson` stream, the file routes' raw bytes) and response
headers are listed here, next to each other. Request bounds are enforced once, for gRPC and HTTP alike, by
validation.py (400 naming the field); the document states them too: the static ones on the body models
(http_api.py), and those that come from the gateway's settings (maxima, template names) by `state_request_bounds`,
which completes the generated document. A schemathesis run in the tests (test_sandbox_openapi.py) checks every
answer of a live gateway against this document.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from miles.sandbox.settings import SandboxSettings

NDJSON = "application/x-ndjson"
Responses = dict[int | str, dict[str, Any]]

INVALID: Responses = {400: {"description": "A field is out of range or malformed; `field` names it"}}
NOT_FOUND: Responses = {
    404: {"description": "No live sandbox with this id, or one of another job (a job's token cannot tell which)"}
}
GONE: Responses = {409: {"description": "The sandbox exists but can no longer run anything (its processes died)"}}
CREATE_RESPONSES: Responses = {
    **INVALID,
    429: {"description": "The job (max_sandboxes_per_job) or the gateway (max_sandboxes) is at its quota"},
    503: {"description": "The backend could not start a sandbox; retry"},
}

_RESULT_PROPERTIES: dict[str, Any] = {
    "exit_code": {"type": "integer", "description": "-1 when a signal ended the command"},
    "signal": {"type": "integer"},
    "wall_s": {"type": "number"},
    "cpu_s": {"type": "number"},
    "limits_hit": {
        "type": "array",
        "items": {"enum": ["timeout", "cpu", "memory", "processes", "file_size", "output"]},
    },
    "stdout_bytes": {"type": "integer"},
    "stderr_bytes": {"type": "integer"},
}
EXEC_LINE_SCHEMA: dict[str, Any] = {
    "description": "One line of the stream (the schema of each line): output chunks as they come, then exactly "
    "one result line, or an error line when the exec failed after the stream started",
    "oneOf": [
        {
            "type": "object",
            "required": ["type", "stream", "data_b64"],
            "properties": {
                "type": {"const": "output"},
                "stream": {"enum": ["stdout", "stderr"]},
                "data_b64": {"type": "string", "contentEncoding": "base64"},
            },
        },
        {
            "type": "object",
            "required": ["type", *_RESULT_PROPERTIES],
            "properties": {"type": {"const": "result"}, **_RESULT_PROPERTIES},
        },
        {
            "type": "object",
            "required": ["type", "error"],
            "properties": {"type": {"const": "error"}, "error": {"type": "object", "required": ["code", "message"]}},
        },
    ],
}
EXEC_RESPONSES: Responses = {
    200: {
        "description": "`stream: true` (default): an NDJSON stream of output and result lines; `stream: false`: "
        "the whole exec as one JSON object",
        "content": {NDJSON: {"schema": EXEC_LINE_SCHEMA}},
    },
    **INVALID,
    **NOT_FOUND,
    **GONE,
    413: {"description": "stdin is larger than max_stdin_bytes"},
}
EXEC_EXAMPLES: dict[str, Any] = {
    "streamed": {"summary": "A shell command, streamed", "value": {"shell": "cat notes/hello.txt; echo done >&2"}},
    "collected": {
        "summary": "An argv, answered at once",
        "value": {"argv": ["wc", "-c"], "stdin": "12345", "stream": False},
    },
}
CREATE_EXAMPLES: dict[str, Any] = {
    "job": {"summary": "A sandbox of a job", "value": {"job_id": "job-7", "limits": {"memory_bytes": 268435456}}},
}
FILE_PATH_EXAMPLES: dict[str, Any] = {"relative": {"summary": "Inside the work dir", "value": "hello.txt"}}
WRITE_BODY: dict[str, Any] = {
    "requestBody": {
        "description": "The file's bytes (empty: an empty file)",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}, "example": "hi"}},
    }
}
WRITE_RESPONSES: Responses = {
    **INVALID,
    **NOT_FOUND,
    **GONE,
    413: {"description": "The body is larger than max_write_bytes"},
}
READ_RESPONSES: Responses = {
    200: {
        "description": "The file's bytes, at most max_bytes (0: the gateway's max_read_bytes)",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        "headers": {
            "X-Miles-File-Size": {
                "description": "The whole file's size, bytes",
                "required": True,
                "schema": {"type": "integer", "minimum": 0},
            },
            "X-Miles-Truncated": {
                "description": "Whether the answer holds less than the whole file",
                "required": True,
                "schema": {"enum": ["true", "false"]},
            },
        },
    },
    **INVALID,
    **NOT_FOUND,
    **GONE,
}


def state_request_bounds(settings: SandboxSettings) -> Callable[[dict[str, Any]], None]:
    """An OpenAPI hook (miles.common.http) stating the bounds this gateway's settings put on requests: the
    maxima of ttl_s, timeout_s and every limit, and the template names. 0 still means "the default"."""

    def hook(document: dict[str, Any]) -> None:
        schemas = document["components"]["schemas"]
        create = schemas["CreateBody"]["properties"]
        create["ttl_s"]["maximum"] = settings.max_ttl_s
        create["template"]["enum"] = ["", *sorted(settings.templates)]
        limits = schemas["LimitsBody"]["properties"]
        for name, maximum in settings.max_limits.model_dump().items():
            limits[name]["maximum"] = maximum
        schemas["ExecBody"]["properties"]["timeout_s"]["maximum"] = settings.max_timeout_s

    return hook
