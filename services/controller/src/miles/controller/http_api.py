"""The REST job API over `JobService` (thin: parse, authenticate, call the core, shape the answer).

Routes (all under bearer auth when api tokens are configured; probes, metrics and /openapi.json stay open):
POST /v1/jobs, GET /v1/jobs, GET /v1/jobs/{id}, GET /v1/jobs/{id}/events (SSE), GET and POST
/v1/jobs/{id}/evals, POST /v1/jobs/{id}/cancel, PATCH /v1/jobs/{id}, DELETE /v1/jobs/{id}. Errors are
`{"error": {...}}` bodies from the common app factory; invalid bodies are 422 naming the field path
(`body.train.num_steps`). Every status a route answers is in its `responses` (the OpenAPI document is checked
against the server by a schemathesis run in the tests).
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, FastAPI, Header, Path, Query, Response
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from miles.common.errors import InvalidArgumentError
from miles.common.http import ReadinessCheck, create_http_app
from miles.common.jobspec.job import JobSpec
from miles.common.telemetry import Metrics
from miles.controller.api_models import JobList, JobView, ResizeRequest
from miles.controller.core import JobService
from miles.controller.errors import MissingTokenError, WrongTokenError
from miles.controller.evals import (
    EvalList,
    RecordEvalRequest,
    VersionEvalView,
    read_evals,
    read_version_steps,
    record_eval,
)
from miles.controller.jobs import JobState

JOB_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
# A Redis stream id `<ms>-<seq>`, each part below 2**64 (19 digits keep it so; Redis refuses larger ones).
_EVENT_ID_RE = re.compile(r"^(0|\d{1,19}-\d{1,19})$")
EVENT_ID_SCHEMA: dict[str, Any] = {"pattern": _EVENT_ID_RE.pattern}
"""Stated in the schema; checked by the route (400 naming Last-Event-ID, before the stream starts)."""

JOB_SPEC_EXAMPLES: dict[str, Any] = {
    "calculator": {
        "summary": "A short multi-turn tool-use job on the CPU",
        "value": {
            "name": "calculator-demo",
            "model": {"path": "/models/tiny-qwen3", "family": "qwen3"},
            "rollout": {
                "dataset": {"path": "examples/calculator_tool/data.jsonl"},
                "agent": {"function": "calculator_tool.agent:agent", "python_path": ["examples"]},
                "n_samples_per_prompt": 4,
            },
            "train": {"mode": "async", "max_staleness": 2, "batch_size_groups": 4, "num_steps": 20},
            "resources": {"engines": {"replicas": 2}, "rollout_workers": {"replicas": 1}},
        },
    }
}
"""Shown in /openapi.json (and used by the property-based API test as a known-good body)."""

JobId = Annotated[str, Path(pattern=JOB_ID_PATTERN, description="Job id (as returned by POST /v1/jobs)")]

JOB_EVENT_SCHEMA: dict[str, Any] = {
    "description": "One event of a job's stream (the schema of each event, as OpenAPI 3.1 reads `text/event-stream`)",
    "type": "object",
    "required": ["id", "event", "data"],
    "properties": {
        "id": {"type": "string", "pattern": r"^\d+-\d+$", "description": "Event id; resume with Last-Event-ID"},
        "event": {
            "type": "string",
            "description": "state | started | progress | error | cancel_requested | resize_requested | resized | "
            "resumed | eval",
        },
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {
                "type": "object",
                "required": ["job_id"],
                "properties": {"job_id": {"type": "string"}, "state": {"type": "string"}},
            },
        },
    },
}
Responses = dict[int | str, dict[str, Any]]
ROUTER_RESPONSES: Responses = {
    401: {"description": "No `Authorization: Bearer <token>`, or a token that is not one of the api tokens"},
    503: {"description": "Redis (the controller's store) cannot be reached; retry after Retry-After"},
}
NOT_FOUND: Responses = {404: {"description": "No job with this id (never submitted, or deleted)"}}
_LOCATION = {"description": "/v1/jobs/<job_id>", "required": True, "schema": {"type": "string"}}
SUBMIT_RESPONSES: Responses = {
    201: {"description": "The job, PENDING", "headers": {"Location": _LOCATION}},
    200: {
        "model": JobView,
        "description": "Replay: the job an earlier request with this key made",
        "headers": {
            "Location": _LOCATION,
            "Idempotent-Replayed": {"required": True, "schema": {"type": "string", "enum": ["true"]}},
        },
    },
    400: {
        "description": "A spec whose fields are valid one by one but not together (e.g. an off-policy correction "
        "applied twice: train.correction.mode), or that this controller's backend cannot run (e.g. "
        "resources.engines.kind), or a LoRA job that its `resources.engines.shared_pool` cannot serve (an "
        "undeclared pool, another base model, a rank above the pool's max_lora_rank, target modules outside the "
        "pool's), or a job with `kueue` on a release installed without Kueue (field `kueue.queue_name`); `field` "
        "names it"
    },
    422: {
        "description": "The spec breaks the schema (`field` names it); or an Idempotency-Key came with another body "
        "(code `idempotency_key_reused`); or `train.routing_replay` is true for a dense model (code "
        "`routing_replay_needs_moe`, field `train.routing_replay`: the config.json at `model.path`, when the "
        "controller can read it, has no MoE layers, so there is no routing to replay)"
    },
    429: {
        "description": "max_active_jobs jobs are already PENDING, QUEUED or RUNNING, or the job's shared engine pool "
        "has no free adapter slots (its max_loaded_loras, 2 versions per active job)"
    },
}
_bearer = HTTPBearer(auto_error=False, description="One of the controller's api tokens")


class TokenCheck:
    """Constant-time comparison against every configured token (no tokens: open, loopback development mode)."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self._tokens = [token.encode() for token in tokens]

    async def __call__(self, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
        if not self._tokens:
            return
        if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
            raise MissingTokenError("send `Authorization: Bearer <token>` with one of the controller's api tokens")
        offered = credentials.credentials.encode()
        matched = False
        for token in self._tokens:  # compare with every token, so timing says nothing about which one matched
            matched |= hmac.compare_digest(offered, token)
        if not matched:
            raise WrongTokenError("the bearer token is not one of the controller's api tokens")


def _format_sse(event_id: str, event_type: str, data: dict[str, Any]) -> bytes:
    return f"id: {event_id}\nevent: {event_type}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _job_routes(router: APIRouter, service: JobService) -> None:
    @router.post(
        "/v1/jobs", status_code=201, response_model=JobView, responses=SUBMIT_RESPONSES, summary="Submit a job"
    )
    async def submit_job(
        spec: Annotated[JobSpec, Body(openapi_examples=JOB_SPEC_EXAMPLES)],
        response: Response,
        idempotency_key: Annotated[
            str | None,
            Header(
                alias="Idempotency-Key",
                min_length=1,
                max_length=255,
                description="Makes retries safe: the same key and body return the first job; another body is 422",
            ),
        ] = None,
    ) -> JobView:
        record, created = await service.submit(spec, idempotency_key=idempotency_key)
        response.status_code = 201 if created else 200
        response.headers["Location"] = f"/v1/jobs/{record.job_id}"
        if not created:
            response.headers["Idempotent-Replayed"] = "true"
        return JobView.of(record)

    @router.get("/v1/jobs", response_model=JobList, summary="List jobs, newest first")
    async def list_jobs(
        state: Annotated[JobState | None, Query(description="Only jobs in this state")] = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 100,
        offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
    ) -> JobList:
        records = await service.list(limit=limit, offset=offset, state=state)
        return JobList(jobs=[JobView.of(record) for record in records])

    @router.get(
        "/v1/jobs/{job_id}",
        response_model=JobView,
        responses=NOT_FOUND,
        summary="One job: state, progress, metrics, errors",
    )
    async def get_job(job_id: JobId) -> JobView:
        return JobView.of(await service.get(job_id))

    @router.get(
        "/v1/jobs/{job_id}/evals",
        response_model=EvalList,
        responses=NOT_FOUND,
        summary="Evaluation scores per weight version (spec `evaluation`), oldest first",
    )
    async def get_evals(job_id: JobId) -> EvalList:
        record = await service.get(job_id)
        evaluation = record.spec.evaluation
        results = await read_evals(service.store.redis, job_id)
        step_times_ms = await read_version_steps(service.store.redis, job_id)
        return EvalList(
            job_id=job_id,
            every_n_versions=None if evaluation is None else evaluation.every_n_versions,
            evals=[VersionEvalView.of(result, step_times_ms) for result in results],
        )

    @router.post(
        "/v1/jobs/{job_id}/evals",
        status_code=201,
        response_model=VersionEvalView,
        responses={
            **NOT_FOUND,
            409: {
                "description": "That weight version already has a score (`code: eval_exists`): one per version (a "
                "`missed` version is scored by this)"
            },
            422: {"description": "The body breaks the schema (`field` names it)"},
        },
        summary="Record an external evaluator's score of a weight version (e.g. `miles eval --job-id`)",
    )
    async def post_eval(job_id: JobId, body: RecordEvalRequest) -> VersionEvalView:
        await service.get(job_id)
        result = await record_eval(service.store.redis, job_id, body)
        return VersionEvalView.of(result, await read_version_steps(service.store.redis, job_id))

    @router.post(
        "/v1/jobs/{job_id}/cancel",
        response_model=JobView,
        responses={
            202: {"model": JobView, "description": "Cancellation requested; the job is still stopping"},
            **NOT_FOUND,
            409: {"description": "The job already SUCCEEDED or FAILED (`code: job_state_conflict`)"},
        },
        summary="Cancel a job",
    )
    async def cancel_job(job_id: JobId, response: Response) -> JobView:
        record = await service.cancel(job_id)
        response.status_code = 200 if record.state.is_terminal else 202
        return JobView.of(record)

    @router.patch(
        "/v1/jobs/{job_id}",
        status_code=202,
        response_model=JobView,
        responses={
            **NOT_FOUND,
            400: {
                "description": "`engines` given for a job on a shared engine pool (field `engines`): the platform "
                "sizes that pool, the job has no engines of its own; or a job admitted by Kueue (field `kueue`): it "
                "runs with the sizes it was admitted with"
            },
            409: {"description": "The job has ended or is being cancelled: nothing to resize"},
        },
        summary="Resize a job's pools",
    )
    async def resize_job(job_id: JobId, body: ResizeRequest) -> JobView:
        return JobView.of(await service.resize(job_id, body))

    @router.delete(
        "/v1/jobs/{job_id}",
        status_code=204,
        responses={**NOT_FOUND, 409: {"description": "The job is still active: cancel it first"}},
        summary="Delete an ended job",
    )
    async def delete_job(job_id: JobId) -> Response:
        await service.delete(job_id)
        return Response(status_code=204)

    @router.get(
        "/v1/jobs/{job_id}/events",
        response_class=StreamingResponse,
        responses={
            200: {
                "description": "Server-sent events: `id: <ms>-<seq>`, `event: <type>`, `data: <JSON>` per event, "
                "keep-alive comments while idle; the stream ends after the job's terminal `state` event",
                "content": {"text/event-stream": {"schema": JOB_EVENT_SCHEMA}},
            },
            400: {"description": "Last-Event-ID (or `after`) is not an event id (`<ms>-<seq>`)"},
            **NOT_FOUND,
        },
        summary="Server-sent events of a job (resumable with Last-Event-ID)",
    )
    async def job_events(
        job_id: JobId,
        last_event_id: Annotated[
            str | None,
            Header(
                alias="Last-Event-ID",
                max_length=64,
                description="Resume after this event id (`0`: from the start)",
                json_schema_extra=EVENT_ID_SCHEMA,
            ),
        ] = None,
        after: Annotated[
            str | None, Query(max_length=64, description="Same as Last-Event-ID", json_schema_extra=EVENT_ID_SCHEMA)
        ] = None,
    ) -> StreamingResponse:
        after_id = last_event_id or after or "0"
        if not _EVENT_ID_RE.match(after_id):
            raise InvalidArgumentError(
                f"Last-Event-ID {after_id!r} is not an event id (<ms>-<seq>)", field="Last-Event-ID"
            )
        await service.get(job_id)  # 404 now, not inside the stream

        async def stream() -> AsyncIterator[bytes]:
            service.metrics.sse_streams.inc()
            try:
                yield b"retry: 2000\n\n"
                async for event in service.follow(job_id, after_id=after_id):
                    if event is None:
                        yield b": keep-alive\n\n"
                    else:
                        yield _format_sse(event.event_id, event.type, event.data)
            finally:
                service.metrics.sse_streams.dec()

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)


