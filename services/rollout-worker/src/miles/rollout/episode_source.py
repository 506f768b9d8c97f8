"""Where a job's prompts and episodes come from: its own dataset file and agent function, or a hub environment.

`open_episode_source` is the one place the worker (core.py) and the evaluator (evaluate.py) resolve
`rollout.agent` / `rollout.environment` into a `Dataset` and an agent function; `close` releases what it took
(the environment server and its client).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from miles.common.jobspec.rollout import DatasetSpec, RolloutSpec
from miles.rollout.contracts import AgentFn, load_callable
from miles.rollout.dataset import Dataset, load_dataset
from miles.rollout.environment import EnvironmentAgent, EnvironmentServer, environment_rows, start_environment_server
from miles.rollout.metrics import RolloutMetrics
from miles.rollout.settings import RolloutSettings


@dataclass
class EpisodeSource:
    dataset: Dataset
    agent: AgentFn
    environment: EnvironmentServer | None = None
    _closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def close(self) -> None:
        for closer in reversed(self._closers):
            await closer()


async def open_episode_source(
    spec: RolloutSpec,
    settings: RolloutSettings,
    metrics: RolloutMetrics,
    *,
    dataset_spec: DatasetSpec | None = None,
) -> EpisodeSource:
    """`dataset_spec` overrides spec.dataset (the evaluator reads rows in file order)."""
    dataset_spec = dataset_spec or spec.dataset
    if spec.environment is None:
        assert spec.agent is not None, "validated by RolloutSpec: an agent or an environment"
        agent: AgentFn = load_callable(spec.agent.function, spec.agent.python_path, what="rollout.agent.function")
        return EpisodeSource(load_dataset(dataset_spec), agent)
    server = await start_environment_server(spec.environment, settings, metrics)
    rows = environment_rows(server, dataset_spec.prompt_key, dataset_spec.label_key)
    if dataset_spec.limit is not None:
        rows = rows[: dataset_spec.limit]
    try:
        dataset = Dataset(dataset_spec, rows, extra_fingerprint=f"environment={server.digest}")
    except BaseException:
        await server.stop()
        raise
    environment_agent = EnvironmentAgent(server, dataset_spec.prompt_key)
    return EpisodeSource(dataset, environment_agent, server, [server.stop, environment_agent.close])
