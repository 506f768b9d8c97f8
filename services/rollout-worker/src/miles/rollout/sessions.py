"""Client of the session server's sessions API (create, samples, history, delete), retried within a budget.

Connection errors, timeouts, 5xx and 429 are retried with exponential backoff (honouring Retry-After) for up to
`retry_budget_s`, then raise `SessionServerUnavailableError`; the episode turns that into an ABORTED sample. Every
other answer is final: 4xx raise the common error class of their status, and a 422 from /samples (the session
cannot be assembled) raises `SampleAssemblyFailedError`. Deleting a session that is already gone succeeds.

A create whose reply may have been lost (a transport error after the request was sent; not a refused
connection) may have created a session nobody knows: `on_uncertain_create` is called so that the worker sweeps
such orphans (`sweeper.py`); their TTL is the last resort.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from miles.common.auth import bearer_headers
from miles.common.errors import MilesError, error_class_for_http_status
from miles.common.http_client import CLIENT_KEEPALIVE_EXPIRY_S, traced_async_client
from miles.proto.session.v1 import session_pb2
from miles.rollout.errors import SampleAssemblyFailedError, SessionServerUnavailableError
from miles.rollout.retry import RetryableError, retry_within

PROTOBUF_MEDIA_TYPE = "application/x-protobuf"
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class SessionHandle:
    """A live session: the agent's OpenAI `base_url` and capability `token` (its api_key)."""

    session_id: str
    base_url: str
    token: str


