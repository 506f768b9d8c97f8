"""The Kubernetes backend: a job's per-job objects, created from the chart's job templates with the official client.

The chart stores the per-job templates in the ConfigMap `<fullname>-job-templates`; `miles.controller.job_templates`
fills them for one job. `start` creates the job's spec ConfigMap first, then every other object (engine
Deployment of SGLang pods with weight-sync, weight-sync origin, rollout-worker Deployment, trainer StatefulSet,
Services, NetworkPolicies) with an ownerReference to it; objects that already exist are adopted (409 is fine:
`kubernetes_objects`), so `start` after a controller restart creates only what is missing. `stop` deletes the spec
ConfigMap and Kubernetes' garbage collector deletes the rest. `resize` patches the engine / rollout-worker
Deployments' replicas (and the bounds of their HPAs when the chart autoscales them: `kubernetes_autoscaling`).
`observe` reads the Deployments' and StatefulSet's ready replicas and trainer rank 0's gRPC `Status` (step, weight
version, last-step metrics, FINISHED / FAILED), and decides the phase from them (`kubernetes_progress`).

The official client is synchronous; every call runs in a worker thread (`asyncio.to_thread`).

A job that records MoE routing (R3; `routing_replay.engines_record_routing` with the session server's resolved
`record_routing` from the job's registration) gets `--enable-return-routed-experts` appended to its engine
container's args (`engine_args.with_engine_args`; the chart's extraArgs naming the flag win).

A job with `rollout.environment` also gets its environment server (Deployment, Service, NetworkPolicy), and its
rollout workers its URL (`miles.controller.env_server_templates`); `check_spec` refuses a connector the chart has
no image for, and the spec's local-only `interpreter` / `python_path`. The environment server is not a pool:
`observe` does not wait for it (the workers do).

A LoRA job on a shared engine pool (`resources.engines.shared_pool`, one of the chart's `sharedPools`) gets no
engines or weight-sync of its own, and a trainer that publishes adapters into the pool
(`miles.controller.backends.kubernetes_shared_pool`); `observe` reports the pool's ready engines without waiting.

A job that names node pools (`resources.<pool>.node_pool`) gets those pools' placement on its engines, rollout
workers and trainer (`miles.controller.backends.kubernetes_placement`); `check_spec` refuses a pool the chart's
`nodePools` do not define.

A job with inference pools (judge, teacher) also gets each pool's engines and Service, and its workers the pools'
router pools (`miles.controller.backends.kubernetes_inference_pools`); RUNNING waits for those engines too.

A job whose engine replica spans nodes (`resources.engines.nodes_per_replica` > 1) gets the chart's engine
LeaderWorkerSet instead of the engine Deployment, created, observed and resized through
`miles.controller.backends.kubernetes_lws`; `check_spec` refuses it on a release without `leaderWorkerSet.enabled`.

A job with `kueue.queue_name` (on a release with `kueue.enabled`) is created suspended and runs when Kueue admits
its Workload; a preemption suspends it again (`miles.controller.backends.kubernetes_kueue`).

Limits: the engine pool's registration with the router is the router's own discovery (EndpointSlices labelled
`miles.dev/pool`); TITO mismatch counts of the rollout workers are not read (pods are not dialled one by one); an
adopted engine Deployment (409) keeps the args it was created with.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pydantic
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from miles.common.errors import FailedPreconditionError, InvalidArgumentError, MilesError, UnavailableError
from miles.common.grpc_client import create_channel
from miles.common.jobspec.job import JobSpec
from miles.controller.backends import kubernetes_inference_pools, kubernetes_kueue, kubernetes_lws
from miles.controller.backends.base import JobProgress, SharedServices
from miles.controller.backends.kubernetes_autoscaling import fitted_autoscalers
from miles.controller.backends.kubernetes_job_spec import chart_problem, spec_files, template_params
from miles.controller.backends.kubernetes_limits import kubernetes_problem
from miles.controller.backends.kubernetes_objects import create_or_read
from miles.controller.backends.kubernetes_placement import place_on_node_pools
from miles.controller.backends.kubernetes_progress import job_progress, ready_pools
from miles.controller.backends.kubernetes_shared_pool import (
    check_pool_declared,
    check_pool_in_chart,
    place_on_shared_pool,
    ready_engines,
)
from miles.controller.engine_args import with_engine_args
from miles.controller.env_server_templates import env_server_image_of
from miles.controller.job_templates import (
    JobAddresses,
    instantiate_job_templates,
    job_spec_config_map,
    job_tokens_secret,
    owned_by,
)
from miles.controller.routing_replay import ENGINE_ROUTING_FLAG, engines_record_routing, read_model_routing
from miles.proto.trainer.v1 import trainer_pb2, trainer_pb2_grpc

if TYPE_CHECKING:
    from miles.controller.settings import ControllerSettings

log = logging.getLogger(__name__)

COMPONENT_LABEL = "app.kubernetes.io/component"
JOB_LABEL = "miles.dev/job"

_SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _component(obj: Mapping[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("labels", {}).get(COMPONENT_LABEL, ""))


def default_namespace() -> str:
    """The pod's own namespace in a cluster, else `default`."""
    if _SERVICE_ACCOUNT_NAMESPACE.exists():
        return _SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    return "default"


