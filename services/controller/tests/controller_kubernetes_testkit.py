"""A fake Kubernetes API and trainer for the Kubernetes backend's tests (test code: no cluster here; this folder is
put on sys.path by conftest.py).

The fake speaks the few REST paths the backend uses, validates every object it is asked to create with
`kubernetes_validate` (Kubernetes 1.34, strict; custom resources such as LeaderWorkerSets against their vendored
CRD schemas, `miles.common.testing.crd_schemas`), keeps Deployment/StatefulSet/LeaderWorkerSet status, and
garbage-collects owned objects when their owner is deleted, as the real API server does. A `status` subresource
PATCH (Kueue Workloads) changes only `status`, refuses a stale `metadata.resourceVersion` (409) and validates a
custom resource's result. Trainer rank 0 is a small gRPC server (pods do not run without a kubelet): Status, and
Checkpoint (counted, with a hook for tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from kubernetes import client as k8s

from miles.common.serve import serve_async
from miles.common.testing.crd_schemas import custom_resource_schemas, validate_custom_object
from miles.common.testing.helm import render_chart
from miles.common.testing.ports import free_port
from miles.controller.backends.base import PlatformTokens, SharedPool, SharedServices
from miles.controller.backends.kubernetes import KubernetesJobBackend
from miles.proto.trainer.v1 import trainer_pb2, trainer_pb2_grpc

KUBERNETES_VERSION = "1.34"
NAMESPACE = "miles"
TEMPLATES = "miles-job-templates"
_PATH_RE = re.compile(r"^/(api/v1|apis/[^/]+/[^/]+)/namespaces/([^/]+)/([^/]+)(?:/([^/]+)(?:/(status))?)?$")
WORKLOADS = {"deployments", "statefulsets", "leaderworkersets"}


def chart_job_templates(
    repo_root: Path, values_files: Sequence[Path] = (), set_values: Sequence[str] = ()
) -> dict[str, str]:
    """The data of the chart's job-templates ConfigMap, rendered with helm (values files, then --set arguments)."""
    objects = render_chart(repo_root / "helm" / "miles", values_files, set_values, namespace=NAMESPACE)
    (config_map,) = [obj for obj in objects if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == TEMPLATES]
    return dict(config_map["data"])


def _status(code: int, reason: str, message: str) -> JSONResponse:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "reason": reason,
        "code": code,
        "message": message,
    }
    return JSONResponse(body, status_code=code)


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        elif value is None:
            target.pop(key, None)
        else:
            target[key] = value


