"""Fixtures of the chart tests: a (cached) renderer bound to this chart and its CI values files, the per-job
templates instantiated for an example job, and validation of every object incl. the monitoring CRs."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from miles.common.testing.helm import by_kind, render_chart
from miles.controller.env_server_templates import EnvironmentServerParams
from miles.controller.job_templates import JobTemplateParams, instantiate_job_templates

CHART_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = CHART_DIR.parents[1]
KUBERNETES_VERSION = "1.34.0"
Renderer = Callable[..., list[dict[str, Any]]]
VALUE_SETS = {"default": (), "ci": ("ci-values.yaml",), "gpu": ("ci-values.yaml", "gpu-values.yaml")}
EXAMPLE_JOB = JobTemplateParams(
    job_id="gsm8k-7",
    model_path="/models/qwen3-8b",
    engine_replicas=4,
    engine_gpus=2,
    tp_size=2,
    rollout_worker_replicas=3,
    trainer_replicas=2,
    trainer_gpus=8,
    # A hub environment, so that every check of the per-job objects covers the environment server too.
    environment=EnvironmentServerParams(connector="reasoning_gym", args_json='{"dataset": "leg_counting"}'),
)

# The prometheus-operator CRs the chart renders, checked against the fields of their CRDs (monitoring.coreos.com/v1)
# that the chart uses: no CRD schemas ship offline (kubernetes-validate bundles core kinds only), so these are
# written from the operator's API reference and refuse unknown fields where the chart sets them.
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "replacement": {"type": "string"},
        "action": {"enum": ["replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep", "hashmod"]},
    },
}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": {"type": "string", "minLength": 1},
        "path": {"type": "string", "pattern": "^/"},
        "interval": {
            "type": "string",
            "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
        },
        "relabelings": {"type": "array", "items": _RELABEL},
    },
}
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"matchLabels": {"type": "object"}, "matchExpressions": {"type": "array"}},
}
_RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["alert", "expr"],
    "properties": {
        "alert": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9]*$"},
        "expr": {"type": "string", "minLength": 1},
        "for": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h|d|w|y)$"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
CR_SPEC_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": {
        "type": "object",
        "additionalProperties": False,
        "required": ["selector", "endpoints"],
        "properties": {"selector": _SELECTOR, "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT}},
    },
    "PodMonitor": {
        "type": "object",
        "additionalProperties": False,
        "required": ["selector", "podMetricsEndpoints"],
        "properties": {
            "selector": _SELECTOR,
            "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
        },
    },
    "PrometheusRule": {
        "type": "object",
        "additionalProperties": False,
        "required": ["groups"],
        "properties": {
            "groups": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "rules"],
                    "properties": {"name": {"type": "string"}, "rules": {"type": "array", "items": _RULE}},
                },
            }
        },
    },
}


def validate_object(obj: dict[str, Any]) -> None:
    """Kubernetes 1.34 strict schema validation; the monitoring CRs against CR_SPEC_SCHEMAS."""
    if obj["kind"] in CR_SPEC_SCHEMAS:
        assert obj["apiVersion"] == "monitoring.coreos.com/v1", obj["metadata"]
        assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}, obj["metadata"]
        jsonschema.validate(obj["spec"], CR_SPEC_SCHEMAS[obj["kind"]])
        return
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@functools.cache
def _render_cached(values_files: tuple[str, ...], set_values: tuple[str, ...]) -> list[dict[str, Any]]:
    return render_chart(CHART_DIR, [CHART_DIR / "ci" / name for name in values_files], set_values)


def job_templates_of(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The data of the <release>-job-templates ConfigMap (what the controller instantiates per job)."""
    (config_map,) = [o for o in by_kind(objects, "ConfigMap") if o["metadata"]["name"].endswith("-job-templates")]
    return dict(config_map["data"])


@pytest.fixture(scope="session")
def chart_dir() -> Path:
    return CHART_DIR


@pytest.fixture(scope="session")
def render() -> Renderer:
    """render(["ci-values.yaml", ...], ["key=value", ...]) -> objects (a fresh copy); files under helm/miles/ci/.

    Renders are cached per argument list: helm takes ~0.5 s a call and many tests read the same values."""

    def _render(values_files: Sequence[str] = (), set_values: Sequence[str] = ()) -> list[dict[str, Any]]:
        return copy.deepcopy(_render_cached(tuple(values_files), tuple(set_values)))

    return _render


@pytest.fixture(scope="session")
def job_objects(render: Renderer) -> Callable[..., list[dict[str, Any]]]:
    """job_objects(value_set | files, set_values, params) -> the example job's instantiated per-job objects."""

    def _job(
        value_set: str = "default", set_values: Sequence[str] = (), params: JobTemplateParams = EXAMPLE_JOB
    ) -> list[dict[str, Any]]:
        return instantiate_job_templates(job_templates_of(render(VALUE_SETS[value_set], set_values)), params)

    return _job


@pytest.fixture(scope="session")
def templates_of(render: Renderer) -> Callable[..., dict[str, str]]:
    """templates_of(value_set, set_values) -> the job-templates ConfigMap's data."""

    def _templates(value_set: str = "default", set_values: Sequence[str] = ()) -> dict[str, str]:
        return job_templates_of(render(VALUE_SETS[value_set], set_values))

    return _templates


@pytest.fixture(scope="session")
def validate() -> Callable[[dict[str, Any]], None]:
    """validate(obj): Kubernetes 1.34 strict validation, or the CR schema for monitoring objects."""
    return validate_object


@pytest.fixture(scope="session")
def example_job() -> JobTemplateParams:
    return EXAMPLE_JOB


@pytest.fixture(scope="session")
def value_sets() -> dict[str, tuple[str, ...]]:
    """Name -> values files under helm/miles/ci/: default, ci (CPU engines, monitoring on), gpu (a GPU cluster)."""
    return VALUE_SETS


@pytest.fixture(scope="session")
def all_objects(
    render: Renderer, job_objects: Callable[..., list[dict[str, Any]]]
) -> Callable[..., list[dict[str, Any]]]:
    """all_objects(value_set) -> the chart's objects plus the example job's instantiated objects."""

    def _all(value_set: str) -> list[dict[str, Any]]:
        return render(VALUE_SETS[value_set]) + job_objects(value_set)

    return _all
