"""Multi-agent episodes (`rollout.roles`) against a real session server and engine (subprocesses): a session per
role handed to the agent, every sample labelled with its role, rewards per role (and bad mappings), every
session recorded in the ledger while it lives and deleted at the end whatever happened; plus the role-aware group
filter, the job spec's checks and the solver-verifier example's reward."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI
from pydantic import ValidationError

from miles.common.jobspec.rollout import GroupFilterSpec, RolloutSpec
from miles.common.telemetry import Metrics
from miles.proto.common.v1 import common_pb2
from miles.rollout import groups
from miles.rollout.contracts import load_callable
from miles.rollout.episode import EpisodeRunner, EpisodeTask
from miles.rollout.ledger import SessionLedger
from miles.rollout.metrics import RolloutMetrics
from miles.rollout.rewards import Scorer
from miles.rollout.sessions import SessionClient

pytestmark = pytest.mark.integration

JOB_ID = "roles-job"
SOLVER_ONLY_JOB_ID = "roles-solver-only"
ROLES = ["solver", "verifier"]
REPO_ROOT = Path(__file__).resolve().parents[3]
COMPLETED, TRUNCATED, ABORTED = (
    common_pb2.SAMPLE_STATUS_COMPLETED,
    common_pb2.SAMPLE_STATUS_TRUNCATED,
    common_pb2.SAMPLE_STATUS_ABORTED,
)
Json = dict[str, Any]
REWARD_MODULE = "async def reward(prompt, samples, agent_result):\n    return agent_result['rewards']\n"
"""The reward function of these tests: whatever the agent says (so that each test picks the reward's shape)."""


async def ask(session: Json, text: str) -> str:
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    try:
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": text}], extra_body={"max_tokens": 4}
        )
    finally:
        await client.close()
    return reply.choices[0].message.content or ""


def both_roles_agent(rewards: Any, seen: list[Json]) -> Any:
    """An agent that calls the model in every role's session and returns `rewards` for the reward function."""

    async def agent(base_url: str, prompt: Json, kwargs: Json, metadata: Json) -> Json:
        seen.append({"base_url": base_url, **metadata})
        for role, session in metadata["roles"].items():
            await ask(session, f"You are the {role}.")
        return {"rewards": rewards, "metadata": {"role": "overwritten-by-the-agent"}}

    return agent


@pytest.fixture(scope="module")
def registered(services: Any, qwen3_model_dir: Path) -> Any:
    """The session server's job configs: one declaring both roles, one declaring only the solver."""
    headers = {"authorization": f"Bearer {services.operator_token}"}
    for job_id, roles in ((JOB_ID, ROLES), (SOLVER_ONLY_JOB_ID, ["solver"])):
        body = {"model_path": str(qwen3_model_dir), "model_family": "qwen3", "roles": roles}
        reply = httpx.put(f"{services.session_url}/v1/jobs/{job_id}/config", json=body, headers=headers, timeout=60)
        assert reply.status_code == 200, reply.text
    return services


@pytest.fixture
async def sessions(registered: Any) -> AsyncIterator[SessionClient]:
    client = SessionClient(
        registered.session_url, operator_token=registered.operator_token, request_timeout_s=30, retry_budget_s=2
    )
    yield client
    await client.close()


@pytest.fixture
async def ledger(registered: Any) -> AsyncIterator[SessionLedger]:
    client = aioredis.Redis.from_url(registered.redis_url)
    yield SessionLedger(client, key_prefix="test:roles", job_id=JOB_ID)
    await client.aclose()


@pytest.fixture
def reward_dir(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "roles_reward_for_rollout_tests.py").write_text(REWARD_MODULE)
    yield tmp_path
    sys.modules.pop("roles_reward_for_rollout_tests", None)


@pytest.fixture
def spec(make_spec: Callable[..., RolloutSpec], reward_dir: Path) -> Callable[..., RolloutSpec]:
    def build(**overrides: Any) -> RolloutSpec:
        function = "roles_reward_for_rollout_tests:reward"
        reward = {"type": "function", "function": function, "python_path": [str(reward_dir)]}
        base: Json = {"agent": {"function": "x:y", "timeout_s": 10}, "roles": ROLES, "reward": reward}
        return make_spec(**{**base, **overrides})

    return build


def live_sessions(services: Any, job_id: str = JOB_ID) -> list[str]:
    headers = {"authorization": f"Bearer {services.operator_token}"}
    reply = httpx.get(f"{services.session_url}/v1/sessions", params={"job_id": job_id}, headers=headers)
    return list(reply.json()["session_ids"])


