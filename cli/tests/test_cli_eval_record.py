"""`miles eval --job-id J --version V`: the result of an evaluation on a checkpoint becomes the body of
`POST /v1/jobs/{id}/evals` (the controller's `RecordEvalRequest` accepts it), and `miles status` names the
evaluator of such a score. The POST itself is services/controller/tests/test_controller_evals.py."""

from __future__ import annotations

from typing import Any

import pytest
import typer

from miles.cli.evaluation import eval_lines, recorded_eval_body
from miles.cli.main import eval_model
from miles.common.jobspec.job import JobSpec
from miles.controller.evals import RecordEvalRequest
from miles.rollout.evaluate import EvalResult


def job_spec(**overrides: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "evaluated",
            "model": {"path": "/models/tiny", "family": "qwen3"},
            "rollout": {
                "dataset": {"path": "examples/calculator_tool/data.jsonl"},
                "agent": {"function": "calculator_tool.agent:agent", "python_path": ["examples"]},
            },
            "train": {"num_steps": 3},
            **overrides,
        }
    )


def test_a_checkpoint_score_is_a_valid_record_with_pass_at_1_at_the_spec_threshold() -> None:
    result = EvalResult(0.55, [1.0, 0.0, 0.6, 0.6], {"ok": 3, "agent_error": 1})
    body = recorded_eval_body(result, job_spec(), version=10, dataset_name="held", seen_unix_ms=1_000)
    request = RecordEvalRequest.model_validate(body)
    held = request.datasets["held"]
    assert (request.version, request.evaluator, request.seen_unix_ms) == (10, "checkpoint", 1_000)
    assert (held.mean_reward, held.num_prompts, held.num_episodes) == (0.55, 4, 4)
    assert held.pass_at_k == {"1": 0.25} and held.reasons == {"ok": 3, "agent_error": 1}
    evaluation = {"datasets": [{"name": "held", "dataset": {"path": "x.jsonl"}}], "pass_threshold": 0.5}
    lenient = recorded_eval_body(
        result, job_spec(evaluation=evaluation), version=10, dataset_name="held", seen_unix_ms=0
    )
    assert lenient["datasets"]["held"]["pass_at_k"] == {"1": 0.75}


def test_status_names_an_external_evaluator() -> None:
    held = {"mean_reward": 0.5, "pass_at_k": {"1": 0.5}, "num_episodes": 4, "num_discarded": 0}
    evals = {
        "evals": [
            {"version": 10, "status": "scored", "evaluator": "checkpoint", "lag_s": 2.0, "datasets": {"held": held}}
        ]
    }
    assert eval_lines(evals) == [
        "  eval v10 (checkpoint): held reward 0.500 pass@1 0.50 (4 eps, 0 discarded); lag 2.0s"
    ]


def test_a_record_needs_job_version_and_a_valid_dataset_name_before_evaluating(tmp_path: Any) -> None:
    with pytest.raises(typer.BadParameter, match="go together"):
        eval_model(tmp_path / "spec.yaml", model=tmp_path, job_id="j1", version=None)
    with pytest.raises(typer.BadParameter, match="dataset-name"):
        eval_model(tmp_path / "spec.yaml", model=tmp_path, job_id="j1", version=5, dataset_name="Held Out")
