"""What the router reads from requests (headers first, then the JSON body) and from answers."""

from __future__ import annotations

import json

import pytest

from miles.router.errors import InvalidRoutingInputError
from miles.router.radix import encode_namespace, encode_text, encode_token_ids
from miles.router.response_meta import SseTail, continuation_key, meta_from_body
from miles.router.routing_input import RoutingInput, parse_routing_input


def parse(route: str, body: object, **headers: str) -> RoutingInput:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    normalized = {name.replace("_", "-").lower(): value for name, value in headers.items()}
    return parse_routing_input(route, normalized, raw, "default")


def test_headers_win_over_body() -> None:
    body = {"input_ids": [1, 2, 3], "session_id": "body-key", "min_weight_version": 1}
    request = parse("/generate", body, x_smg_routing_key="hdr", x_miles_min_weight_version="4", x_miles_pool="p")
    assert (request.routing_key, request.min_weight_version, request.pool) == ("hdr", 4, "p")
    assert request.prefix_key == encode_token_ids([1, 2, 3]) and request.is_token_key and request.num_tokens == 3


def test_body_fields_when_headers_are_absent() -> None:
    request = parse("/generate", {"text": "hello", "session_id": "s1", "min_weight_version": 2})
    assert (request.routing_key, request.min_weight_version, request.pool) == ("s1", 2, "default")
    assert request.prefix_key == encode_text("hello") and not request.is_token_key
    stateful = parse("/generate", {"text": "x", "session_params": {"id": "sess-9"}})
    assert stateful.routing_key == "sess-9"


def test_non_json_body_routes_by_headers_alone() -> None:
    request = parse("/generate", b"{not json", x_smg_routing_key="k")
    assert request.routing_key == "k" and request.prefix_key == b"" and request.num_tokens >= 1
    assert parse("/generate", b"[1, 2]").routing_key is None


def test_json_nested_too_deep_to_read_routes_by_headers_alone() -> None:
    request = parse("/generate", b"[" * 100_000, x_smg_routing_key="k")  # json.loads: RecursionError
    assert request.routing_key == "k" and request.prefix_key == b""


def test_invalid_router_inputs_are_400() -> None:
    with pytest.raises(InvalidRoutingInputError, match="integer"):
        parse("/generate", {}, x_miles_min_weight_version="v3")
    with pytest.raises(InvalidRoutingInputError):
        parse("/generate", {"min_weight_version": "3"})


def test_openai_prompts() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    chat = parse("/v1/chat/completions", {"messages": messages})
    assert chat.prefix_key == encode_text("be brief hi")
    tito_chat = parse("/v1/chat/completions", {"messages": [], "input_ids": [5, 6]})
    assert tito_chat.prefix_key == encode_token_ids([5, 6])
    completion_ids = parse("/v1/completions", {"prompt": [[7, 8], [9]]})
    assert completion_ids.prefix_key == encode_token_ids([7, 8])
    completion_text = parse("/v1/completions", {"prompt": ["abc", "def"]})
    assert completion_text.prefix_key == encode_text("abc")


def test_generate_answer_counts_and_continuation() -> None:
    meta_info = {"prompt_tokens": 10, "cached_tokens": 6, "completion_tokens": 3, "weight_version": "4"}
    body = {"text": "xy", "output_ids": [7, 8, 9], "meta_info": meta_info}
    meta = meta_from_body(json.dumps(body).encode())
    assert meta is not None
    assert (meta.num_prompt_tokens, meta.num_cached_tokens, meta.weight_version) == (10, 6, 4)
    request = parse("/generate", {"input_ids": [1, 2]})
    assert continuation_key(request, meta) == encode_token_ids([7, 8])  # the last token is not cached
    text_request = parse("/generate", {"text": "ab"})
    assert continuation_key(text_request, meta) == "xy".encode("utf-32-le")