def task_for(prompt_index: int, job_id: str = JOB_ID) -> EpisodeTask:
    return EpisodeTask(
        job_id=job_id,
        group_id=f"{job_id}/e0/p{prompt_index}",
        seq=prompt_index,
        sample_index=0,
        prompt_index=prompt_index,
        epoch=0,
        prompt={"messages": [{"role": "user", "content": "What is 2 + 2?"}]},
        label="4",
    )


def runner_for(spec: RolloutSpec, sessions: SessionClient, agent: Any, ledger: SessionLedger | None = None) -> Any:
    return EpisodeRunner(
        spec,
        sessions=sessions,
        agent=agent,
        scorer=Scorer(spec.reward, job_id=JOB_ID, sandbox=None),
        metrics=RolloutMetrics(Metrics("rollout")),
        worker_id="w-roles",
        ledger=ledger,
    )


async def test_an_episode_gets_a_session_per_role_and_each_role_its_reward(
    registered: Any, sessions: SessionClient, spec: Callable[..., RolloutSpec], ledger: SessionLedger
) -> None:
    seen: list[Json] = []
    runner = runner_for(spec(), sessions, both_roles_agent({"solver": 1.0, "verifier": 0.25}, seen), ledger)

    async def agent_checking_the_ledger(base_url: str, prompt: Json, kwargs: Json, metadata: Json) -> Any:
        recorded = await ledger.known_session_ids()
        assert recorded == {session["session_id"] for session in metadata["roles"].values()}
        assert set(live_sessions(registered)) == recorded
        return await both_roles_agent({"solver": 1.0, "verifier": 0.25}, seen)(base_url, prompt, kwargs, metadata)

    runner.agent = agent_checking_the_ledger
    outcome = await runner.run(task_for(1))

    assert (outcome.status, outcome.reason) in ((COMPLETED, "ok"), (TRUNCATED, "truncated")), outcome.samples
    (metadata,) = seen
    assert sorted(metadata["roles"]) == ROLES and len({s["session_id"] for s in metadata["roles"].values()}) == 2
    solver = metadata["roles"]["solver"]
    assert (metadata["base_url"], metadata["api_key"], metadata["session_id"]) == (
        solver["base_url"],
        solver["api_key"],
        solver["session_id"],
    ), "the plain arguments are the first declared role's"
    by_role = {sample.metadata["role"]: sample for sample in outcome.samples}
    assert sorted(by_role) == ROLES and len(outcome.samples) == 2, "the agent's metadata cannot relabel a role"
    assert (by_role["solver"].reward, by_role["verifier"].reward) == (1.0, 0.25)
    episode_id = f"{JOB_ID}/e0/p1/0"
    assert {s.episode_id for s in outcome.samples} == {episode_id}
    assert sorted(s.sample_id for s in outcome.samples) == [f"{episode_id}/solver", f"{episode_id}/verifier"]
    assert all(sum(s.loss_mask) > 0 and s.metadata["worker_id"] == "w-roles" for s in outcome.samples)
    assert live_sessions(registered) == [] and await ledger.known_session_ids() == set()
    exported = runner.metrics.registry.exposition().decode()
    assert 'miles_rollout_sample_reward_bucket{le="0.25",role="verifier"} 1.0' in exported
    assert 'miles_rollout_sample_reward_bucket{le="0.9",role="solver"} 0.0' in exported
    assert 'miles_rollout_sample_reward_count{role="solver"} 1.0' in exported


async def test_a_float_reward_goes_to_every_role_and_per_turn_samples_keep_their_role(
    registered: Any, sessions: SessionClient, spec: Callable[..., RolloutSpec]
) -> None:
    outcome = await runner_for(spec(sample_mode="per_turn"), sessions, both_roles_agent(0.5, [])).run(task_for(2))
    assert [(s.metadata["role"], s.reward) for s in outcome.samples] == [("solver", 0.5), ("verifier", 0.5)]
    assert [s.sample_id for s in outcome.samples] == [
        f"{JOB_ID}/e0/p2/0/solver/turn-0",
        f"{JOB_ID}/e0/p2/0/verifier/turn-0",
    ]
    assert live_sessions(registered) == []


@pytest.mark.parametrize(
    ("rewards", "error_part"),
    [
        ({"solver": 1.0}, "missing ['verifier']"),
        ({"solver": 1.0, "verifier": 0.0, "judge": 1.0}, "unknown ['judge']"),
        ({"solver": 1.0, "verifier": "high"}, "role 'verifier' must be a number"),
    ],
)
async def test_rewards_per_role_that_do_not_fit_the_roles_abort_the_episode_as_bad_reward(
    registered: Any, sessions: SessionClient, spec: Callable[..., RolloutSpec], rewards: Json, error_part: str
) -> None:
    runner = runner_for(spec(), sessions, both_roles_agent(rewards, []))
    outcome = await runner.run(task_for(3))
    assert (outcome.status, outcome.reason) == (ABORTED, "bad_reward")
    assert sorted(s.metadata["role"] for s in outcome.samples) == ROLES
    assert all(s.status == ABORTED and s.reward == 0.0 for s in outcome.samples)
    assert error_part in outcome.samples[0].metadata["error"]
    assert live_sessions(registered) == []
    exported = runner.metrics.registry.exposition().decode()
    assert 'miles_rollout_episodes_total{reason="bad_reward",status="ABORTED"} 1.0' in exported


