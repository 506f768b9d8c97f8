"""Evaluation: a job's agent and reward on held-out prompts, greedy, through the real session server.

`evaluate` runs one episode per prompt of a dataset with the rollout spec's agent, reward and limits, but with
`temperature: 0` (greedy: the same weights give the same answers), against whatever engine pool the session
server's job config `job_id` names, and returns the mean reward. It is the same `EpisodeRunner` a rollout worker
runs, so an evaluated episode is exactly a training episode minus the sampling noise; nothing is pushed to the
buffer. Used by `miles eval` (and `make run`) to compare a model before and after training.

Limits: one pass over at most `limit` prompts, `concurrency` at a time; an episode that fails (agent error,
timeout) scores 0 and is counted by its reason. With `rollout.roles` a prompt's reward is its first role's.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from miles.common.jobspec.rollout import RolloutSpec
from miles.common.telemetry import Metrics
from miles.rollout.episode import EpisodeRunner, EpisodeTask
from miles.rollout.episode_source import open_episode_source
from miles.rollout.metrics import RolloutMetrics
from miles.rollout.rewards import Scorer
from miles.rollout.sandbox import SandboxClient, sandbox_metadata
from miles.rollout.sessions import SessionClient
from miles.rollout.settings import RolloutSettings


@dataclass(frozen=True)
class EvalResult:
    """Mean reward over the prompts (failed episodes count 0), each prompt's reward, and why episodes ended."""

    mean_reward: float
    rewards: list[float]
    reasons: dict[str, int] = field(default_factory=dict)

    @property
    def num_prompts(self) -> int:
        return len(self.rewards)


def greedy(spec: RolloutSpec) -> RolloutSpec:
    """The spec with greedy decoding (temperature 0, no nucleus/top-k filtering)."""
    kwargs: dict[str, Any] = {**spec.request_kwargs, "temperature": 0.0}
    for key in ("top_p", "top_k", "min_p"):
        kwargs.pop(key, None)
    return spec.model_copy(update={"request_kwargs": kwargs})


async def evaluate(
    spec: RolloutSpec,
    *,
    job_id: str,
    session_url: str,
    operator_token: str,
    sandbox_http_url: str = "",
    sandbox_address: str = "",
    sandbox_token: str = "",
    limit: int | None = None,
    concurrency: int = 8,
) -> EvalResult:
    """Greedy episodes over the dataset of `spec` (its first `limit` rows, in file order)."""
    spec = greedy(spec)
    metrics = RolloutMetrics(Metrics("rollout"))
    source = await open_episode_source(
        spec,
        RolloutSettings(),  # MILES_ROLLOUT_ENVS_DIR etc. from the environment, for a job with a hub environment
        metrics,
        dataset_spec=spec.dataset.model_copy(update={"shuffle": False, "limit": limit}),
    )
    dataset, agent = source.dataset, source.agent
    sandbox = SandboxClient(sandbox_address, token=sandbox_token) if sandbox_address else None
    sessions = SessionClient(session_url, operator_token=operator_token, request_timeout_s=120.0, retry_budget_s=30.0)
    extra = sandbox_metadata(sandbox_http_url, sandbox_address, sandbox_token)
    runner = EpisodeRunner(
        spec,
        sessions=sessions,
        agent=agent,
        scorer=Scorer(spec.reward, job_id=job_id, sandbox=sandbox),
        metrics=metrics,
        worker_id="eval",
        agent_extra_metadata=extra,
    )
    slots = asyncio.Semaphore(concurrency)

    async def one(index: int) -> tuple[float, str]:
        task = EpisodeTask(job_id, f"eval-{index}", index, 0, index, 0, dataset.prompt(index), dataset.label(index))
        async with slots:
            outcome = await runner.run(task)
        if outcome.reason != "ok" or not outcome.samples:
            return 0.0, outcome.reason
        return float(outcome.samples[0].reward), outcome.reason

    try:
        results = await asyncio.gather(*(one(i) for i in range(len(dataset))))
    finally:
        await runner.drain()
        await source.close()
        await sessions.close()
        if sandbox is not None:
            await sandbox.close()
    rewards = [reward for reward, _ in results]
    return EvalResult(sum(rewards) / max(1, len(rewards)), rewards, dict(Counter(reason for _, reason in results)))
