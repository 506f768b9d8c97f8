"""NetworkPolicies allow exactly the flows of docs/architecture.md §1, RBAC is least privilege, bad values fail clearly,
and values mirror each service's settings class."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from miles.common.testing.helm import by_kind, render_chart

pytestmark = pytest.mark.integration  # runs helm

Renderer = Callable[..., list[dict[str, Any]]]
Objects = Callable[..., list[dict[str, Any]]]

# (from, to, named port): the designed flows (docs/architecture.md §1, weight-sync topology of
# services/weight-sync/README.md).
# "*" marks flows that must stay inside one job; "any" = every port (torch.distributed's ephemeral ports).
DESIGNED_FLOWS = {
    ("rollout-worker", "session-server", "http"),
    ("controller", "session-server", "http"),
    ("session-server", "rollout-router", "http"),
    ("weight-sync", "rollout-router", "http"),
    ("weight-sync-origin", "rollout-router", "http"),
    ("controller", "rollout-router", "http"),
    ("controller", "rollout-router", "admin"),
    ("rollout-worker", "rollout-router", "http"),  # train.mode sync: the barrier reads the engines' version
    ("rollout-worker", "buffer", "grpc"),
    ("trainer", "buffer", "grpc"),
    ("controller", "buffer", "grpc"),
    ("rollout-worker", "sandbox-gateway", "grpc"),
    ("rollout-worker", "sandbox-gateway", "metrics"),
    ("controller", "redis", "redis"),
    ("session-server", "redis", "redis"),
    ("buffer", "redis", "redis"),
    ("rollout-worker", "redis", "redis"),
    ("rollout-router", "engine", "http"),
    ("rollout-router", "inference-engine", "http"),  # a job's judge / teacher pools
    ("weight-sync", "engine", "http*"),
    ("trainer", "engine", "http*"),
    # every port but the ranks' rendezvous store (masterPort, 29500): NCCL's update groups use ephemeral ports.
    ("engine", "trainer", "1-29499*"),
    ("engine", "trainer", "29501-65535*"),
    ("trainer", "weight-sync-origin", "grpc*"),
    ("trainer", "weight-sync-origin", "data*"),
    ("weight-sync", "weight-sync-origin", "grpc*"),
    ("weight-sync", "weight-sync-origin", "data*"),
    ("weight-sync-origin", "weight-sync", "grpc*"),
    ("controller", "weight-sync-origin", "grpc"),
    ("controller", "trainer", "grpc"),
    ("trainer", "trainer", "any*"),
    # A job's environment server (jobs with rollout.environment): its workers call it; it calls the model through
    # the session server and runs commands in sandboxes.
    ("rollout-worker", "env-server", "http*"),
    ("env-server", "session-server", "http"),
    ("env-server", "sandbox-gateway", "grpc"),
    ("env-server", "sandbox-gateway", "metrics"),
}


def port_name(port: dict[str, Any]) -> str:
    """A NetworkPolicyPort as a flow's port: its name or number, or "<port>-<endPort>" for a range."""
    return f"{port['port']}-{port['endPort']}" if "endPort" in port else str(port["port"])


def component_of(selector: dict[str, Any]) -> str:
    return str(selector.get("matchLabels", {}).get("app.kubernetes.io/component", "?"))


