"""NetworkPolicies allow exactly the flows of DESIGN.md §1, RBAC is least privilege, bad values fail clearly,
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
from miles.controller.job_templates import JobTemplateParams, instantiate_job_templates

Renderer = Callable[..., list[dict[str, Any]]]

# (from, to, named port): the designed flows. "*" marks flows that must stay inside one job.
DESIGNED_FLOWS = {
    ("rollout-worker", "session-server", "http"),
    ("controller", "session-server", "http"),
    ("session-server", "rollout-router", "http"),
    ("weight-sync", "rollout-router", "http"),
    ("weight-sync", "rollout-router", "admin"),
    ("controller", "rollout-router", "http"),
    ("controller", "rollout-router", "admin"),
    ("rollout-worker", "buffer", "grpc"),
    ("trainer", "buffer", "grpc"),
    ("controller", "buffer", "grpc"),
    ("rollout-worker", "sandbox-gateway", "grpc"),
    ("controller", "redis", "redis"),
    ("session-server", "redis", "redis"),
    ("buffer", "redis", "redis"),
    ("rollout-worker", "redis", "redis"),
    ("rollout-router", "engine", "http"),
    ("weight-sync", "engine", "http*"),
    ("trainer", "engine", "http*"),
    ("trainer", "weight-sync", "grpc*"),
    ("controller", "weight-sync", "grpc"),
    ("controller", "trainer", "grpc"),
    ("trainer", "trainer", "dist*"),
}
EXAMPLE_JOB = JobTemplateParams("job-a", "/models/tiny", 2, 1, 1, 1, 1, 1)


def component_of(selector: dict[str, Any]) -> str:
    return str(selector.get("matchLabels", {}).get("app.kubernetes.io/component", "?"))


def ingress_flows(policies: list[dict[str, Any]], daemonset_mode: bool) -> set[tuple[str, str, str]]:
    """(from, to, port) for every podSelector-based ingress rule; weight-sync runs in engine pods as a sidecar."""
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
                for port in rule["ports"]:
                    flows.add((source, target, f"{port['port']}{'*' if per_job else ''}"))
    return flows


def to_sidecar_view(flows: set[tuple[str, str, str]]) -> set[tuple[str, str, str]]:
    """The designed flows with weight-sync folded into the engine pods (sidecar mode), minus localhost ones."""
    folded = {
        (source.replace("weight-sync", "engine"), target.replace("weight-sync", "engine"), port)
        for source, target, port in flows
    }
    return {flow for flow in folded if flow != ("engine", "engine", "http*")}


@pytest.mark.parametrize("mode", ["sidecar", "daemonset"])
def test_network_policies_allow_exactly_the_designed_flows(render: Renderer, mode: str) -> None:
    shared = render([], [f"jobTemplates.weightSync.mode={mode}"])
    templates = dict(
        next(o for o in by_kind(shared, "ConfigMap") if o["metadata"]["name"].endswith("job-templates"))["data"]
    )
    per_job = instantiate_job_templates(templates, EXAMPLE_JOB)
    policies = by_kind(shared, "NetworkPolicy") + by_kind(per_job, "NetworkPolicy")
    expected = DESIGNED_FLOWS if mode == "daemonset" else to_sidecar_view(DESIGNED_FLOWS)
    assert ingress_flows(policies, mode == "daemonset") == expected
    (default_deny,) = [p for p in policies if p["metadata"]["name"].endswith("default-deny")]
    assert default_deny["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert [port["port"] for rule in default_deny["spec"]["egress"] for port in rule["ports"]] == [53, 53]


def test_every_designed_flow_has_a_matching_egress_rule(render: Renderer) -> None:
    policies = by_kind(render([], ["jobTemplates.weightSync.mode=daemonset"]), "NetworkPolicy")
    egress = set()
    for policy in policies:
        if policy["spec"]["policyTypes"] != ["Egress"]:
            continue
        source = component_of(policy["spec"]["podSelector"])
        for rule in policy["spec"]["egress"]:
            for peer in rule.get("to", []):
                if "podSelector" in peer:
                    egress |= {(source, component_of(peer["podSelector"]), str(p["port"])) for p in rule["ports"]}
    assert egress == {(source, target, port.rstrip("*")) for source, target, port in DESIGNED_FLOWS}


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
            assert "secrets" not in rule["resources"]
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
    ],
)
def test_values_outside_the_schema_fail_with_the_path(render: Renderer, set_value: str, message: str) -> None:
    with pytest.raises(RuntimeError) as failure:
        render([], [set_value])
    assert message in str(failure.value)


def test_template_guards_fail_with_a_readable_reason(render: Renderer) -> None:
    with pytest.raises(RuntimeError, match=r"redis\.externalUrl is required"):
        render([], ["redis.enabled=false"])
    with pytest.raises(RuntimeError, match="at least 32 characters"):
        render([], ["auth.sessionOperatorToken=short"])


def test_tokens_are_generated_never_defaulted(render: Renderer) -> None:
    first = by_kind(render([]), "Secret")[0]["stringData"]
    second = by_kind(render([]), "Secret")[0]["stringData"]
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