class FakeKubernetesApi:
    """Objects by (group/version, resource, namespace, name); a log of every request."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        self.num_validated = 0
        self._versions = itertools.count(1)
        self.app = FastAPI()
        self.app.add_api_route("/{path:path}", self.handle, methods=["GET", "POST", "PATCH", "DELETE"])

    def add(self, group_version: str, resource: str, obj: dict[str, Any]) -> None:
        self.objects[
            (group_version, resource, obj["metadata"].get("namespace", NAMESPACE), obj["metadata"]["name"])
        ] = obj

    def of_job(self, job_id: str) -> list[dict[str, Any]]:
        return [
            obj for obj in self.objects.values() if obj["metadata"].get("labels", {}).get("miles.dev/job") == job_id
        ]

    async def handle(self, request: Request) -> JSONResponse:
        path = request.url.path
        self.requests.append((request.method, path))
        match = _PATH_RE.match(path)
        if match is None:
            return _status(404, "NotFound", f"no route {path}")
        group_version, namespace, resource, name, subresource = match.groups()
        if request.method == "POST":
            return self._create(group_version, namespace, resource, await request.json())
        key = (group_version, resource, namespace, name or "")
        if name is None:
            return self._list(group_version, namespace, resource, request.query_params.get("labelSelector", ""))
        if key not in self.objects:
            return _status(404, "NotFound", f"{resource} {name} not found")
        if request.method == "GET":
            return JSONResponse(self.objects[key])
        if request.method == "PATCH" and subresource == "status":
            return self._patch_status(key, json.loads(await request.body()))
        if request.method == "PATCH":
            _merge(self.objects[key], json.loads(await request.body()))
            self._settle(resource, self.objects[key])
            return JSONResponse(self.objects[key])
        deleted = self.objects.pop(key)
        self._collect_garbage(deleted["metadata"]["uid"])
        return JSONResponse({"kind": "Status", "apiVersion": "v1", "status": "Success"})

    def _patch_status(self, key: tuple[str, str, str, str], patch: dict[str, Any]) -> JSONResponse:
        """A merge patch of the status subresource: only `status` changes, a stale resourceVersion is a 409, and a
        custom resource's new status is validated against its CRD's schema."""
        stored = self.objects[key]
        version = patch.get("metadata", {}).get("resourceVersion")
        if version is not None and version != stored["metadata"].get("resourceVersion"):
            return _status(409, "Conflict", f"{key[1]} {key[3]}: the object has been modified")
        updated = copy.deepcopy(stored)
        _merge(updated, {"status": patch.get("status", {})})
        if (updated.get("apiVersion"), updated.get("kind")) in custom_resource_schemas():
            try:
                validate_custom_object(updated)
            except ValueError as exc:
                return _status(422, "Invalid", str(exc))
        updated["metadata"]["resourceVersion"] = str(next(self._versions))
        self.objects[key] = updated
        return JSONResponse(updated)

    def _create(self, group_version: str, namespace: str, resource: str, obj: dict[str, Any]) -> JSONResponse:
        try:
            if (obj.get("apiVersion"), obj.get("kind")) in custom_resource_schemas():
                validate_custom_object(obj)
            else:
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            return _status(422, "Invalid", f"{obj.get('kind')} {obj['metadata'].get('name')}: {exc.message}")
        except ValueError as exc:  # a custom resource against its CRD's schema
            return _status(422, "Invalid", str(exc))
        self.num_validated += 1
        key = (group_version, resource, namespace, obj["metadata"]["name"])
        if key in self.objects:
            return _status(409, "AlreadyExists", f"{resource} {obj['metadata']['name']} already exists")
        stored = copy.deepcopy(obj)
        stored["metadata"].update(namespace=namespace, uid=str(uuid.uuid4()), resourceVersion=str(next(self._versions)))
        self._settle(resource, stored)
        self.objects[key] = stored
        return JSONResponse(stored, status_code=201)

    def _settle(self, resource: str, obj: dict[str, Any]) -> None:
        """What the workload controllers and kubelet would do: every replica ready at once."""
        if resource in WORKLOADS:
            replicas = int(obj["spec"].get("replicas", 1))
            obj["status"] = {"replicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas}

    def _list(self, group_version: str, namespace: str, resource: str, selector: str) -> JSONResponse:
        wanted = dict(part.split("=", 1) for part in selector.split(",") if part)
        items = [
            obj
            for (gv, res, ns, _), obj in self.objects.items()
            if (gv, res, ns) == (group_version, resource, namespace)
            and all(obj["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())
        ]
        return JSONResponse({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": "1"}, "items": items})

    def _collect_garbage(self, owner_uid: str) -> None:
        for key, obj in list(self.objects.items()):
            owned = any(ref["uid"] == owner_uid for ref in obj["metadata"].get("ownerReferences", []))
            if owned and self.objects.pop(key, None) is not None:
                self._collect_garbage(obj["metadata"]["uid"])


class FakeTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    """Trainer rank 0's Status, as the real trainer answers it."""

    def __init__(self) -> None:
        self.state = trainer_pb2.TRAINER_STATE_TRAINING
        self.step = 0
        self.error = ""
        self.authorization: list[str] = []
        self.checkpoints = 0
        self.on_checkpoint: Callable[[], None] | None = None
        """Called at each Checkpoint (tests look at the cluster at that moment)."""

    async def Checkpoint(self, request: Any, context: Any) -> trainer_pb2.CheckpointResponse:
        self.checkpoints += 1
        if self.on_checkpoint is not None:
            self.on_checkpoint()
        return trainer_pb2.CheckpointResponse(step=self.step, path=f"/ckpt/step-{self.step}", num_groups_acked=2)

    async def Status(self, request: Any, context: Any) -> trainer_pb2.StatusResponse:
        self.authorization += [value for key, value in context.invocation_metadata() if key == "authorization"]
        return trainer_pb2.StatusResponse(
            state=self.state,
            step=self.step,
            weight_version=self.step,
            error=self.error,
            last_step_metrics={"reward_mean": 0.5, "staleness_mean": 1.0},
        )


@contextlib.asynccontextmanager
async def fake_cluster(
    templates: dict[str, str] | None,
    tokens: PlatformTokens | None = None,
    shared_pools: tuple[SharedPool, ...] = (),
) -> AsyncIterator[tuple[FakeKubernetesApi, FakeTrainer, KubernetesJobBackend]]:
    """The fake API (holding the templates ConfigMap, when given), trainer rank 0 and a backend wired to both."""
    api = FakeKubernetesApi()
    if templates is not None:
        api.add(
            "api/v1",
            "configmaps",
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": TEMPLATES, "namespace": NAMESPACE, "uid": "t"},
                "data": templates,
            },
        )
    stop = asyncio.Event()
    port = free_port()
    server = asyncio.create_task(
        serve_async(http_app=api.app, http_port=port, stop_event=stop, handle_signals=False, grace_s=1.0)
    )
    trainer = FakeTrainer()
    grpc_server = grpc.aio.server()
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(trainer, grpc_server)
    trainer_port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    configuration = k8s.Configuration(host=f"http://127.0.0.1:{port}")
    shared = SharedServices(
        "redis://r:6379/0",
        "http://router:8082",
        "",
        "http://session:8081",
        "tok",
        "buffer:50051",
        "sandbox:50061",
        "",
        tokens or PlatformTokens(),
        shared_pools,
    )
    backend = KubernetesJobBackend(
        k8s.ApiClient(configuration),
        namespace=NAMESPACE,
        templates_config_map=TEMPLATES,
        shared=shared,
        trainer_address=lambda _: f"127.0.0.1:{trainer_port}",
    )
    for _ in range(200):
        if server.done():
            await server  # re-raises a start-up failure
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            break
        await asyncio.sleep(0.02)
    try:
        yield api, trainer, backend
    finally:
        await backend.close()
        await grpc_server.stop(0)
        stop.set()
        await server
