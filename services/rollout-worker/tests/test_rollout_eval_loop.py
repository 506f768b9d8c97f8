"""The evaluation loop's logic without services: pass@k, the version check, slot share, and EvalLoop deciding
which versions to evaluate, what it discards and what it writes (a scripted runner, an in-memory hash for Redis).

The pinned path through real services (session server -> router -> engine) is tests/test_e2e_eval_per_version.py.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from miles.common.contracts import evals as contract
from miles.common.jobspec.evaluation import EvaluationSpec
from miles.common.jobspec.rollout import RolloutSpec
from miles.common.telemetry import Metrics
from miles.proto.common.v1 import common_pb2
from miles.rollout.episode import EpisodeOutcome, EpisodeTask
from miles.rollout.episode_source import EpisodeSource
from miles.rollout.eval_loop import (
    EvalLoop,
    PinnedSessionClient,
    VersionWatch,
    eval_concurrency,
    only_version,
    score_dataset,
)
from miles.rollout.metrics import EvalMetrics


def outcome(versions: list[int], reward: float = 1.0, reason: str = "ok") -> EpisodeOutcome:
    sample = common_pb2.Sample(reward=reward)
    for index, version in enumerate(versions):
        sample.weight_versions.add(start=index, end=index + 1, weight_version=version)
    return EpisodeOutcome([sample], common_pb2.SAMPLE_STATUS_COMPLETED, reason)


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert contract.pass_at_k(4, 0, 1) == 0.0
    assert contract.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert contract.pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert contract.pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError):
        contract.pass_at_k(2, 1, 3)


def test_an_episode_counts_for_a_version_only_when_every_turn_ran_at_it() -> None:
    assert only_version(outcome([5, 5]), 5) is True
    assert only_version(outcome([5, 6]), 5) is False
    assert only_version(outcome([6]), 5) is False
    assert only_version(outcome([]), 5) is None  # nothing served: no version to blame


def test_evaluation_takes_its_share_of_the_slots_and_at_least_one() -> None:
    spec = spec_with(capacity_share=0.25)
    assert eval_concurrency(spec, 16) == 4
    assert eval_concurrency(spec, 2) == 1
    assert eval_concurrency(spec_with(capacity_share=0.3), 10) == 3


def test_scores_mean_and_pass_at_k_over_the_kept_episodes() -> None:
    spec = spec_with(n_samples_per_prompt=2, pass_at_k=[1, 2])
    scored = score_dataset([[1.0, 0.0], [0.0, 0.0], []], spec, discarded=2, reasons=Counter(ok=4))
    assert scored.mean_reward == 0.25
    assert scored.pass_at_k == {"1": 0.25, "2": 0.5}
    assert (scored.num_prompts, scored.num_episodes, scored.num_discarded) == (2, 4, 2)


def test_the_watch_follows_the_newest_version_of_rollout_episodes() -> None:
    watch = VersionWatch()

    async def run(task: Any) -> EpisodeOutcome:
        return outcome(task)

    async def scenario() -> None:
        wrapped = watch.wrap(run)
        await wrapped([0, 1])  # type: ignore[arg-type]
        assert watch.newest == 1 and watch.changed.is_set()
        watch.changed.clear()
        await wrapped([0])  # type: ignore[arg-type]
        assert watch.newest == 1 and not watch.changed.is_set()
        assert set(watch.seen_unix_ms) == {0, 1}

    asyncio.run(scenario())


class FakeRedis:
    def __init__(self) -> None:
        self.hashes: dict[str, dict[str, str]] = {}
        self.strings: dict[str, str] = {}

    async def hkeys(self, key: str) -> list[str]:
        return list(self.hashes.get(key, {}))

    async def hset(self, key: str, field: str, value: str) -> None:
        self.hashes.setdefault(key, {})[field] = value

    async def hsetnx(self, key: str, field: str, value: str) -> bool:
        if field in self.hashes.get(key, {}):
            return False
        await self.hset(key, field, value)
        return True

    async def eval(self, script: str, numkeys: int, key: str, field: str, value: str) -> int:
        """STORE_SCORED_LUA's semantics: set unless the field holds a readable non-`missed` result."""
        assert script == contract.STORE_SCORED_LUA and numkeys == 1
        current = self.hashes.get(key, {}).get(field)
        if current is not None:
            try:
                if json.loads(current).get("status") != "missed":
                    return 0
            except ValueError:
                pass
        await self.hset(key, field, value)
        return 1

    async def set(self, key: str, value: str, *, nx: bool = False, ex: int | None = None) -> bool | None:
        if nx and key in self.strings:
            return None
        self.strings[key] = value
        return True