async def test_rewards_per_role_in_a_job_without_roles_are_a_bad_reward(
    registered: Any, sessions: SessionClient, spec: Callable[..., RolloutSpec]
) -> None:
    async def agent(base_url: str, prompt: Json, kwargs: Json, metadata: Json) -> Json:
        assert "roles" not in metadata
        await ask({"base_url": base_url, "api_key": metadata["api_key"]}, "Hello.")
        return {"rewards": {"solver": 1.0}}

    outcome = await runner_for(spec(roles=[]), sessions, agent).run(task_for(4))
    assert (outcome.status, outcome.reason) == (ABORTED, "bad_reward")
    assert "declares no rollout.roles" in outcome.samples[0].metadata["error"]
    assert "role" not in outcome.samples[0].metadata and outcome.samples[0].sample_id == f"{JOB_ID}/e0/p4/0"


async def test_a_role_that_never_called_the_model_aborts_the_whole_episode(
    registered: Any, sessions: SessionClient, spec: Callable[..., RolloutSpec]
) -> None:
    async def solver_only(base_url: str, prompt: Json, kwargs: Json, metadata: Json) -> Json:
        await ask(metadata["roles"]["solver"], "Solve it.")
        return {"rewards": 1.0}

    outcome = await runner_for(spec(), sessions, solver_only).run(task_for(5))
    assert (outcome.status, outcome.reason) == (ABORTED, "no_model_call")
    assert all(s.status == ABORTED for s in outcome.samples) and len(outcome.samples) == 2
    assert "role 'verifier'" in outcome.samples[0].metadata["error"]
    assert live_sessions(registered) == []


async def test_every_role_session_is_deleted_after_an_agent_error_and_a_cancellation(
    registered: Any, sessions: SessionClient, spec: Callable[..., RolloutSpec], ledger: SessionLedger
) -> None:
    async def raising(base_url: str, prompt: Json, kwargs: Json, metadata: Json) -> Json:
        for session in metadata["roles"].values():
            await ask(session, "Go.")
        raise RuntimeError("the verifier tool broke")

    failed = await runner_for(spec(), sessions, raising, ledger).run(task_for(6))
    assert (failed.status, failed.reason) == (ABORTED, "agent_error")
    assert sorted(s.metadata["role"] for s in failed.samples) == ROLES
    assert all("the verifier tool broke" in s.metadata["error"] for s in failed.samples)
    assert live_sessions(registered) == [] and await ledger.known_session_ids() == set()

    started = asyncio.Event()

    async def hanging(base_url: str, prompt: Json, kwargs: Json, metadata: Json) -> Json:
        started.set()
        await asyncio.sleep(60)
        return {}

    runner = runner_for(spec(), sessions, hanging, ledger)
    episode = asyncio.create_task(runner.run(task_for(7)))
    await asyncio.wait_for(started.wait(), 10)
    assert len(live_sessions(registered)) == 2 and len(await ledger.known_session_ids()) == 2
    episode.cancel()
    with pytest.raises(asyncio.CancelledError):
        await episode
    await runner.drain()
    assert live_sessions(registered) == [] and await ledger.known_session_ids() == set()


async def test_a_session_whose_create_a_cancelled_episode_stopped_waiting_for_is_deleted_once_made(
    registered: Any, sessions: SessionClient, spec: Callable[..., RolloutSpec]
) -> None:
    real_create = sessions.create
    verifier_created = asyncio.Event()

    async def late_reply_create(**kwargs: Any) -> Any:
        handle = await real_create(**kwargs)  # made on the server; its reply is late
        if kwargs["role"] == "verifier":
            verifier_created.set()
            await asyncio.sleep(0.5)
        return handle

    sessions.create = late_reply_create  # type: ignore[method-assign]
    runner = runner_for(spec(), sessions, both_roles_agent(0.0, []))
    episode = asyncio.create_task(runner.run(task_for(9)))
    await asyncio.wait_for(verifier_created.wait(), 10)
    assert len(live_sessions(registered)) == 2
    episode.cancel()  # e.g. the worker shuts down while the verifier's create is in flight
    with pytest.raises(asyncio.CancelledError):
        await episode
    await runner.drain()
    assert live_sessions(registered) == [], "the solver's session and the late verifier's are both deleted"