def ingress_flows(policies: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(from, to, port) for every podSelector-based ingress rule ("*": a per-job rule naming the same job)."""
    flows = set()
    for policy in policies:
        if "Ingress" not in policy["spec"]["policyTypes"]:
            continue
        target = component_of(policy["spec"]["podSelector"])
        per_job = "miles.dev/job" in policy["spec"]["podSelector"].get("matchLabels", {})
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if "podSelector" not in peer:
                    continue
                source = component_of(peer["podSelector"])
                same_job = "miles.dev/job" in peer["podSelector"].get("matchLabels", {})
                assert same_job == per_job, f"{policy['metadata']['name']}: a per-job rule must name the same job"
                ports = [port_name(port) for port in rule.get("ports", [])] or ["any"]
                flows |= {(source, target, f"{port}{'*' if per_job else ''}") for port in ports}
    return flows


def to_sidecar_view(flows: set[tuple[str, str, str]]) -> set[tuple[str, str, str]]:
    """The designed flows with the weight-sync daemons folded into the engine pods (sidecar mode)."""

    def pod(component: str) -> str:
        return "engine" if component == "weight-sync" else component

    return {(pod(source), pod(target), port) for source, target, port in flows}


@pytest.mark.parametrize("mode", ["sidecar", "daemonset"])
def test_network_policies_allow_exactly_the_designed_flows(render: Renderer, job_objects: Objects, mode: str) -> None:
    values = [f"jobTemplates.weightSync.mode={mode}", "networkPolicy.nodeCidrs[0]=10.0.0.0/16"]
    policies = by_kind(render([], values), "NetworkPolicy") + by_kind(job_objects("default", values), "NetworkPolicy")
    expected = DESIGNED_FLOWS if mode == "daemonset" else to_sidecar_view(DESIGNED_FLOWS)
    assert ingress_flows(policies) == expected
    (default_deny,) = [p for p in policies if p["metadata"]["name"].endswith("default-deny")]
    assert default_deny["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert [port["port"] for rule in default_deny["spec"]["egress"] for port in rule["ports"]] == [53, 53]


@pytest.mark.parametrize("mode", ["sidecar", "daemonset"])
def test_origin_declares_its_data_channel_port_and_only_the_daemons_reach_it(
    render: Renderer, job_objects: Objects, mode: str
) -> None:
    """The origin serves the data channel on the fixed data port (env, containerPort, Service port), and the
    NetworkPolicies open it from the job's weight-sync daemons (engine pods in sidecar mode; they fetch full
    weights) and the job's trainer (it publishes) and no one else."""
    values = [f"jobTemplates.weightSync.mode={mode}", "networkPolicy.nodeCidrs[0]=10.0.0.0/16",
              "jobTemplates.weightSync.ports.data=50099"]  # fmt: skip
    objects = job_objects("default", values)
    (origin,) = [o for o in by_kind(objects, "Deployment") if o["metadata"]["name"].endswith("-weight-sync-origin")]
    (container,) = origin["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MILES_WEIGHTSYNC_DATA_PORT"] == "50099"
    assert {"name": "data", "containerPort": 50099, "protocol": "TCP"} in container["ports"]
    (service,) = [o for o in by_kind(objects, "Service") if o["metadata"]["name"].endswith("-weight-sync-origin")]
    assert {"name": "data", "port": 50099, "targetPort": "data", "protocol": "TCP"} in service["spec"]["ports"]
    # Only the origin serves the data channel: the daemons next to the engines declare no data port.
    daemons = [c for w in objects if w["kind"] in ("Deployment", "DaemonSet")
               for c in w["spec"]["template"]["spec"]["containers"] if c["name"] == "weight-sync"]  # fmt: skip
    assert daemons and all("MILES_WEIGHTSYNC_DATA_PORT" not in {e["name"] for e in c["env"]} for c in daemons)
    assert all("data" not in {p["name"] for p in c["ports"]} for c in daemons)
    daemon_pod = "engine" if mode == "sidecar" else "weight-sync"
    policies = by_kind(render([], values), "NetworkPolicy") + by_kind(objects, "NetworkPolicy")
    data_in = {(s, t) for s, t, port in ingress_flows(policies) if port == "data*"}
    assert data_in == {(daemon_pod, "weight-sync-origin"), ("trainer", "weight-sync-origin")}
    data_out = {(s, t) for s, t, port in egress_flows(policies) if port == "data"}
    assert data_out == {(daemon_pod, "weight-sync-origin"), ("trainer", "weight-sync-origin")}


