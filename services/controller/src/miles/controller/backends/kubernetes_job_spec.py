"""What the Kubernetes backend makes of a job spec: the files of its spec ConfigMap, the parameters of the chart's
job templates, and what this release's chart cannot give it (refused at submission, before anything is created)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from miles.common.jobspec.job import JobSpec
from miles.controller.backends import kubernetes_lws
from miles.controller.backends.base import barrier_settings
from miles.controller.backends.kubernetes_inference_pools import inference_pool_problem
from miles.controller.backends.kubernetes_placement import node_pool_problem
from miles.controller.env_server_templates import EnvironmentServerParams
from miles.controller.job_templates import JobTemplateParams, engine_kind_of


def spec_files(spec: JobSpec) -> dict[str, dict[str, Any]]:
    """The four files of the job's spec ConfigMap (`job_templates.SPEC_FILES`): what each process reads of the spec.

    Only fields the templates do not set by environment (see the job_templates docstring)."""
    sync = spec.weight_sync
    # The chart sets the addresses by env (origin, router, pool, update-group port); the spec decides the rest.
    publish = {"kind": sync.transport, "dtype": sync.dtype, "pause_mode": spec.pause_mode}
    return {
        "spec.json": (spec_json := spec.model_dump(mode="json")),
        "trainer.json": {
            "train": spec.train.model_dump(mode="json"),
            "backend": spec.resources.trainer.backend,
            "publish": publish,
        },
        "rollout.json": {
            "rollout": spec.rollout.model_dump(mode="json"),
            "evaluation": spec_json["evaluation"],
            **barrier_settings(spec),
        },
        "weightsync.json": {"pause_mode": spec.pause_mode},
    }


def template_params(job_id: str, spec: JobSpec) -> JobTemplateParams:
    resources = spec.resources
    return JobTemplateParams(
        job_id=job_id,
        model_path=spec.model.path,
        engine_replicas=resources.engines.replicas,
        engine_gpus=resources.engines.gpus_per_replica,
        tp_size=resources.engines.tp_size,
        engine_nodes=resources.engines.nodes_per_replica,
        rollout_worker_replicas=resources.rollout_workers.replicas,
        rollout_worker_max_replicas=resources.rollout_workers.max_replicas or 0,
        trainer_replicas=resources.trainer.replicas,
        trainer_gpus=resources.trainer.gpus_per_replica,
        environment=environment_params(spec),
    )


def environment_params(spec: JobSpec) -> EnvironmentServerParams | None:
    """The job's environment server (`rollout.environment`), or None for a job that runs its own agent."""
    environment = spec.rollout.environment
    if environment is None:
        return None
    return EnvironmentServerParams(
        connector=environment.connector,
        args_json=json.dumps(environment.args, sort_keys=True),
        replicas=environment.replicas,
        startup_timeout_s=environment.startup_timeout_s,
    )


def engine_kind_problem(templates: Mapping[str, str], spec: JobSpec) -> str:
    """Why the chart cannot run `spec`'s engines ("" when it can). The chart decides the engine implementation for
    the release; a job asking for the other one is refused before anything is created (running it on the wrong
    engine would silently change what it measures)."""
    if spec.resources.engines.shared_pool is not None:  # no engines of its own: the pool's are the chart's kind
        return ""
    chart_kind = engine_kind_of(templates)
    wanted = spec.resources.engines.kind
    if not chart_kind or chart_kind == wanted:
        return ""
    return (
        f"the job asks for resources.engines.kind={wanted!r} but this release's chart runs {chart_kind!r} engines "
        f"(jobTemplates.engine.kind); submit it with kind {chart_kind!r} or install the chart with "
        f"jobTemplates.engine.kind={wanted}"
    )


def chart_problem(templates: Mapping[str, str], spec: JobSpec) -> tuple[str, str] | None:
    """(field, why) of what this release's chart cannot give `spec`: its engine kind, a node pool it names, its
    inference pools."""
    kind_problem = engine_kind_problem(templates, spec)
    if kind_problem:
        return "resources.engines.kind", kind_problem
    problem = kubernetes_lws.lws_problem(spec, templates) or node_pool_problem(spec, templates)
    return problem or inference_pool_problem(spec, templates)
