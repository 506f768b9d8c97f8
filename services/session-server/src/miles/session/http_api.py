"""The HTTP transport: routes, bearer-token checks, body parsing and size limits over `SessionCore`.

Auth: session routes need `Authorization: Bearer <the session's capability token>` (the agent's OpenAI api_key)
or the operator token; no token -> 401, another token -> 403, checked before anything is read or written.
Operator routes (job configs and adapters, creating and listing sessions) need the operator token when one is
configured.
Bodies are parsed by request_body.py: invalid JSON or fields, NaN / Infinity, lone surrogates -> 400 naming the
field (422 for POST /v1/sessions, whose schema the OpenAPI states exactly); larger than max_body_bytes -> 413.
`POST /v1/sessions` takes an optional `Idempotency-Key` header (see `SessionCore.create`): a replay answers 200 with
`Idempotent-Replayed: true`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Path, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from miles.common.auth import bearer_of, tokens_match
from miles.common.http import create_http_app
from miles.common.telemetry import Metrics
from miles.session import openai_format
from miles.session.adapters import JobAdapters
from miles.session.api_models import (
    JOB_ID_PATTERN,
    ChatCompletionRequest,
    CreateSessionRequest,
    CreateSessionResponse,
    JobAdapterBody,
    JobConfigBody,
    SamplesRequest,
)
from miles.session.core import SessionCore
from miles.session.errors import (
    InvalidSessionRequestError,
    MissingTokenError,
    WrongTokenError,
)
from miles.session.exports import Answer, ExportProcesses
from miles.session.openapi_docs import (
    ADAPTER_GET_RESPONSES,
    ADAPTER_PUT_RESPONSES,
    CHAT_EXAMPLES,
    CHAT_RESPONSES,
    CREATE_RESPONSES,
    IDEMPOTENCY_KEY_HEADER,
    JOB_NOT_FOUND,
    MAX_IDEMPOTENCY_KEY_CHARS,
    OPERATOR_RESPONSES,
    PROTOBUF_MEDIA_TYPE,
    REPLAYED_HEADER,
    SAMPLES_RESPONSES,
    SESSION_RESPONSES,
    TOO_LARGE,
    body_schema,
    create_session_openapi,
)
from miles.session.request_body import BodyLimitMiddleware, parse_body
from miles.session.streaming import StreamingTurns
from miles.session.views import ViewRequest

SessionId = Annotated[str, Path(min_length=1, max_length=128)]
JobId = Annotated[str, Path(pattern=JOB_ID_PATTERN)]


class Auth:
    def __init__(self, operator_token: str) -> None:
        self._operator_token = operator_token

    @staticmethod
    def bearer(request: Request) -> str:
        token = bearer_of(request.headers.get("authorization"))
        if not token:
            raise MissingTokenError("send `Authorization: Bearer <token>` (the session token is the agent's api_key)")
        return token

    def is_operator(self, token: str) -> bool:
        return tokens_match(token, self._operator_token)

    def require_operator(self, request: Request) -> None:
        if not self._operator_token:
            return  # loopback development mode (see settings): operator routes are open to local callers
        if not self.is_operator(self.bearer(request)):
            raise WrongTokenError("this operation needs the operator token")

    def session_caller(self, request: Request) -> tuple[str, bool]:
        token = self.bearer(request)
        return token, self.is_operator(token)


def idempotency_key(request: Request) -> str | None:
    """The Idempotency-Key header: 1-255 printable ASCII characters, or absent."""
    key = request.headers.get(IDEMPOTENCY_KEY_HEADER)
    if key is None:
        return None
    if not 1 <= len(key) <= MAX_IDEMPOTENCY_KEY_CHARS or not (key.isascii() and key.isprintable()):
        raise InvalidSessionRequestError(
            f"{IDEMPOTENCY_KEY_HEADER} must be 1-{MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII characters (a UUID, say)",
            field=IDEMPOTENCY_KEY_HEADER,
        )
    return key


def _create_route(router: APIRouter, core: SessionCore, auth: Auth) -> None:
    @router.post(
        "/v1/sessions",
        status_code=201,
        response_model=CreateSessionResponse,
        responses={**OPERATOR_RESPONSES, **CREATE_RESPONSES, **TOO_LARGE},
        openapi_extra=create_session_openapi(core.settings.max_ttl_s),
    )
    async def create_session(request: Request, response: Response) -> CreateSessionResponse:
        auth.require_operator(request)
        key = idempotency_key(request)
        body = await parse_body(request, CreateSessionRequest, error=InvalidSessionRequestError)
        created = await core.create(body, idempotency_key=key)
        if created.replayed:
            response.status_code = 200
            response.headers[REPLAYED_HEADER] = "true"
        base = (core.settings.public_base_url or str(request.base_url)).rstrip("/")
        base_url = f"{base}/v1/sessions/{created.session_id}/v1"
        return CreateSessionResponse(
            session_id=created.session_id, base_url=base_url, token=created.token, ttl_s=created.ttl_s
        )


def _streamed(answer: Answer) -> Response:
    """A session's view or samples, in pieces (~100 MB for a long session: see json_stream.py and exports.py)."""
    return StreamingResponse(
        answer.body, status_code=answer.status, media_type=answer.media_type, headers=answer.headers
    )


