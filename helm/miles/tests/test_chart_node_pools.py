"""The release's node pools as the controller sees them (`node-pools.json` in the job templates): every pool of
`nodePools`, added ones included, with the placement `miles.nodePlacement` renders for the chart's own pods, and
pool names that a job can name (DNS labels) or the install fails."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest

from miles.common.testing.helm import by_kind
from miles.controller.job_templates import NODE_POOLS_KEY, JobTemplateParams

pytestmark = pytest.mark.integration  # runs helm

Renderer = Callable[..., list[dict[str, Any]]]
COMPONENT = "app.kubernetes.io/component"
H200 = [
    "nodePools.h200.nodeSelector.cloud\\.example\\.com/accelerator=h200",
    "nodePools.h200.tolerations[0].key=example.com/h200",
    "nodePools.h200.tolerations[0].operator=Exists",
]


def _placement(pool: dict[str, Any]) -> dict[str, Any]:
    """What miles.nodePlacement renders for a pool: its non-empty parts."""
    return {key: value for key, value in pool.items() if value}


def _pod_placement(obj: dict[str, Any]) -> dict[str, Any]:
    pod = obj["spec"]["template"]["spec"]
    return {key: pod[key] for key in ("nodeSelector", "tolerations", "affinity") if key in pod}


@pytest.mark.parametrize("value_set", ["default", "ci", "gpu"])
def test_the_controllers_pools_are_the_placement_the_chart_gives_its_own_pods(
    value_set: str,
    templates_of: Callable[..., dict[str, str]],
    job_objects: Callable[..., list[dict[str, Any]]],
    example_job: JobTemplateParams,
) -> None:
    pools = json.loads(templates_of(value_set)[NODE_POOLS_KEY])["pools"]
    assert set(pools) == {"cpu", "rollout", "trainer"}
    assert all(set(pool) == {"nodeSelector", "tolerations", "affinity"} for pool in pools.values())
    (trainer,) = [
        o for o in by_kind(job_objects(value_set), "StatefulSet") if o["metadata"]["labels"][COMPONENT] == "trainer"
    ]
    assert _pod_placement(trainer) == _placement(pools["trainer"])


def test_an_added_pool_reaches_the_controller_and_changes_no_pod_of_the_release(
    render: Renderer, templates_of: Callable[..., dict[str, str]], job_objects: Callable[..., list[dict[str, Any]]]
) -> None:
    pools = json.loads(templates_of("default", H200)[NODE_POOLS_KEY])["pools"]
    assert pools["h200"] == {
        "nodeSelector": {"cloud.example.com/accelerator": "h200"},
        "tolerations": [{"key": "example.com/h200", "operator": "Exists"}],
        "affinity": {},
    }
    assert job_objects("default", H200) == job_objects("default")  # placed only for a job that names it
    assert [o for o in render([], H200) if "h200" in json.dumps(o) and o["kind"] != "ConfigMap"] == []


@pytest.mark.parametrize("name", ["H200", "gpu_pool", "-gpu"])
def test_a_pool_name_a_job_could_not_name_fails_the_install(render: Renderer, name: str) -> None:
    with pytest.raises(RuntimeError, match=re.escape(f"invalid propertyName '{name}'")):
        render([], [f"nodePools.{name}.nodeSelector.a=b"])
