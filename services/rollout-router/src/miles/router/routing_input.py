"""What the router reads from a data-plane request to route it, without ever changing or rejecting the body.

From headers: the pool (`X-Miles-Pool`), the routing key (`X-SMG-Routing-Key`), the minimum weight version
(`X-Miles-Min-Weight-Version`). From the JSON body, when it is a JSON object: the routing key (`session_id`, then
`session_params.id`) and `min_weight_version` when the headers do not carry them, the prompt as a prefix-tree
key — `input_ids` when present, else the text (`text` for /generate, `prompt` for /v1/completions, the message
contents joined by spaces for /v1/chat/completions, as the SGLang router does) — and the LoRA adapter
(`lora_path`; absent or null: the base model). A body that is not JSON (or not an object) routes by headers alone;
the engine then answers it (e.g. 400), and that answer is passed through.

LoRA: an engine caches an adapter's KV apart from every other adapter's and the base model's, so the prefix key
of an adapter's request starts with a header naming the adapter (radix.encode_namespace; the match rate counts
the prompt only), and its routing key is the pair (lora_path, key): a session's KV lives under the adapter version
it was served with, and the sessions of different jobs never share an entry. (The SGLang router, as read in
docs/sglang-protocol.md §6.4, routes on the prompt text alone, whatever the adapter.)

Limits: for batch requests (2-D input_ids, list prompts, a list of lora_path) only the first item is used; the
token estimate of a text prompt is characters / 4; a routing key is joined to its lora_path by a NUL character,
so a base-model key spelled `<lora_path>\0<key>` shares that adapter session's entry (only affinity is affected).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from miles.common.contracts import headers as header_names
from miles.router.errors import InvalidRoutingInputError
from miles.router.radix import encode_namespace, encode_text, encode_token_ids, num_units

# Looked up by lower-case name (Starlette's Headers match any spelling; tests pass plain dicts of lower-case names).
POOL_HEADER = header_names.POOL_HEADER.lower()
ROUTING_KEY_HEADER = header_names.ROUTING_KEY_HEADER.lower()
MIN_VERSION_HEADER = header_names.MIN_WEIGHT_VERSION_HEADER.lower()
MIN_VERSION_FIELD = "min_weight_version"

ROUTE_GENERATE = "/generate"
ROUTE_CHAT = "/v1/chat/completions"
ROUTE_COMPLETIONS = "/v1/completions"
DATA_PLANE_ROUTES = (ROUTE_GENERATE, ROUTE_CHAT, ROUTE_COMPLETIONS)

_CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class RoutingInput:
    """Everything routing needs from one request (the body itself travels separately, untouched)."""

    route: str
    pool: str
    routing_key: str | None
    """The session's key for affinity; `<lora_path>\0<key>` for an adapter's request (module docstring)."""
    min_weight_version: int | None
    prefix_key: bytes
    """Prompt as a radix-tree key (radix.encode_*); b"" when the body carried no usable prompt."""
    is_token_key: bool
    """True when prefix_key holds token ids (then response output ids can extend it)."""
    num_tokens: int
    """Estimated prompt tokens, for load accounting (>= 1)."""
    lora_path: str | None = None
    """The LoRA adapter the request names (None: the base model)."""
    namespace_units: int = 0
    """Units at the head of prefix_key that name the adapter (radix.encode_namespace), not the prompt: 0 for the
    base model."""


def parse_routing_input(route: str, headers: Mapping[str, str], body: bytes, default_pool: str) -> RoutingInput:
    """Routing inputs of one request; raises InvalidRoutingInputError only for the router's own inputs."""
    payload = _json_object(body)
    pool = headers.get(POOL_HEADER, "").strip() or default_pool
    routing_key = headers.get(ROUTING_KEY_HEADER, "").strip() or _body_routing_key(payload)
    min_version = _min_weight_version(headers, payload)
    prefix_key, is_token_key = _prefix_key(route, payload)
    if is_token_key:
        num_tokens = num_units(prefix_key)
    else:
        num_tokens = max(1, num_units(prefix_key) // _CHARS_PER_TOKEN) if prefix_key else max(1, len(body) // 8)
    lora_path = _lora_path(payload)
    header = encode_namespace(lora_path) if lora_path is not None and prefix_key else b""
    if lora_path is not None and routing_key is not None:
        routing_key = f"{lora_path}\0{routing_key}"
    return RoutingInput(
        route=route,
        pool=pool,
        routing_key=routing_key,
        min_weight_version=min_version,
        prefix_key=header + prefix_key,
        is_token_key=is_token_key,
        num_tokens=max(1, num_tokens),
        lora_path=lora_path,
        namespace_units=num_units(header),
    )


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):  # not JSON text, or nested too deep to read: the engine judges it
        return None
    return payload if isinstance(payload, dict) else None


def _body_routing_key(payload: dict[str, Any] | None) -> str | None:
    if payload is None:
        return None
    session_id = payload.get("session_id")
    if isinstance(session_id, str) and session_id:
        return session_id
    session_params = payload.get("session_params")
    if isinstance(session_params, dict):
        stateful_id = session_params.get("id")
        if isinstance(stateful_id, str) and stateful_id:
            return stateful_id
    return None


def _lora_path(payload: dict[str, Any] | None) -> str | None:
    """The adapter of the request (of its first item for a batch's list); None for the base model and for a value
    that names no adapter (the engine answers that one)."""
    value = payload.get("lora_path") if payload is not None else None
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, str) else None


def _min_weight_version(headers: Mapping[str, str], payload: dict[str, Any] | None) -> int | None:
    raw_header = headers.get(MIN_VERSION_HEADER, "").strip()
    if raw_header:
        try:
            return int(raw_header)
        except ValueError:
            raise InvalidRoutingInputError(
                f"header {header_names.MIN_WEIGHT_VERSION_HEADER} must be an integer, got {raw_header!r}",
                field=header_names.MIN_WEIGHT_VERSION_HEADER,
            ) from None
    if payload is None or payload.get(MIN_VERSION_FIELD) is None:
        return None
    value = payload[MIN_VERSION_FIELD]
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRoutingInputError(
            f"body field min_weight_version must be an integer, got {value!r}", field=MIN_VERSION_FIELD
        )
    return value


def _prefix_key(route: str, payload: dict[str, Any] | None) -> tuple[bytes, bool]:
    if payload is None:
        return b"", False
    token_key = _token_key(payload.get("input_ids"))
    if token_key is not None:
        return token_key, True
    if route == ROUTE_COMPLETIONS:
        prompt = payload.get("prompt")
        token_key = _token_key(prompt)
        if token_key is not None:
            return token_key, True
        text = _first_text(prompt)
    elif route == ROUTE_CHAT:
        text = _chat_text(payload.get("messages"))
    else:
        text = _first_text(payload.get("text"))
    return (encode_text(text), False) if text else (b"", False)


def _token_key(value: object) -> bytes | None:
    """input_ids (1-D) or the first row of a batch (2-D), encoded; None when absent or not token ids."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        value = value[0]
    if not isinstance(value, list) or not value:
        return None
    return encode_token_ids(value)  # rejects anything that is not a list of non-negative 32-bit integers


def _first_text(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[0], str):
        return value[0]
    return ""


def _chat_text(messages: object) -> str:
    if not isinstance(messages, list):
        return ""
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        for field_name in ("content", "reasoning_content"):
            content = message.get(field_name)
            if isinstance(content, str) and content:
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(
                    part["text"]
                    for part in content
                    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                )
    return " ".join(parts)
