"""Shared LoRA engine pools (sharedPools): per pool an engine Deployment with the controller's LoRA flags and the
adapter volume read-only, a Service the router discovers as the pool exactly as it discovers a job's engines, the
controller's MILES_CONTROLLER_SHARED_POOLS and the adapter volumes in the job templates, NetworkPolicies that
admit the router and any job's trainer to the pool's engines (and the trainers to the router and session server),
and values that fail with a readable reason."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from miles.common.testing.helm import by_kind
from miles.controller.backends.base import LORA_LINEAR_MODULES, SharedPool
from miles.controller.job_templates import SHARED_POOLS_KEY
from miles.controller.settings import ControllerSettings

pytestmark = pytest.mark.integration  # runs helm

Renderer = Callable[..., list[dict[str, Any]]]
COMPONENT = "app.kubernetes.io/component"
POOLS = [
    "sharedPools[0].name=qwen-lora",
    "sharedPools[0].modelPath=/models/qwen3-8b",
    "sharedPools[0].replicas=2",
    "sharedPools[0].gpusPerReplica=2",
    "sharedPools[0].tpSize=2",
    "sharedPools[0].extraArgs[0]=--enable-deterministic-inference",
    "sharedPools[0].adapterVolume=lora-adapters",
    "sharedPools[1].name=small",
    "sharedPools[1].modelPath=/models/tiny",
    "sharedPools[1].maxLoadedLoras=4",
    "sharedPools[1].maxLoraRank=16",
    "sharedPools[1].loraTargetModules={q_proj,v_proj}",
    "sharedPools[1].adapterVolume=small-adapters",
    "sharedPools[1].adapterMountPath=/var/adapters",
]
# The pools as the controller must see them: the chart's defaults are SharedPool's.
EXPECTED = {
    "qwen-lora": SharedPool(name="qwen-lora", model_path="/models/qwen3-8b", replicas=2),
    "small": SharedPool(
        name="small",
        model_path="/models/tiny",
        max_loaded_loras=4,
        max_lora_rank=16,
        lora_target_modules=["q_proj", "v_proj"],
    ),
}


def _named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]
    return found


def _env(workload: dict[str, Any]) -> dict[str, Any]:
    container = workload["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("kind", ["sglang", "cpu"])
def test_each_pool_is_an_engine_deployment_with_the_controllers_lora_flags_and_its_adapter_volume_read_only(
    render: Renderer, validate: Callable[[dict[str, Any]], None], kind: str
) -> None:
    objects = render([], [*POOLS, f"jobTemplates.engine.kind={kind}", "jobTemplates.engine.cpu.extraArgs[0]=--x"])
    for obj in objects:
        validate(obj)
    for name, pool in EXPECTED.items():
        deployment = _named(objects, "Deployment", f"miles-pool-{name}")
        assert deployment["spec"]["replicas"] == pool.replicas
        assert deployment["metadata"]["annotations"]["miles.dev/engine-kind"] == kind
        pod = deployment["spec"]["template"]
        assert pod["metadata"]["labels"][COMPONENT] == "shared-engine"
        assert pod["metadata"]["labels"]["miles.dev/shared-pool"] == name
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        (engine,) = pod["spec"]["containers"]
        args = engine["args"]
        assert args[:2] == ["--model-path", pool.model_path]
        # After the chart's extraArgs, exactly the controller's flags for the pool, then the pool's extraArgs.
        extra = ["--enable-deterministic-inference"] if name == "qwen-lora" else []
        lora_start = args.index("--enable-lora")
        assert args[lora_start:] == pool.engine_args() + extra
        if kind == "sglang":
            assert args[args.index("--tp-size") + 1] == ("2" if name == "qwen-lora" else "1")
            gpus = "2" if name == "qwen-lora" else "1"
            assert engine["resources"]["limits"]["nvidia.com/gpu"] == gpus
            assert pod["spec"]["nodeSelector"] == {"miles.dev/pool": "rollout"}
        else:
            assert args[lora_start - 1] == "--x"
            assert "nvidia.com/gpu" not in engine["resources"]["limits"]
        claim = "lora-adapters" if name == "qwen-lora" else "small-adapters"
        mount_path = "/adapters" if name == "qwen-lora" else "/var/adapters"
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["adapters"]["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
        mounts = {m["name"]: m for m in engine["volumeMounts"]}
        assert mounts["adapters"] == {"name": "adapters", "mountPath": mount_path, "readOnly": True}
        budget = _named(objects, "PodDisruptionBudget", f"miles-pool-{name}")
        assert budget["spec"]["selector"] == deployment["spec"]["selector"]


def test_the_router_discovers_each_pool_as_it_discovers_a_jobs_engines(render: Renderer) -> None:
    """The pool's Service carries what the router's discovery selects EndpointSlices by (its k8s_label_selector,
    as the chart configures the router) and names the pool in k8s_pool_label; it selects the pool's pods only."""
    from miles.router.k8s_discovery import desired_engines
    from miles.router.settings import RouterSettings

    objects = render([], POOLS)
    router_env = _env(_named(objects, "Deployment", "miles-rollout-router"))
    selector = dict(part.split("=", 1) for part in router_env["MILES_ROUTER_K8S_LABEL_SELECTOR"].split(","))
    settings = RouterSettings(k8s_pool_label=router_env["MILES_ROUTER_K8S_POOL_LABEL"])
    for name in EXPECTED:
        service = _named(objects, "Service", f"miles-pool-{name}")
        labels = service["metadata"]["labels"]
        assert selector.items() <= labels.items()
        assert service["spec"]["clusterIP"] == "None"
        (port,) = service["spec"]["ports"]
        assert port == {"name": "http", "port": 30000, "targetPort": "http", "protocol": "TCP"}
        # Kubernetes copies the Service's labels onto its EndpointSlices: the router's view of one.
        endpoint_slice = {
            "metadata": {"name": f"miles-pool-{name}-abcde", "labels": labels},
            "ports": [{"name": "http", "port": 30000}],
            "endpoints": [{"addresses": ["10.0.0.7"], "conditions": {"ready": True}}],
        }
        assert desired_engines({"s": endpoint_slice}, settings) == {name: {"http://10.0.0.7:30000"}}
        selector_labels = service["spec"]["selector"].items()
        selected = [d["metadata"]["name"] for d in by_kind(objects, "Deployment")
                    if selector_labels <= d["spec"]["template"]["metadata"]["labels"].items()]  # fmt: skip
        assert selected == [f"miles-pool-{name}"]


