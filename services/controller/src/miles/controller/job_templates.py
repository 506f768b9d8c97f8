"""Instantiate the chart's per-job templates for one job (the Kubernetes backend's object factory).

The Helm chart renders every per-job object (engine pool, weight-sync, rollout workers, trainer, per-job
NetworkPolicies) with the cluster's values filled in and `${PLACEHOLDERS}` left for the job, and stores them in
the ConfigMap `<release>-job-templates`. This module fills the placeholders of one job and parses the objects.
It knows nothing of Kubernetes clients: the backend creates what it returns. Limits: plain text substitution,
so every placeholder value is validated (job ids are DNS labels, counts are small integers, the model path is a
single line without quotes) before it reaches the YAML.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

from miles.common.errors import InvalidArgumentError

_PLACEHOLDER_RE = re.compile(r"\$\{([A-Z_]+)\}")
_JOB_ID_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?$")
_MODEL_PATH_RE = re.compile(r"^[A-Za-z0-9_./:@+=-]{1,512}$")


@dataclass(frozen=True)
class JobTemplateParams:
    """The per-job values of the templates. Counts are per job; GPUs are per pod."""

    job_id: str
    model_path: str
    engine_replicas: int
    engine_gpus: int
    tp_size: int
    rollout_worker_replicas: int
    trainer_replicas: int
    trainer_gpus: int

    def placeholders(self) -> dict[str, str]:
        if not _JOB_ID_RE.match(self.job_id):
            raise InvalidArgumentError(
                f"job id {self.job_id!r} must be a DNS label of at most 20 characters (a-z, 0-9, '-')",
                field="job_id",
            )
        if not _MODEL_PATH_RE.match(self.model_path):
            raise InvalidArgumentError(
                f"model path {self.model_path!r} may only contain letters, digits and _./:@+=-", field="model_path"
            )
        counts = {
            "ENGINE_REPLICAS": (self.engine_replicas, 0),
            "ENGINE_GPUS": (self.engine_gpus, 0),
            "TP_SIZE": (self.tp_size, 1),
            "ROLLOUT_WORKER_REPLICAS": (self.rollout_worker_replicas, 0),
            "TRAINER_REPLICAS": (self.trainer_replicas, 0),
            "TRAINER_GPUS": (self.trainer_gpus, 0),
        }
        for name, (value, minimum) in counts.items():
            if not minimum <= value <= 4096:
                raise InvalidArgumentError(
                    f"{name.lower()} must be in [{minimum}, 4096], got {value}", field=name.lower()
                )
        return {
            "JOB_ID": self.job_id,
            "MODEL_PATH": self.model_path,
            **{name: str(value) for name, (value, _) in counts.items()},
        }


def instantiate_job_templates(templates: dict[str, str], params: JobTemplateParams) -> list[dict[str, Any]]:
    """Every object of every template (keys sorted, `---`-separated documents), placeholders filled.

    Raises InvalidArgumentError when a template uses a placeholder this version does not know, so that a chart
    newer than the controller fails loudly instead of creating objects with `${...}` in them.
    """
    values = params.placeholders()
    objects: list[dict[str, Any]] = []
    for name in sorted(templates):

        def substitute(match: re.Match[str], template_name: str = name) -> str:
            key = match.group(1)
            if key not in values:
                raise InvalidArgumentError(f"template {template_name} uses unknown placeholder ${{{key}}}")
            return values[key]

        text = _PLACEHOLDER_RE.sub(substitute, templates[name])
        objects += [document for document in yaml.safe_load_all(text) if document]
    return objects