def _retry_after_s(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after", "")
    try:
        return float(value) if value else None
    except ValueError:
        return None


def _error_for(response: httpx.Response, operation: str) -> MilesError:
    try:
        body = response.json().get("error", {})
    except ValueError:
        body = {}
    message = body.get("message") or response.text[:500] or f"HTTP {response.status_code}"
    error_class = error_class_for_http_status(response.status_code)
    return error_class(f"session server {operation}: {message}", field=body.get("field"), details=body)


class SessionClient:
    """One HTTP connection pool to the session server, shared by every episode of the worker."""

    def __init__(
        self,
        base_url: str,
        *,
        operator_token: str,
        request_timeout_s: float,
        retry_budget_s: float,
        on_retry: Callable[[str], None] | None = None,
        on_uncertain_create: Callable[[], None] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry_budget_s = retry_budget_s
        self.has_operator_token = bool(operator_token)
        self._operator_headers = bearer_headers(operator_token)
        self._on_retry = on_retry
        self.on_uncertain_create = on_uncertain_create
        self._http = traced_async_client(
            base_url=self.base_url,
            timeout=httpx.Timeout(request_timeout_s, connect=min(5.0, request_timeout_s)),
            limits=httpx.Limits(
                max_connections=512, max_keepalive_connections=128, keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S
            ),
            trust_env=False,
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(
        self, operation: str, send: Callable[[], Awaitable[httpx.Response]], *, budget_s: float | None = None
    ) -> httpx.Response:
        async def attempt() -> httpx.Response:
            try:
                response = await send()
            except httpx.TransportError as exc:
                sent = not isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
                if sent and operation == "create" and self.on_uncertain_create is not None:
                    self.on_uncertain_create()
                raise RetryableError(f"{type(exc).__name__}: {exc}") from exc
            if response.status_code in _RETRY_STATUSES:
                raise RetryableError(f"HTTP {response.status_code}: {response.text[:200]}", _retry_after_s(response))
            return response

        def note_retry(_: RetryableError) -> None:
            if self._on_retry is not None:
                self._on_retry(operation)

        try:
            return await retry_within(
                attempt, budget_s=self.retry_budget_s if budget_s is None else budget_s, on_retry=note_retry
            )
        except RetryableError as exc:
            raise SessionServerUnavailableError(f"session server {operation} failed: {exc}") from exc

    async def create(
        self,
        *,
        job_id: str,
        episode_id: str,
        ttl_s: float,
        metadata: dict[str, Any] | None = None,
        role: str = "",
    ) -> SessionHandle:
        """A new session; `role` (one of the job's declared roles, else a 400) makes it that role's session of a
        multi-agent episode, "" none."""
        body: dict[str, Any] = {"job_id": job_id, "episode_id": episode_id, "ttl_s": ttl_s, "metadata": metadata or {}}
        if role:
            body["role"] = role
        response = await self._call(
            "create", lambda: self._http.post("/v1/sessions", json=body, headers=self._operator_headers)
        )
        if response.status_code != 201:
            raise _error_for(response, "create")
        created = response.json()
        return SessionHandle(created["session_id"], created["base_url"], created["token"])

    def _session_headers(self, handle: SessionHandle, **extra: str) -> dict[str, str]:
        return {**bearer_headers(handle.token), **extra}

    async def samples(
        self,
        handle: SessionHandle,
        *,
        mode: str,
        max_seq_len: int | None,
        group_id: str,
        metadata: dict[str, Any],
    ) -> session_pb2.SessionSamples:
        """The session's training samples (protobuf): never empty (an ABORTED placeholder at worst)."""
        body: dict[str, Any] = {"mode": mode, "group_id": group_id, "metadata": metadata}
        if max_seq_len is not None:
            body["max_seq_len"] = max_seq_len
        headers = self._session_headers(handle, accept=PROTOBUF_MEDIA_TYPE)
        response = await self._call(
            "samples",
            lambda: self._http.post(f"/v1/sessions/{handle.session_id}/samples", json=body, headers=headers),
        )
        if response.status_code == 422:
            raise SampleAssemblyFailedError(f"session {handle.session_id}: {_error_for(response, 'samples').message}")
        if response.status_code != 200:
            raise _error_for(response, "samples")
        message = session_pb2.SessionSamples()
        message.ParseFromString(response.content)
        return message

    async def messages(self, handle: SessionHandle) -> list[dict[str, Any]]:
        """The session's stored conversation (what the agent sent plus every assistant reply)."""
        headers = self._session_headers(handle)
        response = await self._call(
            "describe", lambda: self._http.get(f"/v1/sessions/{handle.session_id}", headers=headers)
        )
        if response.status_code != 200:
            raise _error_for(response, "describe")
        messages: list[dict[str, Any]] = response.json().get("messages") or []
        return messages

    async def delete(self, handle: SessionHandle, *, as_operator: bool = False) -> None:
        """Deletes the session; a session already gone (404) counts as deleted."""
        headers = self._operator_headers if as_operator else self._session_headers(handle)
        response = await self._call(
            "delete", lambda: self._http.delete(f"/v1/sessions/{handle.session_id}", headers=headers)
        )
        if response.status_code not in (204, 404):
            raise _error_for(response, "delete")

    async def delete_by_id(self, session_id: str) -> None:
        """Deletes a session this worker holds no token for (operator route); gone already counts as deleted."""
        await self.delete(SessionHandle(session_id, "", ""), as_operator=True)

    async def list_job_sessions(self, job_id: str, limit: int = 10000) -> list[str]:
        """Ids of the job's live sessions (operator route)."""
        params: dict[str, Any] = {"job_id": job_id, "limit": limit}
        response = await self._call(
            "list", lambda: self._http.get("/v1/sessions", params=params, headers=self._operator_headers)
        )
        if response.status_code != 200:
            raise _error_for(response, "list")
        return list(response.json()["session_ids"])

    async def created_at_unix_ms(self, session_id: str) -> int | None:
        """When a session was created (read with the operator token); None when it is gone."""
        response = await self._call(
            "describe", lambda: self._http.get(f"/v1/sessions/{session_id}", headers=self._operator_headers)
        )
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise _error_for(response, "describe")
        return int(response.json()["created_at_unix_ms"])

    async def ping(self) -> None:
        """Raises when the session server is not ready (one attempt)."""
        response = await self._http.get("/readyz", timeout=5.0)
        if response.status_code != 200:
            raise _error_for(response, "readyz")
