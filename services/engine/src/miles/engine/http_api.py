"""HTTP routes of the engine: SGLang's native protocol over `Engine` (parse, call the core, shape the reply).

Status and body conventions copied from SGLang: /generate errors are 400 `{"error": {"message": ...}}`;
request-schema errors are 400 `{"object": "error", "message", "type": "Bad Request", "param": null,
"code": 400}`; streams are `data: {json}\\n\\n` events ending with `data: [DONE]\\n\\n`; weight updates answer
`{"success", "message", ...}` with 200 or 400 (also the weight-update group routes and /weights_checker,
whose `payload` is a miles extension). /health is a plain 200 once started (SGLang with
SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0, so that pauses and weight updates never make a router drop the
engine); /health_generate really generates one token and answers 503 while paused.

Every route but /health and /health_generate is declared on one router guarded by `EngineAuth` (auth.py says
which key each route needs); the probes of create_http_app (/healthz, /readyz, /metrics) stay open too. What each
route answers (statuses, media types, bodies) is declared in openapi_docs.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from miles.common.auth import AUTH_RESPONSES
from miles.common.contracts.headers import MIN_WEIGHT_VERSION_HEADER
from miles.common.errors import MilesError
from miles.common.http import router_error_response
from miles.engine.auth import EngineAuth
from miles.engine.core import Engine
from miles.engine.distributed import DESTROY_MESSAGE, INIT_MESSAGE
from miles.engine.errors import BadRequestError, EngineBusyError, WeightsCheckError, WeightUpdateError
from miles.engine.info import ServedModel, legacy_load, loads, model_info, models, server_info
from miles.engine.lora_routes import add_lora_routes
from miles.engine.openapi_docs import (
    APPLY_EXAMPLES,
    CHECK_REFUSED,
    CONTINUE_RESPONSES,
    DISK_UPDATE_RESPONSES,
    EMPTY_OK,
    FLUSH_RESPONSES,
    GENERATE_OPENAPI,
    GENERATE_RESPONSES,
    HEALTH_GENERATE_RESPONSES,
    HEALTH_RESPONSES,
    MEMORY_RESPONSES,
    PAUSE_RESPONSES,
    REFUSED,
    RELEASE_REFUSED,
    STAGE_EXAMPLES,
    TENSOR_EXAMPLES,
)
from miles.engine.planning import GeneratePlan
from miles.engine.protocol import (
    AbortRequestBody,
    ApplyStagedWeightsBody,
    CheckWeightsBody,
    ContinueGenerationBody,
    DestroyWeightsUpdateGroupBody,
    GenerateRequest,
    InitWeightsUpdateGroupBody,
    MemoryOccupationBody,
    PauseGenerationBody,
    PauseResponse,
    StageWeightsFromTensorBody,
    SuccessResponse,
    UpdateWeightsFromDiskBody,
    UpdateWeightsFromDistributedBody,
    UpdateWeightsFromTensorBody,
    UpdateWeightVersionBody,
    WeightsCheckerResponse,
    WeightsChecksum,
    WeightVersionResponse,
)
from miles.engine.settings import EngineSettings

FLUSH_MESSAGE = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)

FlushTimeout = Annotated[
    float, Query(ge=0.0, allow_inf_nan=False, description="Seconds to wait for the engine to become idle")
]
"""/flush_cache's `timeout`: SGLang's bound (>= 0), and finite, so that a busy engine always answers."""
LoadSections = Annotated[
    str, Query(description="Comma-separated sections: core (always), lora or all (adds `lora`); others are ignored")
]
"""/v1/loads' `include` (SGLang's)."""
_BODY_PARSE_DETAIL = "There was an error parsing the body"
"""FastAPI's 400 for a JSON body that is not UTF-8 text."""


