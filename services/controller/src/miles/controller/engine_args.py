"""Per-job engine flags on the engine workload instantiated from the chart's job templates.

Per-job engine flags are not placeholders (`miles.controller.job_templates`): `with_engine_args(objects, args)`
appends them to the `args` of the container named `engine` (ENGINE_CONTAINER) in the engine Deployment or
LeaderWorkerSet (component label `engine`), after the chart's `jobTemplates.engine.<kind>.extraArgs`; a flag those
already name (the flag, `flag=value`, or `--no-flag`: `names_flag`) is not added again, so the chart wins. Both
engine kinds take flags there (SGLang's `sglang.launch_server` and miles-engine's entrypoint). The Kubernetes
backend adds `--enable-return-routed-experts` this way for a job that records MoE routing
(`routing_replay.engines_record_routing`).

Limits: only the container named `job_templates.ENGINE_CONTAINER` is changed; a chart without one is refused
(InvalidArgumentError) rather than started without the flags.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from miles.common.errors import InvalidArgumentError
from miles.controller.job_templates import ENGINE_CONTAINER, pod_specs_of

_COMPONENT_LABEL = "app.kubernetes.io/component"


def with_engine_args(objects: list[dict[str, Any]], args: list[str]) -> list[dict[str, Any]]:
    """`objects` with `args` appended to the engine container's args (in every pod template of the engine
    Deployment or LeaderWorkerSet), each unless those already name it (see the module docstring). Returns new dicts
    for what changes; the input is not changed. Raises InvalidArgumentError when the objects have no engine workload
    with an `engine` container (a chart this controller does not know)."""
    result = list(objects)
    for position, obj in enumerate(objects):
        if obj["metadata"].get("labels", {}).get(_COMPONENT_LABEL) != "engine":
            continue
        workload = copy.deepcopy(obj)
        engines = [
            container
            for pod_spec in pod_specs_of(workload)
            for container in pod_spec["containers"]
            if container.get("name") == ENGINE_CONTAINER
        ]
        for container in engines:
            present = list(container.get("args", []))
            container["args"] = present + [arg for arg in args if not names_flag(present, arg)]
        if engines:
            result[position] = workload
            return result
    raise InvalidArgumentError(
        f"the job templates have no engine Deployment with a container named {ENGINE_CONTAINER!r} to add {args} to: "
        "the chart and this controller do not match"
    )


def names_flag(args: Sequence[str], flag: str) -> bool:
    """Whether the command-line `args` already decide `flag` (`--x`, `--x=value` or `--no-x`): they then win over
    a flag the controller would add."""
    negated = "--no-" + flag.removeprefix("--")
    return any(arg in (flag, negated) or arg.startswith(flag + "=") for arg in args)
