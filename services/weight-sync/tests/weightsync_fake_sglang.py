"""A fake SGLang engine for the nccl transport's tests (our CPU engine does not implement SGLang's NCCL weight
update endpoints, and real SGLang needs CUDA). It records every control request in order and really joins the
weight-update process group: /init_weights_update_group rendezvouses as rank `rank_offset` (gloo on the CPU,
nccl with --device cuda:N), /update_weights_from_distributed receives each listed tensor by broadcast from rank 0
and keeps its sha256. GET /_requests and /_tensors expose what it saw.

Run: python weightsync_fake_sglang.py --port P [--device cpu|cuda:1]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
from typing import Any

import torch
import torch.distributed as dist
import uvicorn
from fastapi import FastAPI, Request

from miles.weightsync.nccl import init_custom_process_group


def create_app(device: str) -> FastAPI:
    app = FastAPI()
    requests: list[dict[str, Any]] = []
    tensors: dict[str, str] = {}
    groups: dict[str, Any] = {}
    state = {"weight_version": "default"}

    async def record(request: Request) -> dict[str, Any]:
        body = await request.json() if await request.body() else {}
        requests.append({"path": request.url.path, "body": body})
        return body

    @app.get("/model_info")
    async def model_info(request: Request) -> dict[str, Any]:
        requests.append({"path": "/model_info", "body": {}})
        return {"weight_version": state["weight_version"], "model_path": "fake"}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.post("/pause_generation")
    @app.post("/continue_generation")
    async def lifecycle(request: Request) -> dict[str, str]:
        await record(request)
        return {"status": "ok"}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        body = await record(request)
        state["weight_version"] = body["new_version"]
        return {"success": True, "new_version": body["new_version"]}

    @app.post("/init_weights_update_group")
    async def init_group(request: Request) -> dict[str, Any]:
        body = await record(request)
        init_method = f"tcp://{body['master_address']}:{body['master_port']}"
        groups[body["group_name"]] = await asyncio.to_thread(
            init_custom_process_group,
            body["backend"],
            init_method,
            body["world_size"],
            body["rank_offset"],
            body["group_name"],
            120.0,
        )
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(request: Request) -> dict[str, Any]:
        body = await record(request)
        group = groups[body["group_name"]]

        def receive() -> None:
            for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                dist.broadcast(tensor, src=0, group=group)
                raw = tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                tensors[name] = hashlib.sha256(raw).hexdigest()

        await asyncio.to_thread(receive)
        if body.get("weight_version") is not None:
            state["weight_version"] = body["weight_version"]
        return {"success": True, "message": "Succeeded to update parameter online."}

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request) -> dict[str, Any]:
        body = await record(request)
        dist.destroy_process_group(groups.pop(body["group_name"]))
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    @app.get("/_requests")
    async def recorded() -> list[dict[str, Any]]:
        return requests

    @app.get("/_tensors")
    async def received() -> dict[str, str]:
        return tensors

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    uvicorn.run(create_app(args.device), host="127.0.0.1", port=args.port, log_level="warning")
