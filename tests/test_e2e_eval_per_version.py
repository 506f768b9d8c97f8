"""Evaluation per weight version on the job's own engines, through real processes (fake-model engine, router,
session server, buffer, rollout workers): no trainer, the engine's version is set by hand
(`/update_weight_version`), as weight-sync would.

Checked: (i) the evaluating worker scores version 0 and, once the engine serves 5, version 5, every scored
episode having run entirely at that version (the result counts only those; none discarded while the engine
stays put), with the worker's `miles_rollout_eval_*` metrics; (ii) rollout throughput (groups pushed to the
buffer) of a worker evaluating with `capacity_share` 0.25 is at least (1 - 0.25) x that of the same worker
without evaluation over an equal window, minus a 25 % noise margin for 2 shared cores (the two windows run one
after the other in this test); (iii) the controller side (GET and `miles status`) is
services/controller/tests/test_controller_evals.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from miles.common.contracts import evals as contract

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

TESTS_DIR = Path(__file__).resolve().parent
SHARE = 0.25
NOISE_MARGIN = 0.75
WINDOW_S = 8.0


@pytest.fixture(scope="module")
def stack_options(make_stack_options: Any) -> Any:
    return make_stack_options(engine="fake", sandbox=False, num_engines=1)


def prompts(path: Path, num: int) -> str:
    path.write_text(
        "".join(json.dumps({"prompt": f"Say something about {i}.", "label": str(i)}) + "\n" for i in range(num))
    )
    return str(path)


def rollout_section(dataset_path: str) -> dict[str, Any]:
    return {
        "dataset": {"path": dataset_path, "num_epochs": 1},
        "agent": {
            "function": "e2e_rollout_agents:steady_agent",
            "python_path": [str(TESTS_DIR)],
            "timeout_s": 30,
            "config": {"pause_s": 0.3},
        },
        "n_samples_per_prompt": 2,
        "request_kwargs": {"max_tokens": 8, "temperature": 1.0},
        "concurrency": {"max_live_episodes": 8},
    }


def pushed_over_window(stack: Any, job_id: str) -> int:
    deadline = time.monotonic() + 120
    while stack.buffer_stats(job_id).pushed_total < 2:
        assert time.monotonic() < deadline, "no group pushed"
        time.sleep(0.2)
    start = stack.buffer_stats(job_id).pushed_total
    time.sleep(WINDOW_S)
    return int(stack.buffer_stats(job_id).pushed_total - start)


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = 180) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"never: {what}")


def test_eval_runs_pinned_to_each_due_version_within_its_share(stack: Any, tmp_path: Path) -> None:
    data = prompts(tmp_path / "train.jsonl", 400)
    held = prompts(tmp_path / "held.jsonl", 24)
    stack.register_job("eval-off")
    plain = stack.worker("eval-off", rollout_section(data)).start()
    without = pushed_over_window(stack, "eval-off")
    plain.stop()

    job_id = "eval-on"
    stack.register_job(job_id)
    evaluation = {
        "datasets": [{"name": "held", "dataset": {"path": held}}],
        "every_n_versions": 5,
        "n_samples_per_prompt": 2,
        "pass_at_k": [1, 2],
        "capacity_share": SHARE,
    }
    worker = stack.worker(job_id, rollout_section(data), env={"MILES_ROLLOUT_EVALUATION_ENABLED": "true"})
    config = stack.log_dir / f"worker-{job_id}-worker-0.json"
    config.write_text(json.dumps({"rollout": rollout_section(data), "evaluation": evaluation}))
    worker.start()
    with_eval = pushed_over_window(stack, job_id)
    store = redis.Redis.from_url(stack.redis_url)

    def results() -> dict[int, contract.VersionEval]:
        return {r.version: r for r in contract.parse_evals(store.hgetall(contract.evals_key(job_id)))}

    wait_for(lambda: 0 in results(), "version 0 scored")
    for engine in stack.engine_urls:
        httpx.post(f"{engine}/update_weight_version", json={"new_version": "5", "abort_all_requests": False})
    wait_for(lambda: 5 in results(), "version 5 scored")
    scores = results()
    print(
        f"groups pushed in {WINDOW_S}s: without eval {without}, with eval {with_eval}; "
        f"lag_s v0 {scores[0].lag_s:.2f} v5 {scores[5].lag_s:.2f}"
    )
    for version in (0, 5):
        result = scores[version]
        assert result.status == "scored", result
        held_scores = result.datasets["held"]
        assert held_scores.num_episodes + held_scores.num_discarded == 48, held_scores
        assert held_scores.num_discarded == 0 and held_scores.num_prompts == 24, held_scores
        assert result.lag_s >= 0
    assert set(scores) == {0, 5}  # 1..4 are not due, and nothing was evaluated twice
    metrics = worker.metrics()
    assert 'miles_rollout_eval_reward{dataset="held"}' in metrics and "miles_rollout_eval_lag_seconds" in metrics
    assert with_eval >= (1 - SHARE) * NOISE_MARGIN * without, (with_eval, without)
