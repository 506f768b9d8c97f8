"""The episode flow against a real session server and engine (subprocesses): every failure layer ends in a
defined sample status with its reason, the session is always deleted, and rewards, per-turn rewards and agent
metadata land on the samples."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI

from miles.common.jobspec.rollout import RolloutSpec
from miles.common.telemetry import Metrics
from miles.common.testing import free_port
from miles.proto.common.v1 import common_pb2
from miles.rollout.episode import EpisodeRunner, EpisodeTask
from miles.rollout.ledger import SessionLedger
from miles.rollout.metrics import RolloutMetrics
from miles.rollout.rewards import Scorer
from miles.rollout.sessions import SessionClient
from miles.rollout.sweeper import OrphanSweeper

pytestmark = pytest.mark.integration

JOB_ID = "episode-flow"
Json = dict[str, Any]
COMPLETED, TRUNCATED, ABORTED, FAILED = (
    common_pb2.SAMPLE_STATUS_COMPLETED,
    common_pb2.SAMPLE_STATUS_TRUNCATED,
    common_pb2.SAMPLE_STATUS_ABORTED,
    common_pb2.SAMPLE_STATUS_FAILED,
)


async def ask(base_url: str, metadata: dict[str, Any], messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    client = AsyncOpenAI(base_url=base_url, api_key=metadata["api_key"], max_retries=0)
    try:
        reply = await client.chat.completions.create(model="policy", messages=messages, extra_body=kwargs)
    finally:
        await client.close()
    return reply.choices[0].message.content or ""


async def normal_agent(base_url: str, prompt: Json, kwargs: Json, metadata: Json) -> Any:
    await ask(base_url, metadata, prompt["messages"], kwargs)
    return {"reward": 0.5, "reward_info": {"why": "test"}, "metadata": {"agent_note": "hi"}}


async def two_turn_agent(
    base_url: str, prompt: dict[str, Any], kwargs: dict[str, Any], metadata: dict[str, Any]
) -> Any:
    messages = list(prompt["messages"])
    first = await ask(base_url, metadata, messages, kwargs)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    await ask(base_url, metadata, messages, kwargs)
    return {"reward": 1.0, "turn_rewards": [0.25, 0.75]}


async def raising_agent(base_url: str, prompt: Json, kwargs: Json, metadata: Json) -> Any:
    await ask(base_url, metadata, prompt["messages"], kwargs)
    raise KeyError("the tool broke")


async def list_agent(base_url: str, prompt: Json, kwargs: Json, metadata: Json) -> Any:
    return ["not", "a", "dict"]


async def silent_agent(base_url: str, prompt: Json, kwargs: Json, metadata: Json) -> Any:
    return {"reward": 1.0}


async def slow_agent(base_url: str, prompt: Json, kwargs: Json, metadata: Json) -> Any:
    await ask(base_url, metadata, prompt["messages"], kwargs)
    await asyncio.sleep(30)


@pytest.fixture
async def sessions(services: Any) -> AsyncIterator[SessionClient]:
    client = SessionClient(
        services.session_url, operator_token=services.operator_token, request_timeout_s=30, retry_budget_s=5
    )
    yield client
    await client.close()


def live_sessions(services: Any) -> list[str]:
    headers = {"authorization": f"Bearer {services.operator_token}"}
    reply = httpx.get(f"{services.session_url}/v1/sessions", params={"job_id": JOB_ID}, headers=headers)
    return list(reply.json()["session_ids"])


@pytest.fixture
def spec(make_spec: Callable[..., RolloutSpec]) -> Callable[..., RolloutSpec]:
    def build(**overrides: Any) -> RolloutSpec:
        base: dict[str, Any] = {"request_kwargs": {"max_tokens": 6}, "agent": {"function": "x:y", "timeout_s": 10}}
        return make_spec(**{**base, **overrides})

    return build


@pytest.mark.parametrize(
    ("agent", "status", "reason", "error_part"),
    [
        (raising_agent, ABORTED, "agent_error", "the tool broke"),
        (list_agent, ABORTED, "agent_error", "invalid agent result"),
        (silent_agent, ABORTED, "no_model_call", None),
    ],
)
async def test_agent_failures_become_aborted_samples(
    services: Any, sessions: SessionClient, spec: Callable[..., RolloutSpec], agent: Any, status: int, reason: str,
    error_part: str | None,
) -> None:  # fmt: skip
    runner = runner_for(spec(), sessions, agent)
    outcome = await runner.run(task_for(3))
    assert (outcome.status, outcome.reason) == (status, reason)
    assert all(sample.status == status for sample in outcome.samples)
    assert outcome.samples[0].metadata["status_reason"] == reason
    if error_part is not None:
        assert error_part in outcome.samples[0].metadata["error"]
    assert outcome.samples[0].reward == 0.0, "aborted samples are not scored"
    assert live_sessions(services) == []
    exported = runner.metrics.registry.exposition().decode()
    assert f'miles_rollout_episodes_total{{reason="{reason}",status="ABORTED"}} 1.0' in exported


def task_for(prompt_index: int) -> EpisodeTask:
    return EpisodeTask(
        job_id=JOB_ID,
        group_id=f"{JOB_ID}/e0/p{prompt_index}",
        seq=prompt_index,
        sample_index=1,
        prompt_index=prompt_index,
        epoch=0,
        prompt={"messages": [{"role": "user", "content": "Tell me a story."}]},
        label="3",
    )


def runner_for(spec: RolloutSpec, sessions: SessionClient, agent: Any) -> EpisodeRunner:
    return EpisodeRunner(
        spec,
        sessions=sessions,
        agent=agent,
        scorer=Scorer(spec.reward, job_id=JOB_ID, sandbox=None),
        metrics=RolloutMetrics(Metrics("rollout")),
        worker_id="w-test",
    )


async def test_a_normal_episode_is_scored_and_keeps_agent_metadata(
    services: Any, sessions: SessionClient, spec: Callable[..., RolloutSpec]
) -> None:
    outcome = await runner_for(spec(), sessions, normal_agent).run(task_for(1))
    (sample,) = outcome.samples
    assert outcome.status in (COMPLETED, TRUNCATED) and outcome.reason in ("ok", "truncated")
    assert sample.reward == 0.5 and sample.metadata["reward_info"]["why"] == "test"
    assert sample.metadata["agent_note"] == "hi" and sample.metadata["worker_id"] == "w-test"
    assert sample.group_id == f"{JOB_ID}/e0/p1" and sample.episode_id == f"{JOB_ID}/e0/p1/1"
    assert sample.metadata["job_id"] == JOB_ID and sample.metadata["prompt_index"] == 1
    assert len(sample.weight_versions) == 1 and sum(sample.loss_mask) > 0
    assert live_sessions(services) == []


async def test_an_agent_past_its_timeout_is_cancelled_and_its_session_deleted(
    services: Any, sessions: SessionClient, spec: Callable[..., RolloutSpec]
) -> None:
    # 3 s: the agent's first turn (session server + engine) must finish inside it on a loaded 2-core machine (CI
    # saw 0.5 s pass before it did); its 30 s sleep is what the timeout cuts.
    outcome = await runner_for(spec(agent={"function": "x:y", "timeout_s": 3.0}), sessions, slow_agent).run(task_for(2))
    assert (outcome.status, outcome.reason) == (ABORTED, "timeout") and outcome.duration_s < 20
    assert "timeout of 3 s" in outcome.samples[0].metadata["error"]
    assert outcome.samples[0].metadata["num_turns"] == 1, "what it recorded is kept for inspection"
    assert live_sessions(services) == []


async def test_max_seq_len_truncates_and_aborts_when_nothing_fits(
    services: Any, sessions: SessionClient, spec: Callable[..., RolloutSpec]
) -> None:
    full = await runner_for(spec(), sessions, two_turn_agent).run(task_for(4))
    num_tokens = len(full.samples[0].tokens)  # every turn of the fake engine runs to max_tokens: same length
    cut = await runner_for(spec(max_seq_len=num_tokens - 2), sessions, two_turn_agent).run(task_for(4))
    assert (cut.status, cut.reason) == (TRUNCATED, "truncated") and len(cut.samples[0].tokens) == num_tokens - 2
    assert len(cut.samples[0].weight_versions) == 2 and cut.samples[0].weight_versions[1].end == len(
        cut.samples[0].loss_mask
    )
    nothing = await runner_for(spec(max_seq_len=2), sessions, two_turn_agent).run(task_for(4))
    assert (nothing.status, nothing.reason) == (ABORTED, "all_truncated")
    assert live_sessions(services) == []


async def test_per_turn_samples_carry_their_turn_rewards(
    services: Any, sessions: SessionClient, spec: Callable[..., RolloutSpec]
) -> None:
    outcome = await runner_for(spec(sample_mode="per_turn"), sessions, two_turn_agent).run(task_for(5))
    assert len(outcome.samples) == 2 and [s.reward for s in outcome.samples] == [1.0, 1.0]
    assert [s.token_rewards[-1] for s in outcome.samples] == [0.25, 0.75]
    assert [s.sample_id for s in outcome.samples] == [f"{JOB_ID}/e0/p5/1/turn-0", f"{JOB_ID}/e0/p5/1/turn-1"]
    merged = await runner_for(spec(), sessions, two_turn_agent).run(task_for(5))
    (sample,) = merged.samples
    ends = [span.end - 1 for span in sample.weight_versions]
    assert [sample.token_rewards[i] for i in ends] == [0.25, 0.75] and sum(sample.token_rewards) == 1.0


async def test_a_failing_reward_function_aborts_the_episode(
    services: Any, sessions: SessionClient, spec: Callable[..., RolloutSpec], tmp_path: Path
) -> None:
    (tmp_path / "failing_reward_for_rollout_tests.py").write_text(
        "async def reward(prompt, samples, agent_result):\n    raise ZeroDivisionError('bad reward')\n"
    )
    reward = {"type": "function", "function": "failing_reward_for_rollout_tests:reward", "python_path": [str(tmp_path)]}
    try:
        outcome = await runner_for(spec(reward=reward), sessions, normal_agent).run(task_for(6))
    finally:
        sys.modules.pop("failing_reward_for_rollout_tests", None)
    assert (outcome.status, outcome.reason) == (ABORTED, "reward_error")
    assert "bad reward" in outcome.samples[0].metadata["error"]
    assert live_sessions(services) == []


async def test_an_unreachable_session_server_aborts_after_the_retry_budget(
    spec: Callable[..., RolloutSpec],
) -> None:
    dead = SessionClient(f"http://127.0.0.1:{free_port()}", operator_token="", request_timeout_s=2, retry_budget_s=0.5)
    try:
        outcome = await runner_for(spec(), dead, normal_agent).run(task_for(7))
    finally:
        await dead.close()
    assert (outcome.status, outcome.reason) == (ABORTED, "session_unavailable")
    assert outcome.samples[0].tokens == [0] and outcome.samples[0].response_start == 1


async def test_the_sweeper_deletes_only_old_sessions_no_episode_recorded(
    services: Any, sessions: SessionClient
) -> None:
    job_id = "sweep-job"
    client = aioredis.Redis.from_url(services.redis_url)
    ledger = SessionLedger(client, key_prefix="test:sweep", job_id=job_id)
    sweeper = OrphanSweeper(sessions, ledger, job_id=job_id, min_age_s=0.3, metrics=RolloutMetrics(Metrics("rollout")))
    try:
        recorded = await sessions.create(job_id=job_id, episode_id="recorded", ttl_s=60)
        await ledger.record(7, recorded, ttl_s=60)
        orphan = await sessions.create(job_id=job_id, episode_id="orphan", ttl_s=60)
        await asyncio.sleep(0.5)
        young = await sessions.create(job_id=job_id, episode_id="young", ttl_s=60)
        assert await ledger.known_session_ids() == {recorded.session_id}
        assert await sweeper.sweep() == 1
        remaining = set(await sessions.list_job_sessions(job_id))
        assert remaining == {recorded.session_id, young.session_id} and orphan.session_id not in remaining
        for handle in (recorded, young):
            await sessions.delete(handle)
    finally:
        await client.aclose()


async def test_a_dead_workers_in_flight_episodes_are_counted_aborted_when_their_prompt_is_reclaimed(
    services: Any, sessions: SessionClient, spec: Callable[..., RolloutSpec]
) -> None:
    client = aioredis.Redis.from_url(services.redis_url)
    ledger = SessionLedger(client, key_prefix="test:reclaim", job_id=JOB_ID)
    try:
        left_behind = [await sessions.create(job_id=JOB_ID, episode_id=f"dead-{i}", ttl_s=60) for i in range(3)]
        for handle in left_behind:
            await ledger.record(11, handle, ttl_s=60)
        runner = EpisodeRunner(
            spec(),
            sessions=sessions,
            agent=normal_agent,
            scorer=Scorer(spec().reward, job_id=JOB_ID, sandbox=None),
            metrics=RolloutMetrics(Metrics("rollout")),
            worker_id="w-reclaimer",
            ledger=ledger,
        )
        assert await runner.reap_orphans(11) == 3
        assert await runner.reap_orphans(11) == 0, "each dead episode is counted once"
        assert live_sessions(services) == []
        exported = runner.metrics.registry.exposition().decode()
        assert 'miles_rollout_episodes_total{reason="worker_lost",status="ABORTED"} 3.0' in exported
    finally:
        await client.aclose()