def egress_flows(policies: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(source, target or cidr, port) of every egress rule; an ipBlock peer is named by its CIDR."""
    egress = set()
    for policy in policies:
        if policy["spec"]["policyTypes"] != ["Egress"]:
            continue
        source = component_of(policy["spec"]["podSelector"])
        for rule in policy["spec"]["egress"]:
            ports = [port_name(p) for p in rule.get("ports", [])] or ["any"]
            for peer in rule.get("to", []):
                target = component_of(peer["podSelector"]) if "podSelector" in peer else peer["ipBlock"]["cidr"]
                egress |= {(source, target, port) for port in ports}
    return egress


def test_every_designed_flow_has_a_matching_egress_rule(render: Renderer) -> None:
    sidecar = egress_flows(by_kind(render([]), "NetworkPolicy"))
    api = {
        (c, "0.0.0.0/0", port) for c in ("controller", "rollout-router", "sandbox-gateway") for port in ("443", "6443")
    }
    designed = {(source, target, port.rstrip("*")) for source, target, port in DESIGNED_FLOWS}
    assert sidecar == {(s, t, p) for s, t, p in to_sidecar_view(designed)} | api
    # daemonset mode: engines are on the host network, so flows to them go to the node CIDRs.
    values = ["jobTemplates.weightSync.mode=daemonset", "networkPolicy.nodeCidrs[0]=10.0.0.0/16"]
    daemonset = egress_flows(by_kind(render([], values), "NetworkPolicy"))
    to_nodes = {(s, "10.0.0.0/16" if t == "engine" else t, p) for s, t, p in designed}
    assert daemonset == to_nodes | api


def test_extra_egress_goes_to_the_pods_running_the_component(render: Renderer) -> None:
    values = ["networkPolicy.extraEgress.weight-sync[0].ports[0].port=443"]
    policies = {p["metadata"]["name"]: p for p in by_kind(render([], values), "NetworkPolicy")}
    # sidecar mode: weight-sync runs in the engine pods, so the engine pods' egress gets the rule.
    assert {"ports": [{"port": 443}]} in policies["miles-engine-egress"]["spec"]["egress"]


def test_rbac_is_least_privilege(render: Renderer) -> None:
    roles = {role["metadata"]["name"]: role["rules"] for role in by_kind(render([]), "Role")}
    assert set(roles) == {"miles-controller", "miles-rollout-router", "miles-sandbox-gateway"}
    assert roles["miles-rollout-router"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
    ]
    sandbox_verbs = {
        resource: rule["verbs"] for rule in roles["miles-sandbox-gateway"] for resource in rule["resources"]
    }
    assert sandbox_verbs["pods/exec"] == ["create", "get"]
    assert "update" not in sandbox_verbs["pods"]
    for rules in roles.values():
        for rule in rules:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
            if "secrets" in rule["resources"]:  # the controller's per-job token Secrets: never listed or changed
                assert rule["resources"] == ["secrets"] and rule["verbs"] == ["get", "create", "delete"]
    assert not any(
        "secrets" in rule["resources"] for name, rules in roles.items() if name != "miles-controller" for rule in rules
    )
    bound = {binding["subjects"][0]["name"] for binding in by_kind(render([]), "RoleBinding")}
    assert bound == set(roles)


@pytest.mark.parametrize(
    ("set_value", "message"),
    [
        ("jobTemplates.engine.kind=tpu", "/jobTemplates/engine/kind"),
        ("redis.appendfsync=sometimes", "/redis/appendfsync"),
        ("sessionServer.replicaCount=-1", "/sessionServer/replicaCount"),
        ("buffer.ports.grpc=70000", "/buffer/ports/grpc"),
        ("controller.nodePool=gpu", "/controller/nodePool"),
        ("sessionServer.settings.Bad-Key=1", "invalid propertyName 'Bad-Key'"),
        ("monitoring.prometheusRules.minPrefixHitRate=1.5", "/monitoring/prometheusRules/minPrefixHitRate"),
        ("controllr.enabled=true", "controllr"),
        ("jobTemplates.weightSync.storeUrl=bucket/x", "/jobTemplates/weightSync/storeUrl"),
        ("jobTemplates.weightSync.origin.nodePool=gpu", "/jobTemplates/weightSync/origin/nodePool"),
        ("networkPolicy.extraEgress.trainr[0].ports[0].port=1", "trainr"),
        ("monitoring.podMonitor.interval=often", "/monitoring/podMonitor/interval"),
    ],
)
def test_values_outside_the_schema_fail_with_the_path(render: Renderer, set_value: str, message: str) -> None:
    with pytest.raises(RuntimeError) as failure:
        render([], [set_value])
    assert message in str(failure.value)


def test_template_guards_fail_with_a_readable_reason(render: Renderer) -> None:
    with pytest.raises(RuntimeError, match=r"redis\.externalUrl is required"):
        render([], ["redis.enabled=false", "networkPolicy.enabled=false"])
    with pytest.raises(RuntimeError, match="at least 32 characters"):
        render([], ["auth.sessionOperatorToken=short"])
    with pytest.raises(RuntimeError, match=r"networkPolicy\.nodeCidrs is required"):
        render([], ["jobTemplates.weightSync.mode=daemonset"])


def test_tokens_are_generated_never_defaulted(render: Renderer, chart_dir: Path) -> None:
    # Two uncached renders: each install without tokens gets its own random ones.
    first = by_kind(render_chart(chart_dir), "Secret")[0]["stringData"]
    second = by_kind(render_chart(chart_dir), "Secret")[0]["stringData"]
    assert len(first["controller-api-tokens"]) == 48
    assert first["controller-api-tokens"] != second["controller-api-tokens"]
    given = by_kind(render(["ci-values.yaml"]), "Secret")[0]["stringData"]
    assert given["controller-api-tokens"] == "ci-token-0123456789abcdef0123456789abcdef"


SERVICE_SETTINGS = {
    "controller": "miles.controller.settings:ControllerSettings",
    "sessionServer": "miles.session.settings:SessionSettings",
    "rolloutRouter": "miles.router.settings:RouterSettings",
    "buffer": "miles.buffer.settings:BufferSettings",
    "sandboxGateway": "miles.sandbox.settings:SandboxSettings",
}


@pytest.mark.parametrize("component", sorted(SERVICE_SETTINGS))
def test_values_mirror_the_service_settings_class(chart_dir: Path, component: str) -> None:
    """Every settings key, secret-fed field and the Redis URL the chart sets is a real field of the service."""
    module_name, class_name = SERVICE_SETTINGS[component].split(":")
    settings_class = getattr(importlib.import_module(module_name), class_name)
    fields = set(settings_class.model_fields)
    values = yaml.safe_load((chart_dir / "values.yaml").read_text())[component]
    assert settings_class.model_config["env_prefix"] == f"MILES_{values['envPrefix']}_"
    assert set(values["settings"]) <= fields, f"values keys that {class_name} lacks"
    assert {entry["field"] for entry in values["secretEnv"]} <= fields
    assert set(values.get("links", {})) | set(values.get("fullnameSettings", {})) <= fields
    assert set(values.get("portSettings", {}).values()) <= fields
    if values["usesRedis"]:
        assert "redis_url" in fields
    if "metrics" in values["ports"]:
        assert "metrics_port" in fields


def test_rendering_is_deterministic_for_fixed_values(chart_dir: Path) -> None:
    values = [chart_dir / "ci" / "ci-values.yaml"]
    assert render_chart(chart_dir, values) == render_chart(chart_dir, values)


def test_values_settings_blocks_are_in_sync_with_the_settings_classes(chart_dir: Path) -> None:
    script = chart_dir.parents[1] / "scripts" / "sync_chart_settings.py"
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


# Every settings class a chart container's MILES_<PREFIX>_* environment may target, by prefix.
SETTINGS_BY_PREFIX = {
    "CONTROLLER": "miles.controller.settings:ControllerSettings",
    "SESSION": "miles.session.settings:SessionSettings",
    "ROUTER": "miles.router.settings:RouterSettings",
    "BUFFER": "miles.buffer.settings:BufferSettings",
    "SANDBOX": "miles.sandbox.settings:SandboxSettings",
    "ENGINE": "miles.engine.settings:EngineSettings",
    "ROLLOUT": "miles.rollout.settings:RolloutSettings",
    "TRAINER": "miles.trainer.settings:TrainerSettings",
    "WEIGHTSYNC": "miles.weightsync.settings:WeightsyncSettings",
}


def _settings_class(prefix: str) -> Any:
    module_name, class_name = SETTINGS_BY_PREFIX[prefix].split(":")
    return getattr(importlib.import_module(module_name), class_name)


@pytest.mark.parametrize("value_set", ["default", "ci", "gpu"])
def test_every_miles_env_var_of_every_container_is_a_settings_field(all_objects: Objects, value_set: str) -> None:
    """Shared and per-job containers: each MILES_<PREFIX>_<FIELD> names a field of that service's settings class
    (or its CONFIG_FILE), so no setting is silently ignored; the JSON-valued ones parse as JSON."""
    checked = set()
    for workload in all_objects(value_set):
        if workload["kind"] not in ("Deployment", "StatefulSet", "DaemonSet"):
            continue
        for container in workload["spec"]["template"]["spec"]["containers"]:
            for env in container.get("env", []):
                if not env["name"].startswith("MILES_"):
                    continue
                prefix = next((p for p in SETTINGS_BY_PREFIX if env["name"].startswith(f"MILES_{p}_")), None)
                where = f"{workload['metadata']['name']}/{container['name']}: {env['name']}"
                assert prefix is not None, f"{where} has no known settings prefix"
                settings_class = _settings_class(prefix)
                assert settings_class.model_config["env_prefix"] == f"MILES_{prefix}_"
                field = env["name"].removeprefix(f"MILES_{prefix}_").lower()
                assert field == "config_file" or _is_field_path(settings_class, field.split("__")), where
                checked.add((prefix, field))
    assert {prefix for prefix, _ in checked} >= set(SETTINGS_BY_PREFIX) - ({"ENGINE"} if value_set != "ci" else set())


def _is_field_path(model: Any, path: list[str]) -> bool:
    """Whether `path` (an env name split at "__", pydantic-settings' nested delimiter) names a field."""
    info = model.model_fields.get(path[0])
    if info is None:
        return False
    if len(path) == 1:
        return True
    nested = info.annotation
    return hasattr(nested, "model_fields") and _is_field_path(nested, path[1:])


def test_controller_may_create_exactly_the_kinds_of_the_per_job_objects(render: Renderer, job_objects: Objects) -> None:
    """The controller's Role covers the per-job objects it instantiates (incl. the spec ConfigMap) and nothing
    more; besides, it only reads pods (job health)."""
    plural = {"Deployment": "deployments", "StatefulSet": "statefulsets", "DaemonSet": "daemonsets",
              "Service": "services", "ConfigMap": "configmaps", "HorizontalPodAutoscaler": "horizontalpodautoscalers",
              "NetworkPolicy": "networkpolicies", "Secret": "secrets",
              "PodDisruptionBudget": "poddisruptionbudgets"}  # fmt: skip
    values = ["jobTemplates.weightSync.mode=daemonset", "networkPolicy.nodeCidrs[0]=10.0.0.0/16",
              "jobTemplates.rolloutWorker.autoscaling.enabled=true"]  # fmt: skip
    # Besides the templates the controller creates the job's spec ConfigMap and its tokens Secret.
    objects = [
        *job_objects("default", values),
        {"apiVersion": "v1", "kind": "ConfigMap"},
        {"apiVersion": "v1", "kind": "Secret"},
    ]
    needed = {(obj["apiVersion"].rpartition("/")[0], plural[obj["kind"]]) for obj in objects}
    (role,) = [r for r in by_kind(render([]), "Role") if r["metadata"]["name"] == "miles-controller"]
    writable = {
        (group, resource)
        for rule in role["rules"]
        if "create" in rule["verbs"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert writable == needed
    read_only = [rule for rule in role["rules"] if "create" not in rule["verbs"]]
    assert read_only == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]


def _policy_allows(policies: list[dict[str, Any]], source: str, target: str, port: str) -> bool:
    """Whether a per-job ingress rule lets `source` pods of the job reach `target` pods on `port` ("any" or a
    numeric range holding it too)."""
    return any(s == source and t == target and _covers(p, port) for s, t, p in ingress_flows(policies))


def _covers(rule_port: str, port: str) -> bool:
    name = rule_port.removesuffix("*")
    if name in (port, "any"):
        return rule_port.endswith("*")
    low, sep, high = name.partition("-")
    return bool(sep) and rule_port.endswith("*") and port.isdigit() and int(low) <= int(port) <= int(high)


@pytest.mark.parametrize("mode", ["sidecar", "daemonset"])
def test_trainer_publishes_to_the_origin_service_and_engines_reach_its_update_groups(
    render: Renderer, job_objects: Objects, mode: str
) -> None:
    """stream: the trainer's publish address is the job's origin Service on its gRPC port, and the per-job
    NetworkPolicy lets exactly the job's trainer (and daemons) in there. nccl: the router and pool the trainer finds
    the engines in are the shared router and the job's pool, its weight-update port is declared, and the job's
    engines may reach the trainer pods."""
    values = [f"jobTemplates.weightSync.mode={mode}", "networkPolicy.nodeCidrs[0]=10.0.0.0/16",
              "jobTemplates.weightSync.ports.grpc=50077", "jobTemplates.trainer.weightUpdatePort=29777"]  # fmt: skip
    objects = job_objects("default", values)
    (trainer,) = by_kind(objects, "StatefulSet")
    (container,) = trainer["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    (origin_service,) = [
        o for o in by_kind(objects, "Service") if o["metadata"]["name"].endswith("-weight-sync-origin")
    ]
    grpc_port = next(p for p in origin_service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc_port["port"] == 50077
    assert env["MILES_TRAINER_PUBLISH__WEIGHTSYNC_ADDRESS"] == f"{origin_service['metadata']['name']}:50077"
    (origin,) = [o for o in by_kind(objects, "Deployment") if o["metadata"]["name"].endswith("-weight-sync-origin")]
    origin_env = {e["name"]: e.get("value") for e in origin["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert origin_env["MILES_WEIGHTSYNC_PORT"] == "50077"
    assert origin_service["spec"]["selector"].items() <= origin["spec"]["template"]["metadata"]["labels"].items()
    policies = by_kind(render([], values), "NetworkPolicy") + by_kind(objects, "NetworkPolicy")
    assert _policy_allows(policies, "trainer", "weight-sync-origin", "grpc")
    assert _policy_allows(policies, "trainer", "weight-sync-origin", "data")
    allowed_in = {s for s, t, p in ingress_flows(policies) if t == "weight-sync-origin" and p == "grpc*"}
    assert allowed_in == {"trainer", "engine" if mode == "sidecar" else "weight-sync"}
    assert ("trainer", "weight-sync-origin", "grpc") in egress_flows(policies)

    router = [
        o for o in render([], values) if o["kind"] == "Service" and o["metadata"]["name"].endswith("-rollout-router")
    ]
    assert env["MILES_TRAINER_PUBLISH__ROUTER_URL"].startswith(f"http://{router[0]['metadata']['name']}")
    assert env["MILES_TRAINER_PUBLISH__POOL"] == "gsm8k-7"
    assert env["MILES_TRAINER_PUBLISH__NCCL_MASTER_PORT"] == "29777"
    assert {"name": "weight-update", "containerPort": 29777, "protocol": "TCP"} in container["ports"]
    assert _policy_allows(policies, "engine", "trainer", "29777")