def _schema_error(errors: Sequence[Any]) -> JSONResponse:
    problems = "; ".join(f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg', '')}" for err in errors)
    body = {"object": "error", "message": problems or "invalid request", "type": "Bad Request", "param": None}
    return JSONResponse({**body, "code": 400}, status_code=400)


def add_routes(app: FastAPI, engine: Engine, settings: EngineSettings, served: ServedModel) -> None:
    @app.exception_handler(RequestValidationError)
    async def handle_schema_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _schema_error(exc.errors())

    @app.exception_handler(StarletteHTTPException)
    async def handle_router_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == _BODY_PARSE_DETAIL:  # a body that is not UTF-8: not JSON either
            return _schema_error([{"loc": ("body",), "msg": "JSON decode error: the body is not UTF-8 text"}])
        return router_error_response(exc)

    @app.get("/health", response_class=Response, responses=HEALTH_RESPONSES)
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate", response_class=Response, responses=HEALTH_GENERATE_RESPONSES)
    async def health_generate() -> Response:
        ok = await engine.health_generate(settings.health_generate_timeout_s)
        return Response(status_code=200 if ok else 503)

    auth = EngineAuth.from_settings(settings)
    guarded = APIRouter(dependencies=[Depends(auth.http_dependency)], responses=AUTH_RESPONSES)
    add_generation_routes(guarded, engine, settings, served)
    add_control_routes(guarded, engine, served)
    add_update_group_routes(guarded, engine)
    add_staging_routes(guarded, engine)
    add_lora_routes(guarded, engine)
    app.include_router(guarded)


def add_generation_routes(router: APIRouter, engine: Engine, settings: EngineSettings, served: ServedModel) -> None:
    """/generate and the read-only info routes."""

    # One route per method (not api_route with methods=[...]): each gets its own OpenAPI operationId.
    @router.post("/generate", response_model=None, responses=GENERATE_RESPONSES, openapi_extra=GENERATE_OPENAPI)
    @router.put("/generate", response_model=None, responses=GENERATE_RESPONSES, openapi_extra=GENERATE_OPENAPI)
    async def generate(request: Request) -> Response:
        # Parsed by hand: SGLang reads the body as JSON whatever the Content-Type says.
        try:
            body = GenerateRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            return _schema_error(exc.errors())
        plan = engine.plan(body, _min_weight_version(request.headers.get(MIN_WEIGHT_VERSION_HEADER)))
        if plan.stream:
            return StreamingResponse(_sse(engine, plan), media_type="text/event-stream")
        return JSONResponse(await engine.generate(plan))

    @router.get("/model_info")
    @router.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return model_info(engine, served)

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return server_info(engine, settings, served)

    @router.get("/get_weight_version")
    @router.get("/weight_version")
    async def get_weight_version() -> dict[str, str]:
        return {"weight_version": engine.scheduler.weight_version}

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return models(engine, served)

    @router.get("/v1/loads")
    async def get_loads(include: LoadSections = "core") -> dict[str, Any]:
        return loads(engine, settings, include)

    @router.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        return legacy_load(engine)


def add_control_routes(router: APIRouter, engine: Engine, served: ServedModel) -> None:
    """Cache, pause, abort and memory control, disk and tensor weight updates, the weight version."""

    @router.get("/flush_cache", response_class=PlainTextResponse, responses=FLUSH_RESPONSES)
    @router.post("/flush_cache", response_class=PlainTextResponse, responses=FLUSH_RESPONSES)
    async def flush_cache(timeout: FlushTimeout = 0.0) -> PlainTextResponse:  # noqa: ASYNC109 (SGLang's name)
        flushed = await engine.flush_cache(timeout)
        return PlainTextResponse(FLUSH_MESSAGE, status_code=200 if flushed else 400)

    @router.post("/abort_request", response_class=Response, responses=EMPTY_OK)
    async def abort_request(body: AbortRequestBody) -> Response:
        await engine.abort(body.rid, body.abort_all)
        return Response(status_code=200)

    @router.post("/pause_generation", responses=PAUSE_RESPONSES)
    async def pause_generation(body: PauseGenerationBody | None = None) -> PauseResponse:
        await engine.pause((body or PauseGenerationBody()).mode)
        return PauseResponse(message="Generation paused successfully.", status="ok")

    @router.post("/continue_generation", responses=CONTINUE_RESPONSES)
    async def continue_generation(body: ContinueGenerationBody | None = None) -> PauseResponse:
        await engine.resume()
        return PauseResponse(message="Generation continued successfully.", status="ok")

    @router.post("/update_weights_from_disk", responses=DISK_UPDATE_RESPONSES)
    async def update_weights_from_disk(body: UpdateWeightsFromDiskBody) -> JSONResponse:
        try:
            num_paused = await engine.update_weights_from_disk(
                body.model_path,
                weight_version=body.weight_version,
                abort_all=body.abort_all_requests,
                flush_cache=body.flush_cache,
            )
        except WeightUpdateError as exc:
            return JSONResponse({"success": False, "message": exc.message, "num_paused_requests": 0}, 400)
        served.model_path = body.model_path
        message = "Succeeded to update model weights." + _version_note(body.weight_version)
        return JSONResponse({"success": True, "message": message, "num_paused_requests": num_paused})

    @router.post("/update_weights_from_tensor", response_model=SuccessResponse, responses=REFUSED)
    async def update_weights_from_tensor(
        body: Annotated[UpdateWeightsFromTensorBody, Body(openapi_examples=TENSOR_EXAMPLES)],
    ) -> JSONResponse:
        try:
            await engine.update_weights_from_tensor(
                body.serialized_named_tensors,
                body.load_format,
                weight_version=body.weight_version,
                abort_all=body.abort_all_requests,
                flush_cache=body.flush_cache,
            )
        except WeightUpdateError as exc:
            return JSONResponse({"success": False, "message": exc.message}, 400)
        message = "Succeeded to update model weights." + _version_note(body.weight_version)
        return JSONResponse({"success": True, "message": message})

    @router.post("/update_weight_version")
    async def update_weight_version(body: UpdateWeightVersionBody) -> WeightVersionResponse:
        await engine.update_weight_version(body.new_version, body.abort_all_requests)
        message = f"Weight version updated to {body.new_version}"
        return WeightVersionResponse(success=True, message=message, new_version=body.new_version)

    release_responses = {**MEMORY_RESPONSES, **RELEASE_REFUSED}

    @router.get("/release_memory_occupation", responses=release_responses)
    @router.post("/release_memory_occupation", responses=release_responses)
    async def release_memory_occupation(body: MemoryOccupationBody | None = None) -> JSONResponse:
        tags = (body or MemoryOccupationBody()).tags
        if (tags is None or "kv_cache" in tags) and not await engine.flush_cache():
            raise EngineBusyError("the engine is not idle: the KV cache cannot be released")
        return JSONResponse(None)

    @router.get("/resume_memory_occupation", responses=MEMORY_RESPONSES)
    @router.post("/resume_memory_occupation", responses=MEMORY_RESPONSES)
    async def resume_memory_occupation(body: MemoryOccupationBody | None = None) -> JSONResponse:
        return JSONResponse(None)


def add_staging_routes(router: APIRouter, engine: Engine) -> None:
    """Staged tensor updates (a miles extension; stock SGLang answers 404, and weight-sync then loads under the
    pause): decode and validate a version while generating, swap it in during a short pause."""

    @router.post("/stage_weights_from_tensor", response_model=SuccessResponse, responses=REFUSED)
    async def stage_weights_from_tensor(
        body: Annotated[StageWeightsFromTensorBody, Body(openapi_examples=STAGE_EXAMPLES)],
    ) -> JSONResponse:
        try:
            staged = await engine.stage_weights_from_tensor(
                body.serialized_named_tensors, body.load_format, body.stage_id
            )
        except WeightUpdateError as exc:
            return _failure(exc)
        return JSONResponse({"success": True, "message": f"Staged {staged} tensors under {body.stage_id}."})

    @router.post("/apply_staged_weights", response_model=SuccessResponse, responses=REFUSED)
    async def apply_staged_weights(
        body: Annotated[ApplyStagedWeightsBody, Body(openapi_examples=APPLY_EXAMPLES)],
    ) -> JSONResponse:
        try:
            await engine.apply_staged_weights(
                body.stage_id,
                weight_version=body.weight_version,
                abort_all=body.abort_all_requests,
                flush_cache=body.flush_cache,
            )
        except WeightUpdateError as exc:
            return _failure(exc)
        message = "Succeeded to update model weights." + _version_note(body.weight_version)
        return JSONResponse({"success": True, "message": message})


def add_update_group_routes(router: APIRouter, engine: Engine) -> None:
    """SGLang's weight-update group protocol (distributed.py) and /weights_checker."""

    @router.post("/init_weights_update_group", response_model=SuccessResponse, responses=REFUSED)
    async def init_weights_update_group(body: InitWeightsUpdateGroupBody) -> JSONResponse:
        try:
            await engine.update_groups.init(body)
        except WeightUpdateError as exc:
            return _failure(exc)
        return JSONResponse({"success": True, "message": INIT_MESSAGE})

    @router.post("/update_weights_from_distributed", response_model=SuccessResponse, responses=REFUSED)
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedBody) -> JSONResponse:
        try:
            await engine.update_weights_from_distributed(body)
        except WeightUpdateError as exc:
            return _failure(exc)
        message = "Succeeded to update parameter online." + _version_note(body.weight_version)
        return JSONResponse({"success": True, "message": message})

    @router.post("/destroy_weights_update_group", response_model=SuccessResponse, responses=REFUSED)
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupBody) -> JSONResponse:
        try:
            await engine.update_groups.destroy(body.group_name)
        except WeightUpdateError as exc:
            return _failure(exc)
        return JSONResponse({"success": True, "message": DESTROY_MESSAGE})

    @router.get("/weights_checker", response_model=WeightsCheckerResponse, responses=CHECK_REFUSED)
    @router.post("/weights_checker", response_model=WeightsCheckerResponse, responses=CHECK_REFUSED)
    async def weights_checker(body: CheckWeightsBody | None = None) -> JSONResponse:
        request = body or CheckWeightsBody()
        try:
            if request.action != "checksum":
                raise WeightsCheckError(f"action {request.action!r} is not supported (only 'checksum')")
            version, checksum = await engine.weights_checksum(request.dtype)
        except WeightsCheckError as exc:
            return _failure(exc)
        payload = WeightsChecksum(
            weight_version=version,
            dtype=checksum.dtype,
            digest=checksum.digest,
            exact=checksum.exact,
            num_tensors=checksum.num_tensors,
        )
        message = f"Checksum of {checksum.num_tensors} tensors in {checksum.dtype}."
        return JSONResponse({"success": True, "message": message, "payload": payload.model_dump()})


def _min_weight_version(header: str | None) -> int | None:
    """X-Miles-Min-Weight-Version as an integer (None when absent); BadRequestError when it is not one."""
    if header is None:
        return None
    try:
        return int(header)
    except ValueError:
        raise BadRequestError(f"{MIN_WEIGHT_VERSION_HEADER} must be an integer, got {header!r}") from None


def _failure(exc: MilesError) -> JSONResponse:
    return JSONResponse({"success": False, "message": exc.message}, status_code=400)


def _version_note(weight_version: str | None) -> str:
    return "" if weight_version is None else f" Weight version updated to {weight_version}."


async def _sse(engine: Engine, plan: GeneratePlan) -> AsyncIterator[str]:
    try:
        async for chunk in engine.stream(plan):
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    except MilesError as exc:
        error = {"message": exc.message, "type": "invalid_request_error", "code": exc.http_status, "retryable": False}
        yield f"data: {json.dumps({'error': error})}\n\n"
    yield "data: [DONE]\n\n"
