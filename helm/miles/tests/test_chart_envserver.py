"""The per-job environment server (templates/job/_envserver.tpl), for a job with rollout.environment: its image is
the connector's, it is probed on /healthz with room for a slow setup, and the NetworkPolicies (shared and per job)
let only the job's own rollout workers in and let it out only to the session server, the sandbox gateway and DNS."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from miles.common.testing.helm import by_kind
from miles.controller.job_templates import JobTemplateParams

pytestmark = pytest.mark.integration  # runs helm

Renderer = Callable[..., list[dict[str, Any]]]
Objects = Callable[..., list[dict[str, Any]]]
COMPONENT = "app.kubernetes.io/component"


def workload(objects: list[dict[str, Any]], component: str) -> dict[str, Any]:
    (found,) = [
        o
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet") and o["metadata"]["labels"][COMPONENT] == component
    ]
    return found


def pod_labels(objects: list[dict[str, Any]], component: str) -> dict[str, str]:
    return dict(workload(objects, component)["spec"]["template"]["metadata"]["labels"])


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert "matchExpressions" not in selector
    return all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items())


def test_the_server_runs_the_connectors_image_probed_on_healthz(job_objects: Objects) -> None:
    server = workload(job_objects("ci"), "env-server")
    pod = server["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "registry.example.com/miles/miles-envserver-reasoning-gym:0.1.0"
    assert container["command"] == ["python", "-m", "miles.envserver"]
    args = container["args"]
    assert args[args.index("--host") + 1] == "0.0.0.0" and args[args.index("--port") + 1] == "8090"
    assert {"name": "http", "containerPort": 8090, "protocol": "TCP"} in container["ports"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, probe
    startup, liveness = container["startupProbe"], container["livenessProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 600  # rollout.environment.startup_timeout_s
    assert server["spec"]["progressDeadlineSeconds"] > 600  # a slow setup is not a stuck rollout (the job fails)
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60  # a busy server is not a hung one
    # The root filesystem is read-only: HOME (caches) is the size-limited /tmp.
    assert {"name": "HOME", "value": "/tmp"} in container["env"]
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "10Gi"}} in pod["volumes"]
    assert "annotations" not in server["metadata"]  # the chart's image map stays in the template
    (service,) = [
        o for o in by_kind(job_objects("ci"), "Service") if o["metadata"]["labels"][COMPONENT] == "env-server"
    ]
    assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(job_objects("ci"), "env-server"))
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8090, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}
    ]


def test_images_resources_and_placement_come_from_the_values(job_objects: Objects) -> None:
    values = [
        "jobTemplates.envServer.images.reasoning_gym.repository=my-team/rg",
        "jobTemplates.envServer.images.reasoning_gym.tag=v7",
        "jobTemplates.envServer.nodePool=rollout",
        "jobTemplates.envServer.resources.limits.memory=32Gi",
        "jobTemplates.envServer.extraEnv[0].name=HF_HUB_CACHE",
        "jobTemplates.envServer.extraEnv[0].value=/data/hf",
    ]
    pod = workload(job_objects("default", values), "env-server")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/miles-rl/my-team/rg:v7"
    assert container["resources"]["limits"]["memory"] == "32Gi"
    assert {"name": "HF_HUB_CACHE", "value": "/data/hf"} in container["env"]
    assert pod["nodeSelector"] == {"miles.dev/pool": "rollout"}


def test_only_the_jobs_own_workers_reach_the_server(
    render: Renderer, job_objects: Objects, example_job: JobTemplateParams
) -> None:
    objects = job_objects("default")
    other_job = job_objects("default", params=dataclasses.replace(example_job, job_id="other-1"))
    policies = by_kind(render([]), "NetworkPolicy") + by_kind(objects, "NetworkPolicy")
    server, workers = pod_labels(objects, "env-server"), pod_labels(objects, "rollout-worker")
    admitting = [
        p for p in policies if "Ingress" in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], server)
    ]
    assert {p["metadata"]["name"] for p in admitting} == {
        "miles-default-deny",
        "miles-env-server-ingress",  # shared: no platform-wide flow (and no /metrics to scrape)
        "miles-gsm8k-7-env-server-ingress",
    }
    (rule,) = [rule for p in admitting for rule in p["spec"].get("ingress", [])]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    (peer,) = [entry["podSelector"] for entry in rule["from"]]
    assert selects(peer, workers) and peer["matchLabels"]["miles.dev/job"] == "gsm8k-7"
    assert not selects(peer, pod_labels(other_job, "rollout-worker"))
    # The workers may open connections to it (their egress), on the port the server names http.
    worker_egress = [
        rule
        for p in policies
        if p["spec"]["policyTypes"] == ["Egress"] and selects(p["spec"]["podSelector"], workers)
        for rule in p["spec"]["egress"]
        if any("podSelector" in to and selects(to["podSelector"], server) for to in rule.get("to", []))
    ]
    assert [rule["ports"] for rule in worker_egress] == [[{"port": "http", "protocol": "TCP"}]]


def test_the_server_reaches_only_the_session_server_the_sandbox_gateway_and_dns(
    render: Renderer, job_objects: Objects
) -> None:
    shared = render([])
    server = pod_labels(job_objects("default"), "env-server")
    egress = [
        rule
        for p in by_kind(shared, "NetworkPolicy")
        if "Egress" in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], server)
        for rule in p["spec"]["egress"]
    ]
    reached = set()
    for rule in egress:
        ports = tuple(sorted(str(port["port"]) for port in rule["ports"]))
        for peer in rule["to"]:
            if "namespaceSelector" in peer:
                assert peer["podSelector"]["matchLabels"] == {"k8s-app": "kube-dns"}
                reached.add(("kube-dns", ports))
                continue
            targets = ("session-server", "sandbox-gateway")
            (target,) = [c for c in targets if selects(peer["podSelector"], pod_labels(shared, c))]
            reached.add((target, ports))
    assert reached == {
        ("kube-dns", ("53", "53")),
        ("session-server", ("http",)),
        ("sandbox-gateway", ("grpc",)),
        ("sandbox-gateway", ("metrics",)),
    }
    # ...and those admit it (the shared ingress policies of the session server and the sandbox gateway).
    for target in ("session-server", "sandbox-gateway"):
        (policy,) = [p for p in by_kind(shared, "NetworkPolicy") if p["metadata"]["name"] == f"miles-{target}-ingress"]
        peers = [
            peer["podSelector"] for rule in policy["spec"]["ingress"] for peer in rule["from"] if "podSelector" in peer
        ]
        assert any(selects(peer, server) for peer in peers), target


def test_extra_egress_opens_more_for_the_env_servers_only(render: Renderer) -> None:
    policies = {
        p["metadata"]["name"]: p
        for p in by_kind(render([], ["networkPolicy.extraEgress.env-server[0].ports[0].port=443"]), "NetworkPolicy")
    }
    assert {"ports": [{"port": 443}]} in policies["miles-env-server-egress"]["spec"]["egress"]
    assert {"ports": [{"port": 443}]} not in policies["miles-rollout-worker-egress"]["spec"]["egress"]


def test_templates_skip_the_policy_without_network_policies_and_the_pod_monitor_skips_the_server(
    templates_of: Callable[..., dict[str, str]], render: Renderer
) -> None:
    assert {"env-server-deployment.yaml", "env-server-service.yaml", "env-server-networkpolicy.yaml"} <= set(
        templates_of("default")
    )
    without = templates_of("default", ["networkPolicy.enabled=false"])
    assert "env-server-networkpolicy.yaml" not in without and "env-server-deployment.yaml" in without
    (monitor,) = by_kind(render([], ["monitoring.podMonitor.enabled=true"]), "PodMonitor")
    drop = {"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"], "regex": "env-server",
            "action": "drop"}  # fmt: skip
    assert all(drop in endpoint["relabelings"] for endpoint in monitor["spec"]["podMetricsEndpoints"])


@pytest.mark.parametrize(
    ("set_value", "message"),
    [
        ("jobTemplates.envServer.port=70000", "/jobTemplates/envServer/port"),
        ("jobTemplates.envServer.nodePool=gpu", "/jobTemplates/envServer/nodePool"),
        ("jobTemplates.envServer.tmpSize=lots", "/jobTemplates/envServer/tmpSize"),
        ("jobTemplates.envServer.images.reasoning_gym.repository=", "/jobTemplates/envServer/images/reasoning_gym"),
        ("jobTemplates.envServer.images.bad-name.repository=x", "bad-name"),
        ("networkPolicy.extraEgress.env-servr[0].ports[0].port=1", "env-servr"),
    ],
)
def test_env_server_values_outside_the_schema_fail_with_the_path(
    render: Renderer, set_value: str, message: str
) -> None:
    with pytest.raises(RuntimeError) as failure:
        render([], [set_value])
    assert message in str(failure.value)