class KubernetesJobBackend:
    """`JobBackend` over the Kubernetes API (one ApiClient; blocking calls in threads)."""

    name = "kubernetes"

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        namespace: str,
        templates_config_map: str,
        shared: SharedServices,
        trainer_address: Callable[[str], str] = lambda address: address,
        status_timeout_s: float = 5.0,
        kueue_enabled: bool = False,
        checkpoint_timeout_s: float = 300.0,
    ) -> None:
        """`trainer_address` maps the in-cluster address of trainer rank 0 to a dialable one (tests); `kueue_enabled`:
        jobs with a `kueue` block are admitted by Kueue (else refused); `checkpoint_timeout_s`: how long a Kueue
        preemption waits for trainer rank 0's checkpoint."""
        self.api = api_client
        self.namespace = namespace
        self.templates_config_map = templates_config_map
        self.shared = shared
        self.trainer_address = trainer_address
        self.status_timeout_s = status_timeout_s
        self.core = k8s.CoreV1Api(api_client)
        self.apps = k8s.AppsV1Api(api_client)
        self.autoscaling = k8s.AutoscalingV2Api(api_client)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.kueue_enabled = kueue_enabled
        self.checkpoint_timeout_s = checkpoint_timeout_s
        self.kueue = kubernetes_kueue.KueueAdmission(api_client, namespace, self._call)
        self._job_templates: dict[str, dict[str, str]] = {}
        """The templates each job was started from (a chart upgrade changes new jobs, not running ones)."""

    @classmethod
    def from_settings(cls, settings: ControllerSettings) -> KubernetesJobBackend:
        """In-cluster credentials (or ~/.kube/config, per `kubernetes_config`) and the settings' namespace."""
        mode = settings.kubernetes_config
        if mode == "in_cluster" or (mode == "auto" and os.environ.get("KUBERNETES_SERVICE_HOST")):
            k8s_config.load_incluster_config()  # type: ignore[no-untyped-call]
        else:
            k8s_config.load_kube_config()  # type: ignore[no-untyped-call]
        return cls(
            k8s.ApiClient(),
            namespace=settings.kubernetes_namespace or default_namespace(),
            templates_config_map=settings.kubernetes_templates_config_map,
            shared=settings.shared_services(),
            kueue_enabled=settings.kubernetes_kueue,
        )

    async def _call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.to_thread(method, *args, **kwargs)
        except ApiException:
            raise
        except pydantic.ValidationError as exc:  # the client checks bodies against its models before sending
            raise FailedPreconditionError(f"the Kubernetes client refused the request: {exc}") from None
        except OSError as exc:  # urllib3 connection errors are OSErrors underneath
            raise UnavailableError(f"Kubernetes API unreachable: {type(exc).__name__}: {exc}") from exc

    async def templates(self) -> dict[str, str]:
        """The chart's per-job templates (read on every start so that a chart upgrade applies to new jobs)."""
        try:
            config_map = await self._call(
                self.core.read_namespaced_config_map, self.templates_config_map, self.namespace
            )
        except ApiException as exc:
            if exc.status == 404:
                raise FailedPreconditionError(
                    f"ConfigMap {self.namespace}/{self.templates_config_map} (the chart's job templates) not found: "
                    "install the chart, or set kubernetes_templates_config_map to <fullname>-job-templates"
                ) from None
            raise
        return dict(config_map.data or {})

    async def _templates_of(self, job_id: str) -> dict[str, str]:
        if job_id not in self._job_templates:
            self._job_templates[job_id] = await self.templates()
        return self._job_templates[job_id]

    async def check_spec(self, spec: JobSpec) -> None:
        self._check_runnable(spec)
        kubernetes_kueue.check_kueue(spec, self.kueue_enabled)
        check_pool_declared(spec, self.shared)
        try:
            templates = await self.templates()
        except MilesError:  # the API or the chart's ConfigMap is not there now: start says so, with retries
            return
        check_pool_in_chart(spec, templates)
        problem = chart_problem(templates, spec)
        if problem is not None:
            raise InvalidArgumentError(problem[1], field=problem[0])
        if spec.rollout.environment is not None:  # the chart must have an image for the connector
            env_server_image_of(templates, spec.rollout.environment.connector)

    @staticmethod
    def _check_runnable(spec: JobSpec) -> None:
        problem = kubernetes_problem(spec)
        if problem is not None:
            raise InvalidArgumentError(problem[1], field=problem[0])

    async def start(self, job_id: str, spec: JobSpec, *, record_routing: bool | None = None) -> None:
        self._check_runnable(spec)
        templates = self._job_templates[job_id] = await self.templates()
        problem = chart_problem(templates, spec)  # the chart may have changed since submission
        if problem is not None:
            raise FailedPreconditionError(problem[1])
        params = template_params(job_id, spec)
        job_objects = place_on_node_pools(instantiate_job_templates(templates, params), spec, templates)
        job_objects = fitted_autoscalers(job_objects)  # HPA bounds; the engine HPA on the LWS of multi-node engines
        files = kubernetes_inference_pools.inference_pool_files(spec_files(spec), job_id, spec)
        if spec.resources.engines.shared_pool is not None:
            job_objects, files = place_on_shared_pool(templates, job_id, spec, self.shared, job_objects, files)
        elif await self._engines_record_routing(spec, record_routing):
            job_objects = with_engine_args(job_objects, [ENGINE_ROUTING_FLAG])
        if spec.kueue is not None:  # suspended until Kueue admits the job
            job_objects = self._held_for_kueue(spec, spec.kueue.queue_name, job_objects)
        job_objects = [*job_objects, *kubernetes_inference_pools.inference_pool_objects(templates, job_id, spec)]
        spec_config_map = job_spec_config_map(templates, params, files)
        created_owner = await self._create_or_read(spec_config_map)
        tokens = job_tokens_secret(spec_config_map, {"sandbox-token": self.shared.tokens.sandbox_job(job_id)})
        objects = owned_by([tokens, *job_objects], created_owner)
        for obj in objects:
            await self._create_or_read(obj)
        if spec.kueue is not None:  # last: Kueue may admit it at once, and the objects are there to scale
            name = kubernetes_kueue.workload_name(created_owner["metadata"]["name"])
            workload = kubernetes_kueue.workload_of(name, job_id, spec.kueue.queue_name, job_objects)
            await self.kueue.create(owned_by([workload], created_owner)[0])
        log.info("job objects created", extra={"job_id": job_id, "num_objects": len(objects) + 1})

    def _held_for_kueue(
        self, spec: JobSpec, queue_name: str, job_objects: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """The job's objects, suspended for Kueue (FailedPreconditionError when Kueue is off or cannot hold them)."""
        try:
            kubernetes_kueue.check_kueue(spec, self.kueue_enabled)
        except InvalidArgumentError as exc:  # the release changed since submission
            raise FailedPreconditionError(exc.message) from None
        problem = kubernetes_kueue.unsuspendable_problem(job_objects)
        if problem:
            raise FailedPreconditionError(problem)
        return kubernetes_kueue.suspended(job_objects, queue_name)

    @staticmethod
    async def _engines_record_routing(spec: JobSpec, record_routing: bool | None) -> bool:
        """Whether the job's engines get ENGINE_ROUTING_FLAG (R3): the spec's choice, else the model's config.json
        when this process mounts it, else the session server's resolved `record_routing`. The chart's extraArgs
        naming the flag win (`with_engine_args`); the spec's `extra_args` are not applied on Kubernetes."""
        routing = await asyncio.to_thread(read_model_routing, spec.model.path)
        return engines_record_routing(spec, routing, record_routing)

    async def _create_or_read(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create `obj`; when it already exists (an adopted job), read it back. Returns the object as stored."""
        stored: dict[str, Any] = await self._call(create_or_read, self.api, self.namespace, obj)
        return stored

    async def observe(self, job_id: str, spec: JobSpec) -> JobProgress:
        templates = await self._templates_of(job_id)
        spec_name = job_spec_config_map(templates, template_params(job_id, spec), spec_files(spec))["metadata"]["name"]
        try:
            await self._call(self.core.read_namespaced_config_map, spec_name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return JobProgress(phase="failed", error=f"the job's ConfigMap {spec_name} was deleted")
            raise
        if spec.kueue is not None:  # queued, or preempted: nothing runs to observe
            name = kubernetes_kueue.workload_name(spec_name)
            held = await self.kueue.reconcile(job_id, name, lambda: self._checkpoint(templates, job_id))
            if held is not None:
                return held
        pools, problem = await ready_pools(self._call, self.apps, self.namespace, job_id)
        if spec.inference_pools:  # the judge / teacher pools' ready engines
            ready = kubernetes_inference_pools.ready_inference_engines
            pools["inference_engines"] = await self._call(ready, self.apps, self.namespace, job_id)
        shared_pool = spec.resources.engines.shared_pool
        if shared_pool is not None:  # the platform's engines: reported, never waited for
            pools["engines"] = await self._call(ready_engines, self.apps, self.namespace, templates, shared_pool)
        elif kubernetes_lws.is_multi_node(spec):  # ready groups of the engine LeaderWorkerSet
            pools["engines"] = await self._call(kubernetes_lws.ready_engine_groups, self.api, self.namespace, job_id)
        status = await self._trainer_status(templates, job_id)
        return job_progress(spec, pools, problem, status)

    async def _trainer_status(self, templates: Mapping[str, str], job_id: str) -> trainer_pb2.StatusResponse | None:
        """Trainer rank 0's Status; None while it cannot be reached (pod not ready yet)."""
        address = self.trainer_address(JobAddresses.of(templates, job_id).trainer_rank0)
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = create_channel(address, bearer_token=self.shared.tokens.trainer)
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)  # type: ignore[no-untyped-call]
        try:
            status: trainer_pb2.StatusResponse = await stub.Status(
                trainer_pb2.StatusRequest(), timeout=self.status_timeout_s
            )
        except grpc.aio.AioRpcError:
            return None
        return status

    async def _checkpoint(self, templates: Mapping[str, str], job_id: str) -> str:
        """Trainer rank 0 writes a durable checkpoint (before Kueue's preemption suspends the job); what happened."""
        address = self.trainer_address(JobAddresses.of(templates, job_id).trainer_rank0)
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = create_channel(address, bearer_token=self.shared.tokens.trainer)
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)  # type: ignore[no-untyped-call]
        try:
            response = await stub.Checkpoint(trainer_pb2.CheckpointRequest(), timeout=self.checkpoint_timeout_s)
        except grpc.aio.AioRpcError as exc:  # not running, or failed: it resumes from its previous checkpoint
            return f"no checkpoint: {exc.code().name}: {exc.details()}"
        return f"checkpoint of step {response.step} at {response.path} ({response.num_groups_acked} groups acked)"

    async def resize(self, job_id: str, spec: JobSpec, *, engines: int | None, rollout_workers: int | None) -> None:
        templates = await self._templates_of(job_id)
        objects = instantiate_job_templates(templates, template_params(job_id, spec))
        sizes = {"engine": engines, "rollout-worker": rollout_workers}
        for obj in objects:
            replicas = sizes.get(_component(obj))
            if replicas is None:
                continue
            name = obj["metadata"]["name"]
            if obj["kind"] == "Deployment":
                await self._call(
                    self.apps.patch_namespaced_deployment, name, self.namespace, {"spec": {"replicas": replicas}}
                )
            elif obj["kind"] == kubernetes_lws.LWS_KIND:
                await self._call(kubernetes_lws.resize, self.api, self.namespace, name, replicas)
            elif obj["kind"] == "HorizontalPodAutoscaler":
                maximum = max(replicas, int(obj["spec"].get("maxReplicas", replicas)))
                body = {"spec": {"minReplicas": replicas, "maxReplicas": maximum}}
                await self._call(
                    self.autoscaling.patch_namespaced_horizontal_pod_autoscaler, name, self.namespace, body
                )

    async def stop(self, job_id: str) -> None:
        """Delete the spec ConfigMap; the garbage collector deletes the objects it owns."""
        self._job_templates.pop(job_id, None)
        selector = f"{JOB_LABEL}={job_id},{COMPONENT_LABEL}=job-spec"
        config_maps = await self._call(self.core.list_namespaced_config_map, self.namespace, label_selector=selector)
        for config_map in config_maps.items:
            try:
                await self._call(
                    self.core.delete_namespaced_config_map,
                    config_map.metadata.name,
                    self.namespace,
                    body=k8s.V1DeleteOptions(propagation_policy="Background"),
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        await asyncio.to_thread(self.api.close)
