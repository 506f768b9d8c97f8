"""What the Kubernetes backend cannot run (checked at submission, so the caller gets a 400 naming the field, and
again at start, for a job accepted by another controller version).

- `weight_sync.transport: disk`: needs a volume the trainer and the engines share, which the chart does not mount.
- `rollout.environment.interpreter` / `python_path`: local environment servers only; on Kubernetes the server runs
  in the connector's image, which must import the connector itself.
- `resources.engines.shared_pool` (LoRA jobs on a shared engine pool) and `inference_pools` (judge / teacher pools):
  the local backend runs them; the chart has no templates for them yet (no shared-pool Deployment with an adapter
  volume the trainers also mount, no per-job inference-engine template), so such a job is refused rather than run
  with the wrong engines.
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
    if spec.resources.engines.shared_pool is not None:
        return "resources.engines.shared_pool", (
            "shared engine pools run on the local backend only: the chart has no shared-pool templates yet; give "
            "the LoRA job engines of its own on Kubernetes"
        )
    if spec.inference_pools:
        return "inference_pools", (
            "inference pools (judge, teacher) run on the local backend only: the chart has no inference-engine "
            "template yet"
        )
    return None