async def test_a_role_the_job_config_does_not_declare_deletes_the_sessions_made_before_it(
    registered: Any, sessions: SessionClient, spec: Callable[..., RolloutSpec]
) -> None:
    called: list[bool] = []

    async def agent(base_url: str, prompt: Json, kwargs: Json, metadata: Json) -> Json:
        called.append(True)
        return {}

    outcome = await runner_for(spec(), sessions, agent).run(task_for(8, SOLVER_ONLY_JOB_ID))
    assert (outcome.status, outcome.reason) == (ABORTED, "session_unavailable") and called == []
    assert [s.metadata["role"] for s in outcome.samples] == ROLES, "a placeholder per role"
    assert "'verifier' is not a role of job" in outcome.samples[0].metadata["error"]
    assert live_sessions(registered, SOLVER_ONLY_JOB_ID) == [], "the solver's session was deleted"


async def test_a_dead_workers_role_sessions_are_all_reaped_and_counted_per_episode(
    registered: Any, sessions: SessionClient, spec: Callable[..., RolloutSpec], ledger: SessionLedger
) -> None:
    for index in range(2):  # two episodes of the dead worker, a session per role each
        for role in ROLES:
            handle = await sessions.create(job_id=JOB_ID, episode_id=f"dead-{index}", ttl_s=60, role=role)
            await ledger.record(21, handle, ttl_s=60)
    runner = runner_for(spec(), sessions, both_roles_agent(0.0, []), ledger)
    assert await runner.reap_orphans(21) == 4
    assert live_sessions(registered) == []
    exported = runner.metrics.registry.exposition().decode()
    assert 'miles_rollout_episodes_total{reason="worker_lost",status="ABORTED"} 2.0' in exported


def role_sample(role: str, reward: float) -> common_pb2.Sample:
    sample = common_pb2.Sample(status=COMPLETED, reward=reward)
    sample.metadata.update({"role": role})
    return sample


def test_the_equal_rewards_filter_looks_within_each_role() -> None:
    drop = GroupFilterSpec(drop_equal_rewards=True)
    constant_per_role = [role_sample("solver", 1.0), role_sample("solver", 1.0), role_sample("verifier", 0.0)]
    assert groups.filter_reason(constant_per_role, drop) == "equal_rewards", "no role has a signal"
    varied_verifier = [*constant_per_role, role_sample("verifier", 1.0)]
    assert groups.filter_reason(varied_verifier, drop) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"roles": ["solver", "solver"]}, "roles must be unique"),
        ({"roles": ["has space"]}, "roles.0"),
        ({"roles": [f"r{i}" for i in range(9)]}, "at most 8"),
        (
            {"agent": None, "dataset": {}, "environment": {"connector": "reasoning_gym"}, "roles": ["a"]},
            "rollout.roles needs rollout.agent",
        ),
    ],
)
def test_the_job_spec_checks_roles(change: Json, message: str) -> None:
    section: Json = {"dataset": {"path": "d.jsonl"}, "agent": {"function": "pkg.mod:agent"}, **change}
    section = {key: value for key, value in section.items() if value is not None}
    with pytest.raises(ValidationError, match=message):
        RolloutSpec.model_validate(section)
    accepted = RolloutSpec.model_validate(
        {"dataset": {"path": "d.jsonl"}, "agent": {"function": "pkg.mod:agent"}, "roles": ROLES, "tree_sessions": True}
    )
    assert accepted.roles == ROLES and accepted.tree_sessions


@pytest.mark.parametrize(
    ("answer", "verdict", "expected"),
    [
        ("Answer: 4", "Verdict: correct", {"solver": 1.0, "verifier": 1.0}),
        ("Answer: 5", "Verdict: correct", {"solver": 0.1, "verifier": 0.1}),
        ("Answer: 5", "Verdict: Incorrect", {"solver": 0.1, "verifier": 1.0}),
        ("no idea", "Verdict: incorrect", {"solver": 0.0, "verifier": 1.0}),
        ("2 + 2 is 4", "Verdict: incorrect", {"solver": 1.0, "verifier": 0.1}),
        ("Answer: 4", "it looks fine", {"solver": 1.0, "verifier": 0.0}),
    ],
)
def test_the_solver_verifier_example_rewards_each_role(answer: str, verdict: str, expected: Json) -> None:
    reward = load_callable("solver_verifier.reward:reward", [str(REPO_ROOT / "examples")], what="reward")
    result = asyncio.run(reward({"label": "4"}, [], {"answer": answer, "verdict_text": verdict}))
    assert result == expected