def require_job_end(document: dict[str, Any]) -> None:
    """JobSpec's schema as the controller enforces it (in place): a job needs `train` with `num_steps` >= 1.

    JobSpec's validator refuses `num_steps` 0, but the shared TrainConfig allows it (0 = train until stopped, for a
    trainer run by hand), so its generated schema says `minimum: 0` with default 0: stated here instead."""
    schemas = document["components"]["schemas"]
    for name, schema in schemas.items():
        if name == "JobSpec" or name.startswith("JobSpec-"):
            schema["required"] = sorted({*schema.get("required", []), "train"})
            schema["properties"]["train"].pop("default", None)
        elif name == "TrainConfig" or name.startswith("TrainConfig-"):
            schema["required"] = sorted({*schema.get("required", []), "num_steps"})
            num_steps = schema["properties"]["num_steps"]
            num_steps.pop("default", None)
            num_steps["minimum"] = 1
            num_steps["description"] = "Trainer steps of the job (>= 1): it SUCCEEDS after the last one"


def build_app(
    service: JobService,
    metrics: Metrics,
    *,
    api_tokens: Sequence[str],
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[Any]] | None = None,
    readiness_checks: dict[str, ReadinessCheck] | None = None,
) -> FastAPI:
    """The controller's FastAPI app: the common probes/metrics/errors plus the job routes behind auth."""
    app = create_http_app(
        service="controller",
        metrics=metrics,
        readiness_checks=readiness_checks,
        lifespan=lifespan,
        title="miles-controller",
        openapi_hooks=[require_job_end],
    )
    router = APIRouter(dependencies=[Depends(TokenCheck(api_tokens))], tags=["jobs"], responses=ROUTER_RESPONSES)
    _job_routes(router, service)
    app.include_router(router)
    return app