def _session_routes(
    router: APIRouter, core: SessionCore, exports: ExportProcesses, streams: StreamingTurns, auth: Auth
) -> None:
    @router.get("/v1/sessions", responses=OPERATOR_RESPONSES)
    async def list_sessions(
        request: Request, job_id: str | None = None, limit: Annotated[int, Query(ge=1, le=10000)] = 1000
    ) -> dict[str, list[str]]:
        auth.require_operator(request)
        return {"session_ids": await core.list_sessions(job_id, limit)}

    @router.get("/v1/sessions/{session_id}", responses=SESSION_RESPONSES, response_model=dict[str, Any])
    async def get_session(session_id: SessionId, request: Request) -> Response:
        token, is_operator = auth.session_caller(request)
        meta = await core.authorize(session_id, token, is_operator=is_operator)
        return _streamed(await exports.answer(ViewRequest("describe", meta)))

    @router.delete("/v1/sessions/{session_id}", status_code=204, responses=SESSION_RESPONSES)
    async def delete_session(session_id: SessionId, request: Request) -> Response:
        token, is_operator = auth.session_caller(request)
        await core.authorize(session_id, token, is_operator=is_operator)
        await core.delete(session_id)
        return Response(status_code=204)

    @router.post(
        "/v1/sessions/{session_id}/samples",
        responses={**SESSION_RESPONSES, **SAMPLES_RESPONSES, **TOO_LARGE},
        openapi_extra=body_schema(SamplesRequest),
    )
    async def samples(session_id: SessionId, request: Request) -> Response:
        token, is_operator = auth.session_caller(request)
        meta = await core.authorize(session_id, token, is_operator=is_operator)
        body = await parse_body(request, SamplesRequest, allow_empty=True)
        protobuf = PROTOBUF_MEDIA_TYPE in request.headers.get("accept", "")
        return _streamed(await exports.answer(ViewRequest("samples", meta, body, protobuf=protobuf)))

    @router.post(
        "/v1/sessions/{session_id}/v1/chat/completions",
        responses={**SESSION_RESPONSES, **CHAT_RESPONSES, **TOO_LARGE},
        openapi_extra=body_schema(ChatCompletionRequest, CHAT_EXAMPLES),
    )
    async def chat_completions(session_id: SessionId, request: Request) -> Response:
        token, is_operator = auth.session_caller(request)
        start = await core.authorize_turn(session_id, token, is_operator=is_operator)
        body = await parse_body(request, ChatCompletionRequest)
        core.check_chat(body)
        if not body.stream:
            result = await core.turns.run(start, body)
            return JSONResponse(result, headers=openai_format.budget_headers(result))
        stream = await streams.open(start, body)  # refusals up to the engine's answer status are HTTP errors
        return StreamingResponse(
            stream.events(),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no", **stream.headers},
        )

    @router.get("/v1/sessions/{session_id}/v1/models", responses=SESSION_RESPONSES)
    async def models(session_id: SessionId, request: Request) -> dict[str, Any]:
        token, is_operator = auth.session_caller(request)
        meta = await core.authorize(session_id, token, is_operator=is_operator)
        model = await core.models.get(meta.model)
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": 0, "owned_by": "miles"}]}


