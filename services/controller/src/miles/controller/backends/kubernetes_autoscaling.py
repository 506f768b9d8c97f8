"""What the Kubernetes backend fits on a job's HorizontalPodAutoscalers before it creates them.

The chart's per-job HPAs (the rollout workers' on CPU, the engines' on the router's saturation ratio:
`jobTemplates.<pool>.autoscaling`) take the job's replicas as their minimum and the chart's (or the job's) maximum.
Here: a maximum below the job's replicas is raised to them (an HPA with maxReplicas < minReplicas is refused by the
API), and the engine HPA of a job whose engine replica spans nodes is pointed at the engine LeaderWorkerSet, which
replaces the engine Deployment (`kubernetes_lws`) and scales by groups through its scale subresource.

`KubernetesJobBackend.resize` moves an HPA's minimum to the new replicas and raises its maximum the same way, so
PATCH /v1/jobs/{id} sets the floor the autoscaler works above.

Limits: with Kueue the Workload counts the replicas admitted; engines an HPA adds beyond them are outside the
queue's quota (docs/operations.md).
"""

from __future__ import annotations

import copy
from typing import Any

from miles.controller.backends import kubernetes_lws

HPA_KIND = "HorizontalPodAutoscaler"
_COMPONENT_LABEL = "app.kubernetes.io/component"


def _component(obj: dict[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("labels", {}).get(_COMPONENT_LABEL, ""))


def fitted_autoscalers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`objects` with every HPA's maxReplicas at least its minReplicas, and the engine HPA aimed at the engine
    LeaderWorkerSet when the objects have one. Returns new dicts for what changes; the input is not changed."""
    engine_lws = next(
        (obj for obj in objects if obj["kind"] == kubernetes_lws.LWS_KIND and _component(obj) == "engine"), None
    )
    fitted = []
    for obj in objects:
        if obj["kind"] != HPA_KIND:
            fitted.append(obj)
            continue
        hpa = copy.deepcopy(obj)
        spec = hpa["spec"]
        spec["maxReplicas"] = max(int(spec["maxReplicas"]), int(spec.get("minReplicas", 1)))
        if engine_lws is not None and _component(hpa) == "engine":
            spec["scaleTargetRef"] = {
                "apiVersion": f"{kubernetes_lws.LWS_GROUP}/{kubernetes_lws.LWS_VERSION}",
                "kind": kubernetes_lws.LWS_KIND,
                "name": engine_lws["metadata"]["name"],
            }
        fitted.append(hpa)
    return fitted
