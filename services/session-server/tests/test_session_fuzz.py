"""Acceptance: fuzzing a real miles-session-server (Redis, `miles-engine --fake-model`) with malformed bodies,
oversized prompts, wrong tokens, non-append histories and concurrent turns on one session: never a 5xx, and
the session stays whole (a later valid turn succeeds; its token buffer still matches a fresh render)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.integration
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
ROLES = st.sampled_from(["user", "assistant", "tool", "system", "developer", "function", ""]) | st.text(max_size=6)
TOOL_CALL = st.fixed_dictionaries(
    {"id": st.text(max_size=6), "type": st.just("function")},
    optional={
        "function": st.fixed_dictionaries({"name": st.text(max_size=8), "arguments": JSON | st.text(max_size=30)})
    },
)
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES},
    optional={
        "content": JSON,
        "tool_calls": st.lists(TOOL_CALL, max_size=2) | JSON,
        "reasoning_content": st.text(max_size=10) | JSON,
        "tool_call_id": JSON,
    },
)
BODY = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, max_size=5) | JSON},
    optional={
        "tools": JSON | st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": JSON}), max_size=2),
        "temperature": JSON,
        "max_tokens": JSON,
        "stop": JSON,
        "stream": JSON,
        "n": JSON,
        "chat_template_kwargs": JSON,
    },
)


@dataclass
class Session:
    url: str
    sid: str
    auth: dict[str, str]
    history: list[dict[str, Any]] = field(default_factory=list)

    def chat(self, body: Any, **kwargs: Any) -> httpx.Response:
        path = f"{self.url}/v1/sessions/{self.sid}/v1/chat/completions"
        content = body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN/Infinity literals included
        headers = {**self.auth, "content-type": "application/json", **kwargs.get("headers", {})}
        return httpx.post(path, content=content, headers=headers, timeout=60)

    def turn(self, text: str) -> dict[str, Any]:
        """A valid next turn (must succeed); the session's history grows by it."""
        response = self.chat({"messages": [*self.history, {"role": "user", "content": text}]})
        assert response.status_code == 200, response.text
        self.history += [{"role": "user", "content": text}, response.json()["choices"][0]["message"]]
        return response.json()

    def check_whole(self) -> None:
        """A valid turn still succeeds, the view and samples build, and the buffer matches a fresh render."""
        self.turn("still there?")
        view = httpx.get(f"{self.url}/v1/sessions/{self.sid}", headers=self.auth, timeout=60).json()
        assert view["messages"] == self.history
        assert view["tito_session_mismatch"]["num_critical"] == 0
        samples = httpx.post(f"{self.url}/v1/sessions/{self.sid}/samples", json={}, headers=self.auth, timeout=60)
        (sample,) = samples.json()["samples"]
        assert samples.status_code == 200 and sample["status"] in ("SAMPLE_STATUS_COMPLETED", "SAMPLE_STATUS_TRUNCATED")
        assert sample["tokens"] == view["accumulated_token_ids"] and sum(sample["loss_mask"]) > 0


@pytest.fixture(scope="module")
def server_url(
    redis_server: Any,
    fake_engine_url: str,
    start_process: Any,
    session_server_argv: list[str],
    session_env: Any,
    qwen3_model_dir: Path,
) -> Iterator[str]:
    limits = {"MILES_SESSION_MAX_BODY_BYTES": "1000000", "MILES_SESSION_MAX_MESSAGES": "64"}
    env = session_env(redis_server.url, fake_engine_url, qwen3_model_dir, **limits)
    with start_process(session_server_argv, env) as url:
        yield url


@pytest.fixture
def session(server_url: str, operator_token: str) -> Session:
    body = {"sampling_defaults": {"max_new_tokens": 4, "temperature": 0}}
    created = httpx.post(
        f"{server_url}/v1/sessions", json=body, headers={"authorization": f"Bearer {operator_token}"}, timeout=60
    ).json()
    session = Session(server_url, created["session_id"], {"authorization": f"Bearer {created['token']}"})
    session.turn("hello")
    session.turn("tell me more")
    return session


def test_fuzzed_bodies_never_5xx(session: Session) -> None:
    @FUZZ
    @given(body=BODY | JSON, raw=st.binary(max_size=64), as_raw=st.booleans())
    def post(body: Any, raw: bytes, as_raw: bool) -> None:
        response = session.chat(raw if as_raw else body)
        assert response.status_code < 500, response.text
        if response.status_code >= 400:
            assert response.json()["error"]["message"]

    post()
    session.check_whole()


def test_non_append_histories_are_refused_or_retried_never_5xx(session: Session) -> None:
    @FUZZ
    @given(
        index=st.integers(0, 3),
        edit=st.sampled_from(["content", "drop", "role", "tool_call", "swap"]),
        text=st.text(max_size=12),
    )
    def post(index: int, edit: str, text: str) -> None:
        history = [dict(m) for m in session.history]
        target = history[index]
        if edit == "content":
            target["content"] = text
        elif edit == "drop":
            history.pop(index)
        elif edit == "role":
            target["role"] = "system" if target["role"] == "user" else "user"
        elif edit == "tool_call":
            target["tool_calls"] = [{"id": "x", "type": "function", "function": {"name": "f", "arguments": text}}]
        else:
            history[index], history[-1] = history[-1], history[index]
        response = session.chat({"messages": [*history, {"role": "user", "content": "next"}]})
        assert response.status_code in (200, 400, 422), response.text

    post()
    # The fuzz may have retried (rolled back) the last turn: continue from what the session holds now.
    view = httpx.get(f"{session.url}/v1/sessions/{session.sid}", headers=session.auth, timeout=60).json()
    session.history = view["messages"]
    session.check_whole()


def test_wrong_tokens_oversized_prompts_and_concurrent_turns(session: Session, operator_token: str) -> None:
    valid = {"messages": [*session.history, {"role": "user", "content": "q"}]}

    @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
    # httpx refuses header values with leading or trailing whitespace: the client, not the server, would fail.
    @given(header=st.text(max_size=40).filter(lambda h: h.isascii() and h.isprintable() and h == h.strip()))
    def wrong_token(header: str) -> None:
        response = session.chat(valid, headers={"authorization": header})
        assert response.status_code in (401, 403), response.text

    wrong_token()
    oversized_prompt = session.chat({"messages": [*session.history, {"role": "user", "content": "word " * 40000}]})
    assert oversized_prompt.status_code == 400 and oversized_prompt.json()["error"]["code"] == "prompt_too_long"
    oversized_body = session.chat(json.dumps({"messages": [{"role": "user", "content": "x" * 1_200_000}]}).encode())
    assert oversized_body.status_code == 413
    with ThreadPoolExecutor(max_workers=8) as pool:
        replies = list(pool.map(lambda _: session.chat(valid), range(8)))
    assert [r.status_code for r in replies] == [200] * 8
    # Requests that raced on one version: one commits, the others are answered unrecorded. A request that arrives
    # after another committed is a retry of that turn (one-turn rollback) and commits in its place.
    recorded = [r.json()["miles"]["recorded"] for r in replies]
    view = httpx.get(f"{session.url}/v1/sessions/{session.sid}", headers=session.auth, timeout=60).json()
    assert recorded.count(True) >= 1 and view["num_not_recorded_turns"] == recorded.count(False)
    assert view["num_turns"] == 3 and view["messages"][:-1] == valid["messages"]
    session.history = view["messages"]
    session.check_whole()
