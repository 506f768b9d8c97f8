"""The environment server of a job that runs a hub environment (`rollout.environment`), as per-job templates.

The chart renders, besides the other per-job templates (`miles.controller.job_templates`), the templates whose
keys start with `env-server-` (ENV_SERVER_TEMPLATE_PREFIX): a Deployment of `python -m miles.envserver` in the
connector's image, the Service `<fullname>-<job>-env-server` and an ingress NetworkPolicy that admits only the
job's rollout workers. `instantiate_job_templates` fills them only for a job with `JobTemplateParams.environment`
(skipping them otherwise), with these placeholders (ENV_SERVER_PLACEHOLDERS), from `EnvironmentServerParams`:

- `${ENV_CONNECTOR}` (`connector`): a built-in connector name or a dotted module path.
- `${ENV_ARGS_JSON}` (`args_json`): the connector's arguments as one line of JSON, escaped as the inside of a
  double-quoted string (only ASCII and JSON's escapes, which YAML's double-quoted scalars share): templates put it
  in `"..."`, never elsewhere.
- `${ENV_SERVER_REPLICAS}` (`replicas`): environment-server pods (the Service spreads episodes over them, so
  replicas must serve the same rows: environments are deterministic for given args).
- `${ENV_SERVER_STARTUP_FAILURES}` (from `startup_timeout_s`): the startup probe's failureThreshold, in periods of
  ENV_SERVER_STARTUP_PERIOD_S (the template's periodSeconds).
- `${ENV_SERVER_PROGRESS_DEADLINE_S}` (from `startup_timeout_s`): the Deployment's progressDeadlineSeconds, the
  setup's time plus Kubernetes' default 600 s, so that a slow but allowed setup is not reported as a stuck rollout
  (the Kubernetes backend fails a job whose Deployment exceeded its progress deadline).
- `${ENV_SERVER_IMAGE}`: not a parameter but the chart's choice: the image named for the connector in the
  Deployment's `miles.dev/env-server-images` annotation (a JSON object, `jobTemplates.envServer.images`; dropped
  from the created Deployment). A connector without one is refused (`env_server_image_of`).

The job's rollout workers then get `MILES_ROLLOUT_ENVIRONMENT_URL` = `http://<that Service>:<its http port>`
(`wired_to_env_server`; `JobAddresses.environment_url`), so that they call this server instead of starting one.

Limits: the server has no authentication of its own; only the NetworkPolicy keeps other pods out (with
`networkPolicy.enabled` false, anything in the namespace can run episodes on it).
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from miles.common.errors import InvalidArgumentError

ENV_SERVER_TEMPLATE_PREFIX = "env-server-"
"""Keys of the environment-server templates: instantiated only for a job with an environment."""
ENV_SERVER_IMAGES_ANNOTATION = "miles.dev/env-server-images"
ENV_SERVER_COMPONENT = "env-server"
ENV_SERVER_STARTUP_PERIOD_S = 10
"""periodSeconds of the environment server's startup probe in the chart (`ENV_SERVER_STARTUP_FAILURES` counts them)."""
ROLLOUT_WORKER_COMPONENT = "rollout-worker"
ROLLOUT_WORKER_CONTAINER = "rollout-worker"
ENVIRONMENT_URL_ENV = "MILES_ROLLOUT_ENVIRONMENT_URL"
"""The rollout worker's `environment_url` setting: where its environment server is (it then starts none)."""
_COMPONENT_LABEL = "app.kubernetes.io/component"

ENV_SERVER_PLACEHOLDERS = (
    "ENV_CONNECTOR",
    "ENV_ARGS_JSON",
    "ENV_SERVER_REPLICAS",
    "ENV_SERVER_STARTUP_FAILURES",
    "ENV_SERVER_PROGRESS_DEADLINE_S",
    "ENV_SERVER_IMAGE",
)
"""The placeholders of the environment-server templates (filled only for a job with an environment)."""

_CONNECTOR_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_IMAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,511}$")
_MAX_ARGS_JSON_CHARS = 65536
_MAX_STARTUP_TIMEOUT_S = 86400.0
_MAX_REPLICAS = 4096
_DEFAULT_PROGRESS_DEADLINE_S = 600