class ScriptedRunner:
    """Serves each episode at `served` (a version, or the list of a turn's versions) and records its tasks and the
    most episodes it ran at once (each takes `episode_s`)."""

    def __init__(self) -> None:
        self.served: list[int] = [0]
        self.tasks: list[EpisodeTask] = []
        self.episode_s = 0.0
        self.in_flight = self.most_in_flight = 0

    async def run(self, task: EpisodeTask) -> EpisodeOutcome:
        self.tasks.append(task)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(self.episode_s)
        self.in_flight -= 1
        return outcome(self.served, reward=float(task.prompt_index % 2))


def spec_with(**overrides: Any) -> EvaluationSpec:
    base: dict[str, Any] = {"datasets": [{"name": "held", "dataset": {"path": "unused.jsonl"}}]}
    return EvaluationSpec.model_validate({**base, "every_n_versions": 5, **overrides})


def make_loop(
    tmp_path: Path, redis: FakeRedis | None = None, **overrides: Any
) -> tuple[EvalLoop, ScriptedRunner, FakeRedis]:
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "label": str(i)}) + "\n" for i in range(4)))
    spec = spec_with(datasets=[{"name": "held", "dataset": {"path": str(data)}}], **overrides)
    rollout = RolloutSpec.model_validate(
        {"dataset": {"path": str(data)}, "agent": {"function": "x:y"}, "reward": {"type": "exact_match"}}
    )
    runner, redis = ScriptedRunner(), redis or FakeRedis()
    loop = EvalLoop(
        spec,
        rollout,
        job_id="job-e",
        runner=runner,  # type: ignore[arg-type]
        sessions=PinnedSessionClient("http://127.0.0.1:1", operator_token="", request_timeout_s=1, retry_budget_s=0),
        source=EpisodeSource(dataset=None, agent=None),  # type: ignore[arg-type]
        redis_client=redis,  # type: ignore[arg-type]
        metrics=EvalMetrics(Metrics("rollout")),
        max_live_episodes=8,
    )
    return loop, runner, redis


def stored(redis: FakeRedis) -> dict[int, contract.VersionEval]:
    return {int(v): contract.VersionEval.from_json(j) for v, j in redis.hashes.get("miles:evals:job-e", {}).items()}


@pytest.mark.parametrize("greedy", [True, False])
def test_sampled_evaluation_keeps_the_rollouts_sampling_and_greedy_drops_it(greedy: bool) -> None:
    rollout = RolloutSpec.model_validate(
        {
            "dataset": {"path": "unused.jsonl"},
            "agent": {"function": "x:y"},
            "reward": {"type": "exact_match"},
            "request_kwargs": {"temperature": 0.8, "top_p": 0.9, "max_tokens": 16},
        }
    )
    runner_spec = EvalLoop.runner_spec(spec_with(greedy=greedy, n_samples_per_prompt=4, pass_at_k=[1, 4]), rollout)
    sampled = {"temperature": 0.8, "top_p": 0.9, "max_tokens": 16}
    expected = {"temperature": 0.0, "max_tokens": 16} if greedy else sampled
    assert runner_spec.request_kwargs == expected
    assert runner_spec.partial_rollout.policy == "keep_per_span"  # an eval episode is never regenerated
    assert rollout.request_kwargs["temperature"] == 0.8  # the rollout's own spec is left as it was


