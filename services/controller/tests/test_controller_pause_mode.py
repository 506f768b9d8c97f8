"""The weight-update pause mode a job's processes get when its spec leaves it null: in_place on the miles CPU engine
(whose answers say which weights sampled each token), drain on SGLang (one version per call), on both backends."""

from __future__ import annotations

from typing import Any

import pytest

from miles.common.jobspec.job import JobSpec
from miles.controller.backends.kubernetes_job_spec import spec_files


def _spec(controller_kit: Any, kind: str, **weight_sync: Any) -> JobSpec:
    body = controller_kit.job_spec_body(num_steps=3)
    body["resources"] = {"engines": {"replicas": 1, "kind": kind, "gpus_per_replica": 1 if kind == "sglang" else 0}}
    body["weight_sync"] = {"transport": "stream", **weight_sync}
    return JobSpec.model_validate(body)


@pytest.mark.parametrize(("kind", "resolved"), [("cpu", "in_place"), ("sglang", "drain")])
def test_a_null_pause_mode_resolves_by_engine_kind_and_a_chosen_one_stays(
    controller_kit: Any, kind: str, resolved: str
) -> None:
    spec = _spec(controller_kit, kind)
    assert (spec.weight_sync.pause_mode, spec.pause_mode) == (None, resolved)
    files = spec_files(spec)
    assert files["weightsync.json"]["pause_mode"] == files["trainer.json"]["publish"]["pause_mode"] == resolved
    assert _spec(controller_kit, kind, pause_mode="retract").pause_mode == "retract"