@dataclass(frozen=True)
class EnvironmentServerParams:
    """The environment server of a job with `rollout.environment` (fields of the same names there)."""

    connector: str
    args_json: str = "{}"
    """The connector's arguments: a JSON object, as text (so that the parameters stay immutable)."""
    replicas: int = 1
    startup_timeout_s: float = 600.0
    """How long the server may take to load the environment before the kubelet restarts it."""

    def placeholders(self) -> dict[str, str]:
        """The environment server's placeholders but ENV_SERVER_IMAGE; raises InvalidArgumentError naming the
        spec field when one is out of range."""
        if len(self.connector) > 200 or not _CONNECTOR_RE.match(self.connector):
            raise InvalidArgumentError(
                f"connector {self.connector!r} must be a name or a dotted module path",
                field="rollout.environment.connector",
            )
        try:
            args = json.loads(self.args_json)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise InvalidArgumentError("the connector's args must be a JSON object", field="rollout.environment.args")
        # ensure_ascii: only ASCII and JSON's escapes, which mean the same inside a YAML double-quoted string.
        escaped = json.dumps(json.dumps(args, separators=(",", ":"), sort_keys=True))[1:-1]
        if len(escaped) > _MAX_ARGS_JSON_CHARS:
            raise InvalidArgumentError(
                f"the connector's args are longer than {_MAX_ARGS_JSON_CHARS} characters as JSON",
                field="rollout.environment.args",
            )
        if not 1 <= self.replicas <= _MAX_REPLICAS:
            raise InvalidArgumentError(
                f"replicas must be in [1, {_MAX_REPLICAS}], got {self.replicas}", field="rollout.environment.replicas"
            )
        if not 0 < self.startup_timeout_s <= _MAX_STARTUP_TIMEOUT_S:
            raise InvalidArgumentError(
                f"startup_timeout_s must be in (0, {_MAX_STARTUP_TIMEOUT_S:.0f}], got {self.startup_timeout_s}",
                field="rollout.environment.startup_timeout_s",
            )
        return {
            "ENV_CONNECTOR": self.connector,
            "ENV_ARGS_JSON": escaped,
            "ENV_SERVER_REPLICAS": str(self.replicas),
            "ENV_SERVER_STARTUP_FAILURES": str(math.ceil(self.startup_timeout_s / ENV_SERVER_STARTUP_PERIOD_S)),
            "ENV_SERVER_PROGRESS_DEADLINE_S": str(math.ceil(self.startup_timeout_s) + _DEFAULT_PROGRESS_DEADLINE_S),
        }


def env_server_image_of(templates: Mapping[str, str], connector: str) -> str:
    """The image the chart runs `connector`'s environment server in (`jobTemplates.envServer.images`). Raises
    InvalidArgumentError (field `rollout.environment.connector`) when the chart has none for it."""
    deployment = yaml.safe_load(templates.get(f"{ENV_SERVER_TEMPLATE_PREFIX}deployment.yaml", "")) or {}
    annotation = deployment.get("metadata", {}).get("annotations", {}).get(ENV_SERVER_IMAGES_ANNOTATION)
    if annotation is None:
        raise InvalidArgumentError(
            "this release's chart has no environment-server templates: upgrade the chart to run rollout.environment",
            field="rollout.environment.connector",
        )
    images: dict[str, str] = json.loads(annotation)
    image = images.get(connector, "")
    if not _IMAGE_RE.match(image):
        raise InvalidArgumentError(
            f"this release has no environment-server image for connector {connector!r} "
            f"(jobTemplates.envServer.images has {sorted(images)})",
            field="rollout.environment.connector",
        )
    return image


def wired_to_env_server(objects: list[dict[str, Any]], url: str) -> list[dict[str, Any]]:
    """`objects` (a job's, with its environment server) with the env-server Deployment's image map dropped and
    ENVIRONMENT_URL_ENV = `url` on every `rollout-worker` container of the rollout-worker Deployment, unless the
    chart sets it (extraEnv). Returns new dicts for what changes; raises InvalidArgumentError when there is no such
    container (a chart this controller does not know)."""
    if not url:
        raise InvalidArgumentError(
            "the job templates have no environment-server Service (env-server-service.yaml): the chart and this "
            "controller do not match"
        )
    wired = []
    num_workers = 0
    for obj in objects:
        component = obj["metadata"].get("labels", {}).get(_COMPONENT_LABEL)
        if obj.get("kind") == "Deployment" and component == ENV_SERVER_COMPONENT:
            obj = copy.deepcopy(obj)
            annotations = obj["metadata"].get("annotations", {})
            annotations.pop(ENV_SERVER_IMAGES_ANNOTATION, None)
            if not annotations:
                obj["metadata"].pop("annotations", None)
        elif obj.get("kind") == "Deployment" and component == ROLLOUT_WORKER_COMPONENT:
            obj = copy.deepcopy(obj)
            for container in obj["spec"]["template"]["spec"]["containers"]:
                if container.get("name") == ROLLOUT_WORKER_CONTAINER:
                    num_workers += 1
                    env = container.setdefault("env", [])
                    if not any(item.get("name") == ENVIRONMENT_URL_ENV for item in env):
                        env.append({"name": ENVIRONMENT_URL_ENV, "value": url})
        wired.append(obj)
    if not num_workers:
        raise InvalidArgumentError(
            f"the job templates have no rollout-worker Deployment with a container named {ROLLOUT_WORKER_CONTAINER!r} "
            "to give the environment server's URL: the chart and this controller do not match"
        )
    return wired
