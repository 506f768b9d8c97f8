"""Acceptance: the rollout worker under failure — injected agent failures, a session server killed and
restarted mid-run, the worker itself killed (-9) mid-epoch, and weight updates landing inside episodes.

Real subprocesses throughout (Redis, `miles-engine --fake-model`, router, session server, buffer, sandbox
gateway, `miles-rollout-worker`); the agents are `tests/e2e_rollout_agents.py`, loaded by dotted path like
any user agent. Each test checks what reached the buffer against what was injected, and that no session is
left behind.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from miles.proto.common.v1 import common_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

TESTS_DIR = Path(__file__).resolve().parent
ABORTED = common_pb2.SAMPLE_STATUS_ABORTED


@pytest.fixture(scope="module")
def stack_options(make_stack_options: Any) -> Any:
    return make_stack_options(engine="fake", sandbox=False)


@pytest.fixture
def dataset(tmp_path: Path) -> Callable[[int], str]:
    """dataset(num_prompts): a JSONL file of short prompts; returns its path."""

    def write(num_prompts: int) -> str:
        path = tmp_path / f"prompts-{num_prompts}.jsonl"
        rows = [{"prompt": f"Say something about the number {i}.", "label": str(i)} for i in range(num_prompts)]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(path)

    return write


def rollout_section(dataset_path: str, agent_name: str, *, n: int, **overrides: Any) -> dict[str, Any]:
    section: dict[str, Any] = {
        "dataset": {"path": dataset_path, "num_epochs": 1},
        "agent": {
            "function": f"e2e_rollout_agents:{agent_name}",
            "python_path": [str(TESTS_DIR)],
            "timeout_s": 30,
            "config": {"n_samples_per_prompt": n},
        },
        "n_samples_per_prompt": n,
        "request_kwargs": {"max_tokens": 8, "temperature": 1.0},
        "concurrency": {"max_live_episodes": 8},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(section.get(key), dict):
            section[key] = {**section[key], **value}
        else:
            section[key] = value
    return section


def metric_value(metrics_text: str, name: str, default: float | None = None) -> float:
    """The value of one series; `default` when it is not exported (a labelled counter never incremented)."""
    for line in metrics_text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise AssertionError(f"{name} not exported")


def wait_until(predicate: Callable[[], bool], worker: Any) -> None:
    while not predicate():
        assert worker.process.is_running(), worker.log_tail()
        time.sleep(0.2)


def episode_counts(metrics_text: str) -> Counter[tuple[str, str]]:
    """miles_rollout_episodes_total by (status, reason)."""
    counts: Counter[tuple[str, str]] = Counter()
    for line in metrics_text.splitlines():
        if line.startswith("miles_rollout_episodes_total{"):
            labels, value = line.rsplit(" ", 1)
            fields = dict(part.split("=") for part in labels[len("miles_rollout_episodes_total{") : -1].split(","))
            counts[(fields["status"].strip('"'), fields["reason"].strip('"'))] += int(float(value))
    return counts


def load_agents_module() -> Any:
    """tests/e2e_rollout_agents.py, imported by path (the test's view of the agents' schedule)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("e2e_rollout_agents_view", TESTS_DIR / "e2e_rollout_agents.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_injected_agent_failures_end_as_counted_statuses(stack: Any, dataset: Callable[[int], str]) -> None:
    behaviour = load_agents_module().behaviour
    job_id, num_prompts, n = "chaos", 6, 5
    stack.register_job(job_id)
    rollout = rollout_section(dataset(num_prompts), "chaos_agent", n=n, agent={"timeout_s": 5})
    worker = stack.worker(job_id, rollout).start()
    wait_until(lambda: worker.status()["exhausted"], worker)
    groups = stack.take_groups(job_id)
    counts = episode_counts(worker.metrics())

    expected = Counter(behaviour(p, s, n) for p in range(num_prompts) for s in range(n))
    assert expected == {"raise": 12, "no_call": 3, "timeout": 3, "normal": 12}
    assert counts[("ABORTED", "agent_error")] == expected["raise"]
    assert counts[("ABORTED", "no_model_call")] == expected["no_call"]
    assert counts[("ABORTED", "timeout")] == expected["timeout"]
    assert counts[("COMPLETED", "ok")] + counts[("TRUNCATED", "truncated")] == expected["normal"]
    assert sum(counts.values()) == num_prompts * n

    reason_of = {"raise": "agent_error", "no_call": "no_model_call", "timeout": "timeout"}
    # With n=5, even prompts get the schedule's first half (4 raise + 1 no_call: nothing trainable, dropped by
    # the min_valid_samples filter), odd prompts its second half (1 timeout + 4 normal: pushed).
    assert sorted(group.prompt_index for group in groups) == [1, 3, 5]
    assert 'miles_rollout_groups_total{outcome="filtered_all_aborted"} 3.0' in worker.metrics()
    for group in groups:
        assert len(group.samples) == n
        for sample in group.samples:
            kind = behaviour(group.prompt_index, int(sample.metadata["sample_index"]), n)
            if kind == "normal":
                assert sample.status != ABORTED and sample.metadata["status_reason"] in ("ok", "truncated")
                assert sample.reward == sample.metadata["sample_index"] % 2
                continue
            assert sample.status == ABORTED and sample.metadata["status_reason"] == reason_of[kind]
            if kind == "raise":
                assert "injected failure" in sample.metadata["error"]
            if kind == "timeout":  # it called the model once before hanging: the turn is kept, not trained
                assert sample.metadata["num_turns"] == 1 and len(sample.tokens) > sample.response_start
    assert stack.live_sessions(job_id) == []
    assert "miles_rollout_session_delete_failures_total 0.0" in worker.metrics()


def test_session_server_killed_and_restarted_mid_run(stack: Any, dataset: Callable[[int], str]) -> None:
    job_id, num_prompts, n = "session-chaos", 16, 2
    stack.register_job(job_id)
    rollout = rollout_section(dataset(num_prompts), "steady_agent", n=n, agent={"config": {"pause_s": 0.3}})
    env = {"MILES_ROLLOUT_RETRY_BUDGET_S": "60", "MILES_ROLLOUT_ORPHAN_MIN_AGE_S": "1"}
    worker = stack.worker(job_id, rollout, env=env).start()
    wait_until(lambda: stack.buffer_stats(job_id).pushed_total >= 3, worker)
    stack.kill_session_server()
    pushed_at_kill = stack.buffer_stats(job_id).pushed_total
    time.sleep(2.0)
    stack.start_session_server_again()
    # done: every prompt decided, and the sessions of creates whose reply the kill swallowed swept away
    wait_until(lambda: (status := worker.status())["exhausted"] and not status["orphan_sweep_pending"], worker)
    groups = stack.take_groups(job_id)
    counts = episode_counts(worker.metrics())

    assert worker.status()["cursor"]["num_done"] == num_prompts
    # every episode ended in a defined status; groups whose episodes all found no session server were retried
    assert sum(counts.values()) >= num_prompts * n
    defined = {"ok", "truncated", "agent_error", "session_unavailable", "samples_unavailable"}
    assert {reason for _, reason in counts} <= defined, counts
    assert stack.buffer_stats(job_id).pushed_total > pushed_at_kill  # groups kept coming after the restart
    pushed_samples = [sample for group in groups for sample in group.samples]
    assert all(sample.metadata["status_reason"] in defined for sample in pushed_samples)
    assert stack.live_sessions(job_id) == []


def test_worker_killed_mid_epoch_resumes_without_loss_or_duplicates(stack: Any, dataset: Callable[[int], str]) -> None:
    job_id, num_prompts, n = "worker-restart", 12, 2
    stack.register_job(job_id)
    rollout = rollout_section(
        dataset(num_prompts),
        "steady_agent",
        n=n,
        agent={"config": {"pause_s": 0.5}},
        concurrency={"max_live_episodes": 4},
    )
    worker = stack.worker(job_id, rollout, worker_id="worker-r", env={"MILES_ROLLOUT_ORPHAN_MIN_AGE_S": "1"}).start()
    wait_until(lambda: stack.buffer_stats(job_id).pushed_total >= 3, worker)
    worker.kill9()
    before = stack.buffer_stats(job_id).pushed_total
    assert before < num_prompts, "killed too late to be mid-epoch"
    left_behind = stack.live_sessions(job_id)  # the killed worker's episodes in flight (none if it died between)
    worker.start()  # the same worker id: its leases come back at once
    wait_until(lambda: (status := worker.status())["exhausted"] and not status["orphan_sweep_pending"], worker)
    groups = stack.take_groups(job_id)

    group_ids = [group.group_id for group in groups]
    assert sorted(group_ids) == sorted(f"{job_id}/e0/p{i}" for i in range(num_prompts))  # none lost, none twice
    stats = stack.buffer_stats(job_id)
    assert stats.pushed_total == num_prompts
    status = worker.status()
    assert status["cursor"]["num_done"] == num_prompts and status["cursor"]["num_leased"] == 0
    metrics = worker.metrics()
    assert 'miles_rollout_prompts_claimed_total{source="reclaimed"}' in metrics
    # The sessions the killed worker left behind are deleted: those it had recorded when its prompt is reclaimed,
    # one it created but had not recorded yet (it died within those milliseconds) by the sweep.
    deleted = sum(
        metric_value(metrics, f'miles_rollout_orphan_sessions_deleted_total{{cause="{cause}"}}', default=0.0)
        for cause in ("reclaim", "sweep")
    )
    assert deleted >= len(left_behind), (deleted, left_behind)
    assert stack.live_sessions(job_id) == []


@pytest.mark.parametrize("policy", ["keep_per_span", "keep", "regenerate"])
def test_episodes_spanning_weight_versions_follow_the_partial_rollout_policy(
    stack: Any, dataset: Callable[[int], str], policy: str
) -> None:
    job_id, num_prompts, n = f"partial-{policy.replace('_', '-')}", 2, 2
    stack.register_job(job_id)
    rollout = rollout_section(
        dataset(num_prompts),
        "version_bump_agent",
        n=n,
        agent={"config": {"n_samples_per_prompt": n, "engine_url": stack.engine_urls[0]}},
        partial_rollout={"policy": policy, "max_regenerations": 1},
        concurrency={"max_live_episodes": 1},  # one episode at a time: only its own bump lands inside it
    )
    worker = stack.worker(job_id, rollout).start()
    wait_until(lambda: worker.status()["exhausted"], worker)
    samples = [sample for group in stack.take_groups(job_id) for sample in group.samples]

    assert len(samples) == num_prompts * n
    for sample in samples:
        versions = [span.weight_version for span in sample.weight_versions]
        if policy == "keep_per_span":
            assert len(versions) == 2 and versions[1] == versions[0] + 1 and sample.metadata["num_attempts"] == 1
        elif policy == "keep":
            assert len(versions) == 1 and sample.metadata["num_attempts"] == 1
            assert sample.weight_versions[0].end == len(sample.loss_mask)
            assert versions[0] == min(sample.metadata["weight_versions_seen"])
        else:
            assert len(set(versions)) == 1 and sample.metadata["num_attempts"] == 2
    action = {"keep_per_span": "kept_per_span", "keep": "kept", "regenerate": "regenerated"}[policy]
    line = f'miles_rollout_partial_rollout_episodes_total{{action="{action}"}} {float(num_prompts * n)}'
    assert line in worker.metrics()
    assert stack.live_sessions(job_id) == []