def test_batch_and_openai_answers() -> None:
    item = {"output_ids": [1], "meta_info": {"prompt_tokens": 5, "cached_tokens": 2, "weight_version": "default"}}
    batch = meta_from_body(json.dumps([item, item]).encode())
    assert batch is not None and (batch.num_prompt_tokens, batch.num_cached_tokens) == (10, 4)
    assert batch.weight_version == 0  # SGLang's "default": the initial weights (miles.common.contracts)
    unlabelled = meta_from_body(json.dumps([{**item, "meta_info": {"weight_version": "v2"}}]).encode())
    assert unlabelled is not None and unlabelled.weight_version is None  # no version: unknown
    usage = {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 3}}}
    openai = meta_from_body(json.dumps(usage).encode())
    assert openai is not None and (openai.num_prompt_tokens, openai.num_cached_tokens) == (9, 3)
    assert meta_from_body(b'{"error": {"message": "bad"}}') is None
    assert meta_from_body(b"not json") is None


def test_sse_tail_keeps_last_event_across_chunk_boundaries() -> None:
    events = [
        b'data: {"output_ids": [1], "meta_info": {"prompt_tokens": 4, "cached_tokens": 0, "completion_tokens": 1}}\n\n',
        b'data: {"output_ids": [1, 2], "meta_info": {"prompt_tokens": 4, "cached_tokens": 3, "completion_tokens": 2}}'
        b"\n\n",
        b"data: [DONE]\n\n",
    ]
    stream = b"".join(events)
    tail = SseTail()
    for start in range(0, len(stream), 7):  # split mid-event, mid-line
        tail.feed(stream[start : start + 7])
    assert tail.saw_done and tail.at_event_boundary and tail.bytes_seen == len(stream)
    meta = tail.meta()
    assert meta is not None and meta.num_cached_tokens == 3 and meta.output_ids == [1, 2]
    partial = SseTail()
    partial.feed(events[0][:20])
    assert not partial.at_event_boundary and partial.meta() is None


def test_delta_stream_output_is_not_learned() -> None:
    chunk = {"output_ids": [9], "meta_info": {"prompt_tokens": 4, "completion_tokens": 3}}
    meta = meta_from_body(json.dumps(chunk).encode())
    assert meta is not None and meta.output_ids is None


def test_lora_requests_are_keyed_under_their_adapter() -> None:
    request = parse("/generate", {"input_ids": [1, 2, 3], "lora_path": "job@4", "session_id": "s1"})
    header, tokens = encode_namespace("job@4"), encode_token_ids([1, 2, 3])
    assert tokens is not None and request.prefix_key == header + tokens and request.is_token_key
    assert (request.lora_path, request.namespace_units, request.num_tokens) == ("job@4", 7, 3)
    assert request.routing_key == "job@4\0s1"
    by_header = parse("/generate", {"text": "hi", "lora_path": "job@4"}, x_smg_routing_key="k")
    assert by_header.prefix_key == header + encode_text("hi") and by_header.routing_key == "job@4\0k"
    batch = parse("/generate", {"input_ids": [[1], [2]], "lora_path": ["job@4", None]})
    assert batch.prefix_key == header + tokens[:4]
    for base in (
        {"input_ids": [1, 2, 3], "lora_path": None, "session_id": "s1"},
        {"input_ids": [1, 2, 3], "lora_path": 5, "session_id": "s1"},
    ):
        plain = parse("/generate", base)
        assert (plain.prefix_key, plain.routing_key, plain.namespace_units) == (tokens, "s1", 0)
    promptless = parse("/generate", {"lora_path": "job@4"})
    assert (promptless.prefix_key, promptless.namespace_units) == (b"", 0)


def test_namespace_headers_never_prefix_each_other_or_base_keys() -> None:
    assert not encode_namespace("job@10").startswith(encode_namespace("job@1"))
    assert encode_token_ids([0xFFFFFFFE, 1]) is None  # the namespace marker is no token id
    assert not encode_text("x").startswith(encode_namespace("")[:4])


def test_a_lone_surrogate_in_text_still_routes() -> None:
    request = parse("/generate", b'{"text": "a\\ud800b", "lora_path": "x\\udfff"}')
    assert request.prefix_key == encode_namespace("x\udfff") + encode_text("a\ud800b")