def test_the_controller_gets_the_pools_as_settings_and_the_job_templates_their_adapter_volumes(
    render: Renderer, templates_of: Callable[..., dict[str, str]]
) -> None:
    objects = render([], POOLS)
    env = _env(_named(objects, "Deployment", "miles-controller"))
    settings = ControllerSettings(shared_pools=json.loads(env["MILES_CONTROLLER_SHARED_POOLS"]))
    assert {pool.name: pool for pool in settings.shared_pools} == EXPECTED
    assert EXPECTED["qwen-lora"].lora_target_modules == list(LORA_LINEAR_MODULES)
    chart_pools = json.loads(templates_of("default", POOLS)[SHARED_POOLS_KEY])
    assert chart_pools == {
        "secretName": "miles-auth",
        "pools": {
            "qwen-lora": {"deployment": "miles-pool-qwen-lora", "adapterClaimName": "lora-adapters",
                          "adapterMountPath": "/adapters"},
            "small": {"deployment": "miles-pool-small", "adapterClaimName": "small-adapters",
                      "adapterMountPath": "/var/adapters"},
        },
    }  # fmt: skip
    # Without pools: no pool objects, no controller setting, no key in the job templates.
    plain = render([])
    assert not [o for o in plain if o["metadata"]["name"].startswith("miles-pool-")]
    assert "MILES_CONTROLLER_SHARED_POOLS" not in _env(_named(plain, "Deployment", "miles-controller"))
    assert SHARED_POOLS_KEY not in templates_of("default")