def test_due_versions_are_scored_once_and_skipped_ones_recorded_missed(tmp_path: Path) -> None:
    loop, runner, redis = make_loop(tmp_path, n_samples_per_prompt=2, pass_at_k=[1, 2])

    async def scenario() -> None:
        await loop._consider(0)
        assert loop.sessions.min_weight_version == 0
        await loop._consider(3)  # not due
        runner.served = [7]
        await loop._consider(7)  # 5 was due but never seen: missed; 7 is not due
        runner.served = [10]
        await loop._consider(10)
        loop._considered = -1  # a restarted worker: what is stored is not evaluated again
        count = len(runner.tasks)
        await loop._consider(10)
        assert len(runner.tasks) == count

    asyncio.run(scenario())
    results = stored(redis)
    assert sorted(results) == [0, 5, 10]
    assert results[5].status == "missed" and not results[5].datasets
    held = results[10].datasets["held"]
    assert results[10].status == "scored" and loop.sessions.min_weight_version == 10
    assert (held.num_prompts, held.num_episodes, held.mean_reward) == (4, 8, 0.5)
    assert held.pass_at_k == {"1": 0.5, "2": 0.5}
    assert len(runner.tasks) == 16  # versions 0 and 10: 4 prompts x 2 samples each


def test_episodes_served_at_another_version_are_discarded_not_scored(tmp_path: Path) -> None:
    loop, runner, redis = make_loop(tmp_path)
    runner.served = [5, 6]  # the engines moved on mid-episode
    asyncio.run(loop._consider(5))
    result = stored(redis)[5]
    assert result.status == "missed"
    assert result.datasets["held"].num_discarded == 4 and result.datasets["held"].num_episodes == 0


def test_of_several_workers_only_the_one_that_claims_a_version_evaluates_it(tmp_path: Path) -> None:
    shared = FakeRedis()
    first, first_runner, _ = make_loop(tmp_path, shared)
    second, second_runner, _ = make_loop(tmp_path, shared)

    async def scenario() -> None:
        await first._consider(0)
        await second._consider(0)  # claimed (and stored) by the first
        first_runner.served = [10]
        await first._consider(10)  # due, claimed and scored by the first
        await second._consider(10)  # 5 was due and seen by nobody: missed; 10 is the first's already
        await first._consider(11)

    asyncio.run(scenario())
    assert len(first_runner.tasks) == 8 and second_runner.tasks == []  # 4 prompts at 0 and at 10, once each
    assert {v: r.status for v, r in stored(shared).items()} == {0: "scored", 5: "missed", 10: "scored"}


def test_evaluation_never_runs_more_episodes_at_once_than_its_share(tmp_path: Path) -> None:
    loop, runner, _ = make_loop(tmp_path, n_samples_per_prompt=4, pass_at_k=[1], capacity_share=0.25)
    runner.episode_s = 0.01
    asyncio.run(loop._consider(0))
    assert len(runner.tasks) == 16 and runner.most_in_flight == 2  # 0.25 x max_live_episodes 8, all of it used


def test_an_external_score_stands_and_a_missed_version_can_still_be_scored(tmp_path: Path) -> None:
    loop, runner, redis = make_loop(tmp_path)
    held = contract.DatasetEval(0.75, {"1": 0.75}, 4, 4)
    external = contract.VersionEval(0, "scored", 2_000, 1_000, 1.0, {"held": held}, "checkpoint")
    redis.hashes["miles:evals:job-e"] = {"0": external.to_json()}

    async def scenario() -> None:
        await loop._consider(0)  # scored already by the external evaluator: not evaluated again
        await loop._consider(6)  # 5 left behind: missed
        assert stored(redis)[5].status == "missed"
        late = contract.VersionEval(5, "scored", 3_000, 2_000, 1.0, {"held": held}, "checkpoint")
        assert await contract.store_scored(redis, "job-e", late)  # type: ignore[arg-type]
        assert not await contract.store_scored(redis, "job-e", late)  # type: ignore[arg-type]

    asyncio.run(scenario())
    assert runner.tasks == []
    results = stored(redis)
    assert results[0].evaluator == "checkpoint" and results[0].datasets["held"].mean_reward == 0.75
    assert results[5].status == "scored" and results[5].evaluator == "checkpoint"
