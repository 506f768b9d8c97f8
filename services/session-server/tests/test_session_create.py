"""POST /v1/sessions: strict bodies (422 naming the field, the OpenAPI saying the same bounds) and the
Idempotency-Key contract (a replay returns the same session with a rotated token)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

CREATE = "/v1/sessions"


def op(operator_token: str, **extra: str) -> dict[str, str]:
    return {"authorization": f"Bearer {operator_token}", **extra}


BAD_CREATES: list[tuple[str, bytes, str]] = [
    ("no body", b"", "body"),
    ("not an object", b"[]", "body"),
    ("ttl_s denormal", b'{"ttl_s": 5e-324}', "ttl_s"),
    ("ttl_s zero", b'{"ttl_s": 0}', "ttl_s"),
    ("ttl_s negative", b'{"ttl_s": -5}', "ttl_s"),
    ("ttl_s NaN", b'{"ttl_s": NaN}', "ttl_s"),
    ("ttl_s overflow", b'{"ttl_s": 1e999}', "ttl_s"),
    ("ttl_s over max", b'{"ttl_s": 1e9}', "ttl_s"),
    ("ttl_s string", b'{"ttl_s": "long"}', "ttl_s"),
    ("empty family", b'{"model_family": ""}', "model_family"),
    ("unknown field", b'{"ttl": 5}', "ttl"),
    ("bad max_new_tokens", b'{"sampling_defaults": {"max_new_tokens": "x"}}', "sampling_defaults"),
    ("bad stop ids", b'{"sampling_defaults": {"stop_token_ids": "abc"}}', "sampling_defaults"),
]


@pytest.mark.parametrize(("case", "body", "field"), BAD_CREATES, ids=[c[0] for c in BAD_CREATES])
async def test_a_create_outside_the_schema_is_a_422_naming_the_field(
    make_session_app: Any, scripted_engine: Any, operator_token: str, case: str, body: bytes, field: str
) -> None:
    async with make_session_app(scripted_engine.url) as client:
        reply = await client.post(
            CREATE, content=body, headers=op(operator_token, **{"content-type": "application/json"})
        )
        assert reply.status_code == 422, reply.text
        assert reply.json()["error"]["code"] == "invalid_session_request"
        assert reply.json()["error"]["field"] == field
        assert (await client.get(CREATE, headers=op(operator_token))).json()["session_ids"] == []
        assert (await client.post(CREATE, json={}, headers=op(operator_token))).status_code == 201


async def test_the_openapi_states_the_bounds_the_server_enforces(make_session_app: Any, scripted_engine: Any) -> None:
    async with make_session_app(scripted_engine.url, max_ttl_s=7200.0) as client:
        spec = (await client.get("/openapi.json")).json()
    create = spec["paths"]["/v1/sessions"]["post"]
    ttl = create["requestBody"]["content"]["application/json"]["schema"]["properties"]["ttl_s"]["anyOf"][0]
    assert ttl["minimum"] == 1.0 and ttl["maximum"] == 7200.0
    assert [p["name"] for p in create["parameters"]] == ["Idempotency-Key"]
    assert {"200", "201"} <= set(create["responses"])
    chat = spec["paths"]["/v1/sessions/{session_id}/v1/chat/completions"]["post"]
    properties = chat["requestBody"]["content"]["application/json"]["schema"]["properties"]
    for name in ("max_tokens", "max_completion_tokens"):
        assert "clamped" in properties[name]["description"]
        assert "context - prompt - 1" in properties[name]["description"]


async def create(client: httpx.AsyncClient, operator_token: str, key: str | None, body: Any) -> httpx.Response:
    headers = op(operator_token, **({"idempotency-key": key} if key is not None else {}))
    return await client.post(CREATE, json=body, headers=headers)


def works(client: httpx.AsyncClient, sid: str, token: str) -> Any:
    return client.get(f"{CREATE}/{sid}", headers={"authorization": f"Bearer {token}"})


async def test_a_replayed_create_returns_the_same_session_with_a_rotated_token(
    make_session_app: Any, scripted_engine: Any, operator_token: str
) -> None:
    body = {"episode_id": "e-1", "ttl_s": 600, "metadata": {"a": 1, "b": [1, 2]}}
    async with make_session_app(scripted_engine.url) as client:
        first = await create(client, operator_token, "key-1", body)
        assert first.status_code == 201 and "idempotent-replayed" not in first.headers
        # The same body, keys in another order: the same request.
        replay = await create(
            client, operator_token, "key-1", {"metadata": {"b": [1, 2], "a": 1}, "ttl_s": 600.0, "episode_id": "e-1"}
        )
        assert replay.status_code == 200, replay.text
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.json()["session_id"] == first.json()["session_id"]
        assert replay.json()["ttl_s"] == 600 and replay.json()["base_url"] == first.json()["base_url"]
        sid, old, new = first.json()["session_id"], first.json()["token"], replay.json()["token"]
        assert new != old
        assert (await works(client, sid, old)).status_code == 403  # the old token stopped working
        assert (await works(client, sid, new)).status_code == 200
        other = await create(client, operator_token, "key-1", {**body, "episode_id": "e-2"})
        assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
        assert (
            other.json()["error"]["field"] == "Idempotency-Key"
            and other.json()["error"]["details"]["session_id"] == sid
        )
        assert (await works(client, sid, new)).status_code == 200  # a refused replay rotates nothing
        assert "miles_session_idempotent_replays_total 1.0" in (await client.get("/metrics")).text
        listed = (await client.get(CREATE, headers=op(operator_token))).json()["session_ids"]
        assert listed == [sid]
        # The key lives as long as its session: once it is deleted, the key creates a new one.
        assert (await client.delete(f"{CREATE}/{sid}", headers={"authorization": f"Bearer {new}"})).status_code == 204
        again = await create(client, operator_token, "key-1", {**body, "episode_id": "e-2"})
        assert again.status_code == 201 and again.json()["session_id"] != sid


async def test_creates_without_a_key_are_never_merged_and_bad_keys_are_422(
    make_session_app: Any, scripted_engine: Any, operator_token: str
) -> None:
    async with make_session_app(scripted_engine.url) as client:
        ids = {(await create(client, operator_token, None, {})).json()["session_id"] for _ in range(2)}
        assert len(ids) == 2
        for key in ("", "x" * 256, "tab\tkey"):
            reply = await create(client, operator_token, key, {})
            assert reply.status_code == 422 and reply.json()["error"]["field"] == "Idempotency-Key", key
        assert (await create(client, operator_token, "k" * 255, {})).status_code == 201