def _job_routes(router: APIRouter, core: SessionCore, auth: Auth) -> None:
    @router.put(
        "/v1/jobs/{job_id}/config",
        responses={
            **OPERATOR_RESPONSES,
            400: {
                "description": "A bad body, or a model_path / model_family / kwargs that cannot be served, or "
                "record_routing true for a model that is not MoE (invalid_job_config naming the field)"
            },
            **TOO_LARGE,
        },
        openapi_extra=body_schema(JobConfigBody),
    )
    async def put_job_config(job_id: JobId, request: Request) -> dict[str, Any]:
        auth.require_operator(request)
        config = await core.put_job_config(job_id, await parse_body(request, JobConfigBody))
        return config.to_json()

    @router.get("/v1/jobs/{job_id}/config", responses={**OPERATOR_RESPONSES, **JOB_NOT_FOUND})
    async def get_job_config(job_id: JobId, request: Request) -> dict[str, Any]:
        auth.require_operator(request)
        return (await core.get_job_config(job_id)).to_json()

    @router.delete("/v1/jobs/{job_id}/config", status_code=204, responses={**OPERATOR_RESPONSES, **JOB_NOT_FOUND})
    async def delete_job_config(job_id: JobId, request: Request) -> Response:
        auth.require_operator(request)
        await core.delete_job_config(job_id)
        return Response(status_code=204)


def _adapter_routes(router: APIRouter, adapters: JobAdapters, auth: Auth) -> None:
    @router.put(
        "/v1/jobs/{job_id}/adapter",
        response_model=JobAdapterBody,
        responses={**OPERATOR_RESPONSES, **ADAPTER_PUT_RESPONSES, **TOO_LARGE},
        openapi_extra=body_schema(JobAdapterBody),
    )
    async def put_job_adapter(job_id: JobId, request: Request) -> dict[str, Any]:
        auth.require_operator(request)
        return (await adapters.put(job_id, await parse_body(request, JobAdapterBody))).to_json()

    @router.get(
        "/v1/jobs/{job_id}/adapter",
        response_model=JobAdapterBody,
        responses={**OPERATOR_RESPONSES, **ADAPTER_GET_RESPONSES},
    )
    async def get_job_adapter(job_id: JobId, request: Request) -> dict[str, Any]:
        auth.require_operator(request)
        return (await adapters.get(job_id)).to_json()


def build_app(
    core: SessionCore,
    adapters: JobAdapters,
    streams: StreamingTurns,
    exports: ExportProcesses,
    metrics: Metrics,
    *,
    operator_token: str,
    max_body_bytes: int,
    on_shutdown: Callable[[], Any] | None = None,
) -> FastAPI:
    """The session-server app: common probes/metrics/tracing/error mapping + the session, job and adapter routes."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await core.warm_up()
        reaper = asyncio.create_task(core.reap_forever())
        try:
            yield
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            if on_shutdown is not None:
                await on_shutdown()

    app = create_http_app(
        service="session",
        metrics=metrics,
        readiness_checks={"store": core.store.ping},
        lifespan=lifespan,
        title="miles-session-server",
    )
    auth = Auth(operator_token)
    router = APIRouter()
    _create_route(router, core, auth)
    _session_routes(router, core, exports, streams, auth)
    _job_routes(router, core, auth)
    _adapter_routes(router, adapters, auth)
    app.include_router(router)
    app.state.exports = exports  # its helpers' pids: for operators' tooling and tests
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    return app