def _rules(policy: dict[str, Any], direction: str) -> set[tuple[str, str]]:
    """(peer component or namespace selector, port) of every rule of an ingress or egress policy."""
    peers = "from" if direction == "ingress" else "to"
    found = set()
    for rule in policy["spec"].get(direction, []):
        for peer in rule.get(peers, []):
            who = peer["podSelector"]["matchLabels"][COMPONENT] if "podSelector" in peer else "prometheus"
            found |= {(who, str(port["port"])) for port in rule.get("ports", [])}
    return found


@pytest.mark.parametrize("mode", ["sidecar", "daemonset"])
def test_policies_admit_the_router_and_any_trainer_to_the_pools_and_the_trainers_to_router_and_sessions(
    render: Renderer, mode: str
) -> None:
    values = [*POOLS, f"jobTemplates.weightSync.mode={mode}", "networkPolicy.nodeCidrs[0]=10.0.0.0/16"]
    policies = {p["metadata"]["name"]: p for p in by_kind(render([], values), "NetworkPolicy")}
    pool_ingress = policies["miles-shared-engine-ingress"]
    assert pool_ingress["spec"]["podSelector"]["matchLabels"][COMPONENT] == "shared-engine"
    # Any job's trainer, not one job's: the pool is the platform's (no miles.dev/job in the rules).
    assert "miles.dev/job" not in json.dumps(pool_ingress)
    assert _rules(pool_ingress, "ingress") == {("rollout-router", "http"), ("trainer", "http"), ("prometheus", "http")}
    assert "miles-shared-engine-egress" not in policies  # DNS only (default deny), unless extraEgress says more
    # Not on the host network in daemonset mode either: reached by pod selector.
    assert ("shared-engine", "http") in _rules(policies["miles-rollout-router-egress"], "egress")
    trainer_out = _rules(policies["miles-trainer-egress"], "egress")
    assert {("shared-engine", "http"), ("rollout-router", "http"), ("session-server", "http")} <= trainer_out
    assert ("trainer", "http") in _rules(policies["miles-session-server-ingress"], "ingress")
    assert ("trainer", "http") in _rules(policies["miles-rollout-router-ingress"], "ingress")
    # A release without pools opens none of these.
    plain = {p["metadata"]["name"]: p for p in by_kind(render([]), "NetworkPolicy")}
    assert "miles-shared-engine-ingress" not in plain
    assert ("trainer", "http") not in _rules(plain["miles-session-server-ingress"], "ingress")
    extra = render([], [*POOLS, "networkPolicy.extraEgress.shared-engine[0].ports[0].port=443"])
    (egress,) = [p for p in by_kind(extra, "NetworkPolicy") if p["metadata"]["name"] == "miles-shared-engine-egress"]
    assert egress["spec"]["egress"] == [{"ports": [{"port": 443}]}]


def test_the_pools_podmonitor_scrapes_their_engines_with_a_pool_label(render: Renderer) -> None:
    objects = render([], [*POOLS, "monitoring.podMonitor.enabled=true"])
    monitor = _named(objects, "PodMonitor", "miles-shared-pools")
    assert monitor["spec"]["selector"]["matchLabels"][COMPONENT] == "shared-engine"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "http"
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_miles_dev_shared_pool"], "targetLabel": "pool"} in endpoint[
        "relabelings"
    ]


@pytest.mark.parametrize(
    ("set_values", "message"),
    [
        (["sharedPools[0].name=p", "sharedPools[0].modelPath=/m"], "adapterVolume"),
        ([*POOLS[:7], "sharedPools[0].maxLoraRank=0"], "/sharedPools/0/maxLoraRank"),
        ([*POOLS[:7], "sharedPools[0].name=Bad_Name"], "/sharedPools/0/name"),
        ([*POOLS, "sharedPools[1].name=qwen-lora"], 'the name "qwen-lora" is used twice'),
        ([*POOLS[:7], f"sharedPools[0].name={'p' * 60}"], "longer than 63 characters"),
        (["controller.settings.shared_pools[0]=x"], "set by the chart from sharedPools"),
    ],
    ids=["no-volume", "rank", "name", "twice", "long", "controller-setting"],
)
def test_bad_shared_pool_values_fail_with_a_readable_reason(
    render: Renderer, set_values: list[str], message: str
) -> None:
    with pytest.raises(RuntimeError) as failure:
        render([], set_values)
    assert message in str(failure.value)
