"""Custom resources against their CRDs' vendored OpenAPI schemas: a valid LeaderWorkerSet passes, a wrong enum,
type or unknown field fails naming the field, and a kind with no vendored schema fails rather than passing."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from miles.common.testing.crd_schemas import custom_resource_schemas, validate_custom_object

CONTAINER = {"name": "sglang", "image": "lmsysorg/sglang:v0.5", "args": ["--nnodes", "$(LWS_GROUP_SIZE)"]}
LWS: dict[str, Any] = {
    "apiVersion": "leaderworkerset.x-k8s.io/v1",
    "kind": "LeaderWorkerSet",
    "metadata": {"name": "sglang", "labels": {"miles.dev/job": "j1"}},
    "spec": {
        "replicas": 2,
        "startupPolicy": "LeaderCreated",
        "leaderWorkerTemplate": {
            "size": 2,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": {"metadata": {"labels": {"role": "leader"}}, "spec": {"containers": [CONTAINER]}},
            "workerTemplate": {"spec": {"containers": [CONTAINER]}},
        },
    },
}


def test_the_vendored_lws_crd_is_known_by_api_version_and_kind() -> None:
    schema = custom_resource_schemas()[("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")]
    assert schema.plural == "leaderworkersets"


def test_a_valid_leaderworkerset_passes() -> None:
    validate_custom_object(copy.deepcopy(LWS))


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("spec", "leaderWorkerTemplate", "restartPolicy"), "Always", "spec.leaderWorkerTemplate.restartPolicy"),
        (("spec", "replicas"), "two", "spec.replicas"),
        (("spec", "leaderWorkerTemplate", "groupSize"), 2, "spec.leaderWorkerTemplate"),
        (("spec", "startupPolicy"), "WorkersFirst", "spec.startupPolicy"),
    ],
)
def test_a_bad_field_fails_naming_it(path: tuple[str, ...], value: Any, field: str) -> None:
    obj = copy.deepcopy(LWS)
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    with pytest.raises(ValueError, match=re.escape(f"LeaderWorkerSet sglang: {field}: ")):
        validate_custom_object(obj)


def test_an_unknown_field_in_the_embedded_pod_template_fails() -> None:
    obj = copy.deepcopy(LWS)
    obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["argz"] = []
    with pytest.raises(ValueError, match="argz"):
        validate_custom_object(obj)


def test_a_kind_without_a_vendored_schema_fails() -> None:
    with pytest.raises(ValueError, match=r"no vendored CRD schema for example\.com/v1 Widget"):
        validate_custom_object({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})
