"""Per-job node placement on Kubernetes: a job that names a node pool for its engines, rollout workers or trainer
(`resources.<pool>.node_pool`) gets that pool's nodeSelector, tolerations and affinity on those pods, and only
those; a job that names none gets the chart's placement unchanged.

The pools are the release's: the chart's `nodePools` (`cpu`, `rollout`, `trainer` and any an operator adds),
rendered into the job-templates ConfigMap under `job_templates.NODE_POOLS_KEY`, so a job is checked against the
chart its objects come from (a chart upgrade changes the pools for new jobs). A named pool's three fields replace
what the chart rendered for the pod template (an unset one is removed, as `miles.nodePlacement` would not render
it), on:

- engines: the engine Deployment and, in the chart's weight-sync `daemonset` mode, the job's weight-sync DaemonSet
  (its daemons serve the engines on their nodes); that mode's `miles.dev/job` node selector is kept;
- rollout workers: the rollout-worker Deployment;
- trainer: the trainer StatefulSet.

The weight-sync origin and the environment server keep the chart's pools (`jobTemplates.weightSync.origin.nodePool`,
`jobTemplates.envServer.nodePool`).

Limits: GPUs per pod are the spec's `gpus_per_replica` (template placeholders), not the pool's: nothing checks that
the pool's nodes have them, so a pod that fits no node stays Pending and the job STARTING. A chart without
NODE_POOLS_KEY (older than this controller) defines no pools here: every named pool is refused. An adopted workload
(a 409 after a controller restart) keeps the placement it was created with.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from miles.common.jobspec.job import JobSpec
from miles.controller.job_templates import NODE_POOLS_KEY, pod_specs_of

COMPONENT_LABEL = "app.kubernetes.io/component"
POOL_COMPONENTS: dict[str, frozenset[str]] = {
    "engines": frozenset({"engine", "weight-sync"}),
    "rollout_workers": frozenset({"rollout-worker"}),
    "trainer": frozenset({"trainer"}),
}
"""Per-job pool of the spec's `resources` -> the components of the workloads its node_pool places."""

KEPT_NODE_SELECTOR_KEYS = ("miles.dev/job",)
"""Node-selector keys of the chart's own that a pool does not replace (weight-sync daemonset mode: the job's nodes)."""


@dataclass(frozen=True)
class NodePlacement:
    """One node pool of the release, as the chart's `nodePools.<name>` describes it."""

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    affinity: dict[str, Any] = field(default_factory=dict)


def chart_node_pools(templates: Mapping[str, str]) -> dict[str, NodePlacement]:
    """The release's node pools by name ({} for a chart that does not render NODE_POOLS_KEY)."""
    if NODE_POOLS_KEY not in templates:
        return {}
    pools: dict[str, dict[str, Any]] = json.loads(templates[NODE_POOLS_KEY])["pools"]
    return {
        name: NodePlacement(
            node_selector=dict(pool.get("nodeSelector") or {}),
            tolerations=list(pool.get("tolerations") or []),
            affinity=dict(pool.get("affinity") or {}),
        )
        for name, pool in pools.items()
    }


def requested_node_pools(spec: JobSpec) -> dict[str, str]:
    """Per-job pool (`engines`, `rollout_workers`, `trainer`) -> the node pool the job names for it; unnamed ones
    are left out."""
    resources = spec.resources
    named = {
        "engines": resources.engines.node_pool,
        "rollout_workers": resources.rollout_workers.node_pool,
        "trainer": resources.trainer.node_pool,
    }
    return {pool: node_pool for pool, node_pool in named.items() if node_pool is not None}


def node_pool_problem(spec: JobSpec, templates: Mapping[str, str]) -> tuple[str, str] | None:
    """(field, why) of the first node pool `spec` names that the release does not define; None when all are."""
    defined = chart_node_pools(templates)
    for pool, node_pool in requested_node_pools(spec).items():
        if node_pool not in defined:
            field_name = f"resources.{pool}.node_pool"
            return field_name, (
                f"{field_name} {node_pool!r} is not a node pool of this release (the chart's nodePools: "
                f"{sorted(defined)}); name one of them, or leave it unset for the chart's placement"
            )
    return None


def place_on_node_pools(
    objects: list[dict[str, Any]], spec: JobSpec, templates: Mapping[str, str]
) -> list[dict[str, Any]]:
    """`objects` with the pod templates of each named pool's workloads placed on its node pool (see the module
    docstring). Returns new dicts for what changes; the input is not changed. A pool the release does not define
    raises KeyError: check `node_pool_problem` first."""
    requested = requested_node_pools(spec)
    if not requested:
        return objects
    defined = chart_node_pools(templates)
    placement_of = {
        component: defined[node_pool] for pool, node_pool in requested.items() for component in POOL_COMPONENTS[pool]
    }
    placed = []
    for obj in objects:
        component = obj.get("metadata", {}).get("labels", {}).get(COMPONENT_LABEL, "")
        if component in placement_of and pod_specs_of(obj):  # workloads; a LeaderWorkerSet's leaders and workers
            obj = copy.deepcopy(obj)
            for pod_spec in pod_specs_of(obj):
                _place(pod_spec, placement_of[component])
        placed.append(obj)
    return placed


def _place(pod_spec: dict[str, Any], placement: NodePlacement) -> None:
    kept = {key: value for key, value in pod_spec.get("nodeSelector", {}).items() if key in KEPT_NODE_SELECTOR_KEYS}
    parts = {
        "nodeSelector": {**placement.node_selector, **kept},
        "tolerations": copy.deepcopy(placement.tolerations),
        "affinity": copy.deepcopy(placement.affinity),
    }
    for key, value in parts.items():
        if value:
            pod_spec[key] = value
        else:
            pod_spec.pop(key, None)
