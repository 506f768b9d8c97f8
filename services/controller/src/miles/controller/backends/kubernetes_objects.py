"""Creating one of a job's objects on Kubernetes, by kind, adopting one that already exists.

`KubernetesJobBackend.start` creates every object the job templates instantiate through `create_or_read`: an
object that already exists (409: the job was started before a controller restart) is read back instead, so `start`
is idempotent. Built-in kinds go through the official client's typed APIs (CREATE_METHODS); the engine
LeaderWorkerSet, a custom resource, through `kubernetes_lws.create_or_read`.

Limits: a kind outside CREATE_METHODS and the LeaderWorkerSet is refused (FailedPreconditionError), so a chart
newer than the controller fails loudly; an adopted object is kept as it is stored, not updated to the templates.
"""

from __future__ import annotations

from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from miles.common.errors import FailedPreconditionError, UnavailableError
from miles.controller.backends import kubernetes_lws

CREATE_METHODS: dict[str, tuple[str, str]] = {
    "ConfigMap": ("CoreV1Api", "create_namespaced_config_map"),
    "Secret": ("CoreV1Api", "create_namespaced_secret"),
    "Service": ("CoreV1Api", "create_namespaced_service"),
    "ServiceAccount": ("CoreV1Api", "create_namespaced_service_account"),
    "Deployment": ("AppsV1Api", "create_namespaced_deployment"),
    "StatefulSet": ("AppsV1Api", "create_namespaced_stateful_set"),
    "DaemonSet": ("AppsV1Api", "create_namespaced_daemon_set"),
    "HorizontalPodAutoscaler": ("AutoscalingV2Api", "create_namespaced_horizontal_pod_autoscaler"),
    "NetworkPolicy": ("NetworkingV1Api", "create_namespaced_network_policy"),
    "PodDisruptionBudget": ("PolicyV1Api", "create_namespaced_pod_disruption_budget"),
}
"""Kind -> (the official client's API class, its create method); the read method is the same name with `read_`."""


def create_or_read(api_client: k8s.ApiClient, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
    """Create `obj`; when it already exists (an adopted job), read it back. Blocking: run it in a worker thread.
    Returns the object as stored; raises UnavailableError (retryable statuses) / FailedPreconditionError."""
    kind = obj["kind"]
    if kind == kubernetes_lws.LWS_KIND:  # a custom resource: CustomObjectsApi
        return kubernetes_lws.create_or_read(api_client, namespace, obj)
    if kind not in CREATE_METHODS:
        raise FailedPreconditionError(f"the job templates contain a {kind}, which this controller cannot create")
    api_name, method_name = CREATE_METHODS[kind]
    api = getattr(k8s, api_name)(api_client)
    try:
        created = getattr(api, method_name)(namespace, obj)
    except ApiException as exc:
        if exc.status != 409:
            message = f"creating {kind} {obj['metadata']['name']} failed: {exc.status} {exc.reason}: {exc.body}"
            retryable = exc.status is None or exc.status >= 500 or exc.status == 429
            raise (UnavailableError if retryable else FailedPreconditionError)(message) from None
        created = getattr(api, method_name.replace("create_", "read_"))(obj["metadata"]["name"], namespace)
    stored: dict[str, Any] = api_client.sanitize_for_serialization(created)  # type: ignore[no-untyped-call]
    return stored
