"""What the Kubernetes backend cannot run (checked at submission, so the caller gets a 400 naming the field, and
again at start, for a job accepted by another controller version).

- `weight_sync.transport: disk`: needs a volume the trainer and the engines share, which the chart does not mount.
- `rollout.environment.interpreter` / `python_path`: local environment servers only; on Kubernetes the server runs
  in the connector's image, which must import the connector itself.
- `kueue` with `inference_pools`: the job's Kueue Workload has one podSet per workload, named by its component, and
  the inference pools' Deployments share one; such a job is refused rather than admitted without its judge's GPUs.
  (Inference pools themselves run: `kubernetes_inference_pools`, which also refuses what the chart cannot give them.)
"""

from __future__ import annotations

from miles.common.jobspec.job import JobSpec


def kubernetes_problem(spec: JobSpec) -> tuple[str, str] | None:
    """(field, why) of the first part of `spec` the Kubernetes backend cannot run; None when it can run all of it."""
    if spec.weight_sync.transport == "disk":
        return "weight_sync.transport", (
            "weight_sync.transport 'disk' needs a volume that the trainer and the engines share, which the chart "
            "does not mount; use 'stream' (the default) or 'nccl' on Kubernetes"
        )
    environment = spec.rollout.environment
    for field in ("interpreter", "python_path"):
        if environment is not None and getattr(environment, field, None):
            return f"rollout.environment.{field}", (
                f"rollout.environment.{field} applies to local environment servers only; on Kubernetes the "
                "server runs in the connector's image (the chart's jobTemplates.envServer.images), which must "
                "import the connector itself"
            )
    if spec.inference_pools and spec.kueue is not None:
        return "inference_pools", (
            "a job with inference pools (judge, teacher) cannot be admitted by Kueue yet (its Workload has no podSet "
            "per pool); submit it without kueue"
        )
    return None
