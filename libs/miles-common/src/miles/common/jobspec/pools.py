"""Inference pools a job declares beside its policy engines: a judge, a teacher, a reward model.

Each pool serves its own model with engines of its own (a router pool `<job_id>--<name>`,
`inference_pool_router_name`) and never receives weight updates. The job's code reaches it by name: a reward
function opens an OpenAI-API session on it (`miles.rollout.pools`: LLM-as-judge), and on-policy distillation scores
the student's tokens with the pool named by `train.distillation.teacher_pool`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

POOL_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?$"
"""A pool name is a short DNS label (it becomes part of object names and router pool names)."""


def inference_pool_router_name(job_id: str, pool_name: str) -> str:
    """The router pool (and session-server job config) of the job's inference pool `pool_name`."""
    return f"{job_id}--{pool_name}"


class InferencePoolSpec(BaseModel):
    """One extra inference pool of a job (engines + router pool of their own model, no weight updates)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    name: str = Field(pattern=POOL_NAME_PATTERN)
    """How the job's code names the pool (`judge`, `teacher` ...); unique within the job."""

    model_path: str = Field(min_length=1)
    """Hugging Face checkpoint the pool serves (as `model.path`: a local path, or a path under the chart's mount)."""

    model_family: str = Field(default="qwen3", min_length=1)
    """TITO model family of the pool's model (its chat template's rules at the session server)."""

    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments of the pool model's chat template (e.g. `{"enable_thinking": false}`)."""

    replicas: int = Field(default=1, ge=1, le=64)
    """Engines of the pool (fixed for the job's life)."""

    kind: Literal["cpu", "sglang"] = "cpu"
    """`cpu`: the miles CPU engine; `sglang`: SGLang pods (Kubernetes backend)."""

    gpus_per_replica: int = Field(default=0, ge=0, le=8)
    """`nvidia.com/gpu` per engine pod (0 for the CPU engine)."""

    tp_size: int = Field(default=1, ge=1, le=8)
    """Tensor-parallel size of one SGLang engine."""

    node_pool: str = Field(default="rollout", pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
    """Node pool the pool's engine pods are scheduled on (Kubernetes)."""

    extra_args: list[str] = Field(default_factory=list)
    """Arguments appended to each engine's command line."""
