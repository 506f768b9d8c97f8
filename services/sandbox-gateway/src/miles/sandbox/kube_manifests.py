"""The Kubernetes objects of one sandbox, as plain dicts: a Pod and the NetworkPolicy that fences it.

Pod: non-root uid/gid, no privilege escalation, read-only root filesystem, every capability dropped, seccomp
RuntimeDefault, no service-account token, no service links, runtimeClassName when set (e.g. gVisor), CPU and
memory limits (= requests, so the pod is Guaranteed QoS), an emptyDir work dir and an in-memory /tmp, both
size-limited, and activeDeadlineSeconds so that Kubernetes kills it even if the gateway is gone. Its
command only sleeps: every exec comes through the API.
NetworkPolicy: selects exactly this pod, denies all ingress, and all egress except the allowlist (CIDRs,
optionally with a port, TCP and UDP). With network NONE that is no egress at all, DNS included.

Execs run as `prlimit (rlimits) -- timeout -s KILL <timeout_s> env -i --chdir=<cwd> <env> <argv>`, so the
image must provide util-linux prlimit and coreutils timeout/env (Debian-based images do).
"""

from __future__ import annotations

import ipaddress
import math
from typing import Any

from miles.sandbox.models import ExecSpec, NetworkMode, SandboxSpec
from miles.sandbox.settings import KubernetesSettings

MANAGED_BY = "miles-sandbox-gateway"
LABEL_SANDBOX_ID = "miles.io/sandbox-id"
ANNOTATION_TEMPLATE = "miles.io/template"
CONTAINER_NAME = "sandbox"


def pod_name(sandbox_id: str) -> str:
    return f"miles-sbx-{sandbox_id}"


def _labels(sandbox_id: str) -> dict[str, str]:
    # No job label: warm-pool pods are created before they belong to a job.
    return {
        "app.kubernetes.io/name": "miles-sandbox",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_SANDBOX_ID: sandbox_id,
    }


def build_pod(sandbox_id: str, spec: SandboxSpec, kube: KubernetesSettings) -> dict[str, Any]:
    limits = spec.limits
    resources = {"cpu": f"{max(1, math.ceil(kube.cpu_cores * 1000))}m", "memory": str(limits.memory_bytes)}
    container_security = {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": kube.run_as_user,
        "runAsGroup": kube.run_as_user,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostNetwork": False,
        "hostPID": False,
        "hostIPC": False,
        "terminationGracePeriodSeconds": 0,
        "activeDeadlineSeconds": kube.max_lifetime_s,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": kube.run_as_user,
            "runAsGroup": kube.run_as_user,
            "fsGroup": kube.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": CONTAINER_NAME,
                "image": spec.template.image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["sleep", "infinity"],
                "workingDir": spec.workdir,
                "env": [{"name": name, "value": value} for name, value in spec.template.env.items()],
                "securityContext": container_security,
                "resources": {"limits": dict(resources), "requests": dict(resources)},
                "volumeMounts": [
                    {"name": "workspace", "mountPath": spec.workdir},
                    {"name": "tmp", "mountPath": "/tmp"},
                ],
            }
        ],
        "volumes": [
            {"name": "workspace", "emptyDir": {"sizeLimit": str(spec.template.workspace_bytes)}},
            {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": str(spec.template.tmp_bytes)}},
        ],
    }
    if kube.runtime_class_name:
        pod_spec["runtimeClassName"] = kube.runtime_class_name
    if kube.node_selector:
        pod_spec["nodeSelector"] = dict(kube.node_selector)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(sandbox_id),
            "namespace": kube.namespace,
            "labels": _labels(sandbox_id),
            "annotations": {ANNOTATION_TEMPLATE: spec.template_name},
        },
        "spec": pod_spec,
    }


def parse_allowlist_entry(entry: str) -> tuple[str, int | None]:
    """("10.0.0.0/8", None) from "10.0.0.0/8"; ("1.2.3.4/32", 443) from "1.2.3.4/32:443" or "[v6/128]:443"."""
    network, port = entry, ""
    if entry.startswith("["):
        network, _, port = entry[1:].partition("]:")
    elif entry.count(":") == 1:
        network, _, port = entry.partition(":")
    return str(ipaddress.ip_network(network, strict=False)), int(port) if port else None


def build_network_policy(sandbox_id: str, spec: SandboxSpec, kube: KubernetesSettings) -> dict[str, Any]:
    egress: list[dict[str, Any]] = []
    if spec.network.mode is NetworkMode.EGRESS_ALLOWLIST:
        for entry in spec.network.egress_allowlist:
            cidr, port = parse_allowlist_entry(entry)
            rule: dict[str, Any] = {"to": [{"ipBlock": {"cidr": cidr}}]}
            if port is not None:
                rule["ports"] = [{"protocol": "TCP", "port": port}, {"protocol": "UDP", "port": port}]
            egress.append(rule)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": pod_name(sandbox_id), "namespace": kube.namespace, "labels": _labels(sandbox_id)},
        "spec": {
            "podSelector": {"matchLabels": {LABEL_SANDBOX_ID: sandbox_id}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": egress,
        },
    }


def exec_command(spec: ExecSpec, *, address_space_factor: float) -> list[str]:
    """The argv sent to the pod's exec endpoint for one exec (rlimits, timeout, clean env, cwd)."""
    limits = spec.limits
    cpu_s = max(1, math.ceil(limits.cpu_s))
    return [
        "prlimit",
        f"--cpu={cpu_s}:{cpu_s + 1}",
        f"--as={int(limits.memory_bytes * address_space_factor)}",
        f"--nofile={limits.max_open_files}",
        f"--fsize={limits.max_file_bytes}",
        "--core=0",
        "--",
        "timeout",
        "-s",
        "KILL",
        f"{spec.timeout_s:g}",
        "env",
        "-i",
        f"--chdir={spec.cwd}",
        "--",
        *(f"{name}={value}" for name, value in spec.env.items()),
        *spec.argv,
    ]
