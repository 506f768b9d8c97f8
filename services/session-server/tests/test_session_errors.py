"""Every refusal has its status and leaves the session usable: auth, bad input, limits, and upstream failures."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from miles.common.testing import free_port

USER = {"role": "user", "content": "hi"}


async def new_session(client: httpx.AsyncClient, operator_token: str, **body: Any) -> tuple[str, dict[str, str]]:
    response = await client.post("/v1/sessions", json=body, headers={"authorization": f"Bearer {operator_token}"})
    assert response.status_code == 201, response.text
    return response.json()["session_id"], {"authorization": f"Bearer {response.json()['token']}"}


def url(sid: str) -> str:
    return f"/v1/sessions/{sid}/v1/chat/completions"


async def test_auth_errors_touch_nothing(make_session_app: Any, scripted_engine: Any, operator_token: str) -> None:
    async with make_session_app(scripted_engine.url) as client:
        sid, auth = await new_session(client, operator_token)
        other_sid, other_auth = await new_session(client, operator_token)
        assert (await client.post(url(sid), json={"messages": [USER]})).status_code == 401
        wrong = await client.post(url(sid), json={"messages": [USER]}, headers=other_auth)
        assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "wrong_token"
        assert (await client.post(url("0" * 32), json={"messages": [USER]}, headers=auth)).status_code == 404
        assert (await client.post("/v1/sessions", json={})).status_code == 401
        assert (await client.post("/v1/sessions", json={}, headers=auth)).status_code == 403
        assert (await client.get("/v1/sessions", headers=auth)).status_code == 403
        assert scripted_engine.requests == []
        assert (await client.get(f"/v1/sessions/{sid}", headers=auth)).json()["version"] == 0
        listed = await client.get("/v1/sessions", headers={"authorization": f"Bearer {operator_token}"})
        assert set(listed.json()["session_ids"]) == {sid, other_sid}
        assert (await client.delete(f"/v1/sessions/{sid}", headers=other_auth)).status_code == 403
        assert (await client.delete(f"/v1/sessions/{sid}", headers=auth)).status_code == 204
        assert (await client.get(f"/v1/sessions/{sid}", headers=auth)).status_code == 404


BAD_REQUESTS: list[tuple[str, Any, int, str]] = [
    ("not json", b"{messages:", 400, "invalid_request"),
    ("no messages", {"messages": []}, 400, "invalid_request"),
    ("nan literal", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "invalid_request"),
    ("n=2", {"messages": [USER], "n": 2}, 400, "invalid_request"),
    ("json schema", {"messages": [USER], "response_format": {"type": "json_object"}}, 400, "invalid_request"),
    ("unknown role", {"messages": [{"role": "developer", "content": "x"}]}, 400, "tito_unsupported_role"),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "tito_invalid_message"),
    (
        "bad tool-call json",
        {
            "messages": [
                USER,
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
                {"role": "tool", "content": "r"},
            ]
        },
        400,
        "tito_invalid_tool_call_arguments",
    ),
    ("too many messages", {"messages": [USER] * 9}, 400, "invalid_request"),
    ("too large", {"messages": [{"role": "user", "content": "x" * 5000}]}, 413, "request_too_large"),
    (
        "deep",
        {
            "messages": [USER],
            "metadata": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
        },
        200,
        "",
    ),
]


@pytest.mark.parametrize(("case", "body", "status", "code"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
async def test_bad_requests_are_4xx_naming_the_problem(
    make_session_app: Any, scripted_engine: Any, operator_token: str, case: str, body: Any, status: int, code: str
) -> None:
    async with make_session_app(scripted_engine.url, max_messages=8, max_body_bytes=4096) as client:
        sid, auth = await new_session(client, operator_token)
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        response = await client.post(url(sid), headers=auth, **kwargs)
        assert response.status_code == status, response.text
        if code:
            assert response.json()["error"]["code"] == code
            assert response.json()["error"]["message"]
        ok = await client.post(url(sid), json={"messages": [USER]}, headers=auth)
        assert ok.status_code == 200  # the session is still usable


async def test_history_and_context_limits(
    make_session_app: Any, scripted_engine: Any, operator_token: str, weather_tools: list[Any]
) -> None:
    async with make_session_app(scripted_engine.url, default_max_context_tokens=120) as client:
        sid, auth = await new_session(client, operator_token)
        first = await client.post(url(sid), json={"messages": [USER], "tools": weather_tools}, headers=auth)
        assert first.status_code == 400 and first.json()["error"]["code"] == "prompt_too_long"  # tools prompt > 120
        ok = await client.post(url(sid), json={"messages": [USER]}, headers=auth)
        assert ok.status_code == 200
        history = [USER, ok.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
        changed = await client.post(url(sid), json={"messages": history, "tools": weather_tools}, headers=auth)
        assert changed.status_code == 400 and changed.json()["error"]["code"] == "tools_changed"
        edited = [{"role": "user", "content": "other"}, *history[1:]]
        assert (await client.post(url(sid), json={"messages": edited}, headers=auth)).status_code == 200  # rollback
        long = [*history, {"role": "user", "content": "word " * 200}]
        too_long = await client.post(url(sid), json={"messages": long}, headers=auth)
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "prompt_too_long"
        assert (await client.post(url(sid), json={"messages": history}, headers=auth)).status_code == 200
        max_new = scripted_engine.requests[-1]["body"]["sampling_params"]["max_new_tokens"]
        assert max_new == 120 - len(scripted_engine.requests[-1]["body"]["input_ids"]) - 1  # prompt + new < context


UPSTREAM_FAILURES: list[tuple[str, Any, int, str]] = [
    ("5xx", (500, {"error": {"message": "boom"}}), 503, "upstream_unavailable"),
    ("rejected", (400, {"error": {"message": "prompt too long"}}), 400, "upstream_rejected"),
    ("version gate", (409, {"error": {"message": "behind"}}), 409, "upstream_conflict"),
    ("not json", (200, "<html>"), 502, "upstream_malformed"),
    ("no logprobs", (200, {"text": "x", "meta_info": {"finish_reason": {"type": "stop"}}}), 502, "upstream_malformed"),
    (
        "count mismatch",
        (200, {"meta_info": {"finish_reason": {"type": "stop"}, "completion_tokens": 3, "output_token_logprobs": []}}),
        502,
        "upstream_malformed",
    ),
    (
        "aborted",
        (200, {"meta_info": {"finish_reason": {"type": "abort", "message": "Aborted"}, "output_token_logprobs": []}}),
        503,
        "upstream_aborted",
    ),
]


@pytest.mark.parametrize(
    ("case", "failure", "status", "code"), UPSTREAM_FAILURES, ids=[c[0] for c in UPSTREAM_FAILURES]
)
async def test_upstream_failures_map_to_status_and_record_nothing(
    make_session_app: Any, scripted_engine: Any, operator_token: str, case: str, failure: Any, status: int, code: str
) -> None:
    scripted_engine.fail_next = [failure]
    async with make_session_app(scripted_engine.url) as client:
        sid, auth = await new_session(client, operator_token)
        response = await client.post(url(sid), json={"messages": [USER]}, headers=auth)
        assert response.status_code == status, response.text
        assert response.json()["error"]["code"] == code
        if status == 503:
            assert int(response.headers["retry-after"]) >= 1
        assert (await client.get(f"/v1/sessions/{sid}", headers=auth)).json()["num_turns"] == 0
        assert (await client.post(url(sid), json={"messages": [USER]}, headers=auth)).status_code == 200


async def test_unreachable_upstream_is_503_with_retry_after(make_session_app: Any, operator_token: str) -> None:
    async with make_session_app(f"http://127.0.0.1:{free_port()}") as client:
        sid, auth = await new_session(client, operator_token)
        response = await client.post(url(sid), json={"messages": [USER]}, headers=auth)
    assert response.status_code == 503 and response.headers["retry-after"] == "2"
    assert response.json()["error"]["code"] == "upstream_unavailable"


async def test_job_configs_drive_sessions(
    make_session_app: Any, scripted_engine: Any, operator_token: str, qwen3_model_dir: Any, tmp_path: Any
) -> None:
    op = {"authorization": f"Bearer {operator_token}"}
    config = {"model_path": str(qwen3_model_dir), "model_family": "qwen3", "engine_pool": "job-7-pool"}
    async with make_session_app(scripted_engine.url, default_model_path=None) as client:
        assert (await client.put("/v1/jobs/job-7/config", json=config)).status_code == 401
        bad_path = await client.put("/v1/jobs/job-7/config", json={**config, "model_path": str(tmp_path)}, headers=op)
        assert bad_path.status_code == 400 and bad_path.json()["error"]["field"] == "model_path"
        bad_family = await client.put("/v1/jobs/job-7/config", json={**config, "model_family": "gpt-9"}, headers=op)
        assert bad_family.status_code == 400 and bad_family.json()["error"]["field"] == "model_family"
        assert (await client.put("/v1/jobs/job-7/config", json=config, headers=op)).status_code == 200
        assert (await client.get("/v1/jobs/job-7/config", headers=op)).json()["engine_pool"] == "job-7-pool"
        unknown = await client.post("/v1/sessions", json={"job_id": "job-8"}, headers=op)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "job_not_found"
        conflict = await client.post(
            "/v1/sessions", json={"job_id": "job-7", "chat_template_kwargs": {"clear_thinking": True}}, headers=op
        )
        assert conflict.status_code == 400 and conflict.json()["error"]["code"] == "tito_chat_template_kwarg_conflict"
        sid, auth = await new_session(client, operator_token, job_id="job-7", sampling_defaults={"temperature": 0.5})
        assert (await client.post(url(sid), json={"messages": [USER]}, headers=auth)).status_code == 200
        assert (await client.delete("/v1/jobs/job-7/config", headers=op)).status_code == 204
    request = scripted_engine.requests[-1]
    assert request["headers"]["x-miles-pool"] == "job-7-pool"
    assert request["body"]["sampling_params"]["temperature"] == 0.5
    assert 151645 in request["body"]["sampling_params"]["stop_token_ids"]


def test_operator_token_is_required_off_loopback_and_must_be_long() -> None:
    from miles.common.errors import ConfigError
    from miles.common.settings import load_settings
    from miles.session.settings import SessionSettings

    with pytest.raises(ConfigError, match="operator_token is required"):
        load_settings(SessionSettings, host="0.0.0.0")
    with pytest.raises(ConfigError, match="at least 32"):
        load_settings(SessionSettings, operator_token="short")
    assert load_settings(SessionSettings, host="0.0.0.0", operator_token="t" * 32).operator_token
    assert load_settings(SessionSettings, host="::1").operator_token.get_secret_value() == ""
