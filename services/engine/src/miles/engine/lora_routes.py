"""HTTP routes of SGLang's LoRA API: /load_lora_adapter and /unload_lora_adapter over `Engine.adapters`.

Answers as SGLang's (python/sglang/srt/entrypoints/http_server.py): its `LoRAUpdateOutput` as JSON, status 200
with `success` true, or 400 with `success` false and `error_message`. Both are control routes (auth.py).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from miles.engine.adapters import LoraError
from miles.engine.core import Engine
from miles.engine.openapi_docs import Responses
from miles.engine.protocol import LoadLoRAAdapterBody, LoRAUpdateResponse, UnloadLoRAAdapterBody

LORA_RESPONSES: Responses = {
    200: {"model": LoRAUpdateResponse, "description": "Done; `loaded_adapters` lists every adapter loaded now"},
    400: {"model": LoRAUpdateResponse, "description": "Refused (`success` false, `error_message`); nothing changed"},
}


def add_lora_routes(router: APIRouter, engine: Engine) -> None:
    @router.post("/load_lora_adapter", response_model=LoRAUpdateResponse, responses=LORA_RESPONSES)
    async def load_lora_adapter(body: LoadLoRAAdapterBody) -> JSONResponse:
        try:
            await engine.adapters.load(body.lora_name, body.lora_path, body.pinned)
        except LoraError as exc:
            return _refused(exc)
        return _done(engine)

    @router.post("/unload_lora_adapter", response_model=LoRAUpdateResponse, responses=LORA_RESPONSES)
    async def unload_lora_adapter(body: UnloadLoRAAdapterBody) -> JSONResponse:
        try:
            await engine.adapters.unload(body.lora_name)
        except LoraError as exc:
            return _refused(exc)
        return _done(engine)


def _done(engine: Engine) -> JSONResponse:
    return JSONResponse(LoRAUpdateResponse(success=True, loaded_adapters=engine.adapters.loaded).model_dump())


def _refused(exc: LoraError) -> JSONResponse:
    return JSONResponse(LoRAUpdateResponse(success=False, error_message=exc.message).model_dump(), status_code=400)
