"""Asynchronous evaluation per weight version on the job's own engines (`JobSpec.evaluation`, mode (a)).

Every worker of the job runs it next to its rollout scheduler (`RolloutSettings.evaluation_enabled`, on by default);
each due version is evaluated by the one worker that claims it in Redis first (`EvalLoop._claim`):

- **Which version is live**: `VersionWatch` wraps the scheduler's episode function and reads the weight versions
  of every finished rollout episode's samples (each recorded turn carries the version it was served at). The
  newest one seen is the engines' version as far as this worker can tell; nothing else has to report it.
- **Pinning**: an evaluation episode's sessions are created with metadata `min_weight_version: v`, which the
  session server sends on each turn as `X-Miles-Min-Weight-Version` (the router and the engine then serve it at
  `v` or newer, never older). After the episode, every span of its samples must be exactly `v`; an episode with a
  turn served at another version is discarded and counted (`num_discarded`), never scored as `v`. A version
  whose episodes were all discarded, or that the engines had left before this worker got to it, is recorded
  `missed`.
- **Capacity**: at most `ceil(capacity_share * max_live_episodes)` evaluation episodes run at once, on top of
  the worker's rollout episodes. With engines saturated and requests served alike, rollout keeps at least
  `1 / (1 + capacity_share) >= 1 - capacity_share` of its throughput while a version is evaluated, and all of it
  in between.
- **Results**: one `VersionEval` per evaluated version in Redis (`miles.common.contracts.evals`), written once
  after the whole version; a version already there is not evaluated again (a restarted worker resumes). Nothing
  is pushed to the buffer.

Limits: versions are evaluated one at a time, newest first when several are due (older due versions the engines
have left are recorded missed); `lag_s` counts from the worker's first sighting of the version (see VersionEval).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import redis.asyncio as aioredis

from miles.common.contracts import evals as contract
from miles.common.contracts.headers import SESSION_MIN_WEIGHT_VERSION_KEY
from miles.common.jobspec.evaluation import EvalDatasetSpec, EvaluationSpec
from miles.common.jobspec.rollout import RolloutSpec
from miles.common.telemetry import Metrics
from miles.rollout import samples as sample_ops
from miles.rollout.dataset import Dataset, load_dataset
from miles.rollout.environment import environment_rows
from miles.rollout.episode import EpisodeOutcome, EpisodeRunner, EpisodeTask
from miles.rollout.episode_source import EpisodeSource
from miles.rollout.evaluate import greedy
from miles.rollout.metrics import EvalMetrics, RolloutMetrics
from miles.rollout.rewards import Scorer
from miles.rollout.sandbox import SandboxClient, sandbox_metadata
from miles.rollout.sessions import SessionClient, SessionHandle
from miles.rollout.settings import RolloutSettings

log = logging.getLogger(__name__)
CLAIM_TTL_S = 3600.0
"""How long a version's evaluation claim holds (a claimant that died frees the version after this long)."""

EpisodeFn = Callable[[EpisodeTask], Awaitable[EpisodeOutcome]]


class VersionWatch:
    """The newest weight version seen in this worker's finished rollout episodes, and when each was first seen."""

    def __init__(self) -> None:
        self.newest: int | None = None
        self.seen_unix_ms: dict[int, int] = {}
        self.changed = asyncio.Event()

    def note(self, versions: set[int]) -> None:
        now_ms = int(time.time() * 1000)
        for version in versions:
            self.seen_unix_ms.setdefault(version, now_ms)
        if versions and (self.newest is None or max(versions) > self.newest):
            self.newest = max(versions)
            self.changed.set()

    def wrap(self, run_episode: EpisodeFn) -> EpisodeFn:
        """`run_episode`, noting the versions of each outcome's samples."""

        async def run(task: EpisodeTask) -> EpisodeOutcome:
            outcome = await run_episode(task)
            self.note(sample_ops.weight_versions(outcome.samples))
            return outcome

        return run


class PinnedSessionClient(SessionClient):
    """A session client whose sessions are pinned to `min_weight_version` (set before each evaluated version)."""

    min_weight_version: int = 0

    async def create(
        self,
        *,
        job_id: str,
        episode_id: str,
        ttl_s: float,
        metadata: dict[str, Any] | None = None,
        role: str = "",
    ) -> SessionHandle:
        pinned = {**(metadata or {}), SESSION_MIN_WEIGHT_VERSION_KEY: self.min_weight_version}
        return await super().create(job_id=job_id, episode_id=episode_id, ttl_s=ttl_s, metadata=pinned, role=role)


def eval_concurrency(spec: EvaluationSpec, max_live_episodes: int) -> int:
    """Evaluation episodes at once: `capacity_share` of the worker's rollout slots, at least one."""
    return max(1, math.ceil(spec.capacity_share * max_live_episodes - 1e-9))


def only_version(outcome: EpisodeOutcome, version: int) -> bool | None:
    """True: every turn of the episode was served at `version`; False: some turn at another one; None: no turn
    was served (a failed episode with nothing recorded, which no version can be blamed for)."""
    versions = sample_ops.weight_versions(outcome.samples)
    if not versions:
        return None
    return versions == {version}


def score_dataset(
    rewards: list[list[float]], spec: EvaluationSpec, discarded: int, reasons: Counter[str]
) -> contract.DatasetEval:
    """A DatasetEval from the kept episodes' rewards per prompt (prompts with no kept episode are left out)."""
    kept = [prompt for prompt in rewards if prompt]
    flat = [reward for prompt in kept for reward in prompt]
    pass_at = {}
    for k in spec.pass_at_k:
        scores = [contract.pass_at_k(len(p), sum(r >= spec.pass_threshold for r in p), k) for p in kept if len(p) >= k]
        pass_at[str(k)] = sum(scores) / len(scores) if scores else 0.0
    return contract.DatasetEval(
        mean_reward=sum(flat) / len(flat) if flat else 0.0,
        pass_at_k=pass_at,
        num_prompts=len(kept),
        num_episodes=len(flat),
        num_discarded=discarded,
        reasons=dict(reasons),
    )


class EvalLoop:
    """Evaluates due versions as the worker sees them served; see the module docstring."""

    def __init__(
        self,
        spec: EvaluationSpec,
        rollout: RolloutSpec,
        *,
        job_id: str,
        runner: EpisodeRunner,
        sessions: PinnedSessionClient,
        source: EpisodeSource,
        redis_client: aioredis.Redis,
        metrics: EvalMetrics,
        max_live_episodes: int,
        worker_id: str = "",
        claim_ttl_s: float = CLAIM_TTL_S,
    ) -> None:
        self.worker_id, self.claim_ttl_s = worker_id, claim_ttl_s
        self.spec, self.rollout, self.job_id = spec, rollout, job_id
        self.runner, self.sessions, self.source = runner, sessions, source
        self.redis, self.metrics = redis_client, metrics
        self.watch = VersionWatch()
        self.concurrency = eval_concurrency(spec, max_live_episodes)
        self._datasets: dict[str, Dataset] = {}
        self._considered = -1
        """Versions up to this one were evaluated, found done or recorded missed."""

    @staticmethod
    def runner_spec(spec: EvaluationSpec, rollout: RolloutSpec) -> RolloutSpec:
        """The rollout spec evaluation episodes run with: greedy unless `greedy` is false; never regenerated (a
        rerun of an episode the engines moved past would run at the newer version anyway)."""
        base = greedy(rollout) if spec.greedy else rollout
        partial = base.partial_rollout.model_copy(update={"policy": "keep_per_span"})
        return base.model_copy(update={"partial_rollout": partial})

    async def run(self) -> None:
        """Forever: wait for a newer version, then evaluate the due ones (until cancelled)."""
        while True:
            await self.watch.changed.wait()
            self.watch.changed.clear()
            newest = self.watch.newest
            if newest is None or newest <= self._considered:
                continue
            try:
                await self._consider(newest)
            except Exception:
                log.exception("evaluation failed; retried at the next version", extra={"job_id": self.job_id})

    async def _consider(self, newest: int) -> None:
        done = {int(v) for v in await self.redis.hkeys(contract.evals_key(self.job_id))}
        for version in range(self._considered + 1, newest):
            if self.spec.due(version) and version not in done:
                await self._write(self._missed(version))
        self._considered = newest
        if self.spec.due(newest) and newest not in done and await self._claim(newest):
            await self._write(await self.evaluate(newest))

    async def _claim(self, version: int) -> bool:
        """Whether this worker evaluates `version`: every worker of the job runs the loop (Kubernetes' rollout
        workers are identical pods), and the first to claim a version in Redis takes it. A claimant that dies
        mid-way leaves the version to whichever worker reaches it after the claim's TTL; one that already moved on
        records it `missed` only if nobody scored it."""
        key = contract.eval_claim_key(self.job_id, version)
        return bool(await self.redis.set(key, self.worker_id or "worker", nx=True, ex=int(self.claim_ttl_s)))

    def _missed(self, version: int) -> contract.VersionEval:
        now_ms = int(time.time() * 1000)
        seen_ms = self.watch.seen_unix_ms.get(version, now_ms)
        return contract.VersionEval(version, "missed", now_ms, seen_ms, (now_ms - seen_ms) / 1000)

    async def evaluate(self, version: int) -> contract.VersionEval:
        """Every dataset at `version` (episodes pinned to it); `missed` when no episode could be kept."""
        self.sessions.min_weight_version = version
        scored = {}
        for dataset_spec in self.spec.datasets:
            scored[dataset_spec.name] = await self._evaluate_dataset(dataset_spec, version)
        now_ms = int(time.time() * 1000)
        seen_ms = self.watch.seen_unix_ms.get(version, now_ms)
        status: Literal["scored", "missed"] = "scored" if any(d.num_episodes for d in scored.values()) else "missed"
        return contract.VersionEval(version, status, now_ms, seen_ms, (now_ms - seen_ms) / 1000, scored)

    async def _evaluate_dataset(self, dataset_spec: EvalDatasetSpec, version: int) -> contract.DatasetEval:
        dataset = self._dataset(dataset_spec)
        num_prompts = min(len(dataset), dataset_spec.limit or len(dataset))
        slots = asyncio.Semaphore(self.concurrency)
        rewards: list[list[float]] = [[] for _ in range(num_prompts)]
        reasons: Counter[str] = Counter()
        discarded = 0

        async def one(index: int, sample_index: int) -> None:
            nonlocal discarded
            group = f"eval-v{version}-{dataset_spec.name}-{index}"
            task = EpisodeTask(
                self.job_id, group, index, sample_index, index, 0, dataset.prompt(index), dataset.label(index)
            )
            async with slots:
                outcome = await self.runner.run(task)
            if only_version(outcome, version) is False:
                discarded += 1
                self.metrics.episodes.labels(outcome="discarded").inc()
                return
            self.metrics.episodes.labels(outcome="scored").inc()
            reasons[outcome.reason] += 1
            ok = outcome.reason == "ok" and outcome.samples
            rewards[index].append(float(outcome.samples[0].reward) if ok else 0.0)

        n = self.spec.n_samples_per_prompt
        await asyncio.gather(*(one(i, s) for i in range(num_prompts) for s in range(n)))
        return score_dataset(rewards, self.spec, discarded, reasons)

    def _dataset(self, spec: EvalDatasetSpec) -> Dataset:
        """The dataset's rows in file order (an environment job's rows come from its running environment)."""
        if spec.name not in self._datasets:
            dataset_spec = spec.dataset.model_copy(update={"shuffle": False})
            if self.source.environment is None:
                self._datasets[spec.name] = load_dataset(dataset_spec)
            else:
                rows = environment_rows(self.source.environment, dataset_spec.prompt_key, dataset_spec.label_key)
                self._datasets[spec.name] = Dataset(dataset_spec, rows[: dataset_spec.limit])
        return self._datasets[spec.name]

    async def _write(self, result: contract.VersionEval) -> None:
        """Store `result`: a `missed` only where the version has nothing; a score unless another one is there (an
        external evaluator's, `POST /v1/jobs/{id}/evals`), replacing a `missed` another worker wrote."""
        if result.status == "missed":
            key, field = contract.evals_key(self.job_id), str(result.version)
            stored = bool(await self.redis.hsetnx(key, field, result.to_json()))
        else:
            stored = await contract.store_scored(self.redis, self.job_id, result)
        if not stored:
            log.info("version already stored", extra={"job_id": self.job_id, "version": result.version})
            return
        self.metrics.versions.labels(status=result.status).inc()
        self.metrics.version.set(result.version)
        self.metrics.lag_s.set(result.lag_s)
        for name, scored in result.datasets.items():
            self.metrics.reward.labels(dataset=name).set(scored.mean_reward)
        log.info(
            "evaluated version",
            extra={"job_id": self.job_id, "version": result.version, "status": result.status, "lag_s": result.lag_s},
        )

    async def close(self) -> None:
        await self.runner.drain()
        await self.sessions.close()
        if self.runner.scorer.sandbox is not None:
            await self.runner.scorer.sandbox.close()


def build_eval_loop(
    settings: RolloutSettings,
    spec: EvaluationSpec,
    rollout: RolloutSpec,
    source: EpisodeSource,
    redis_client: aioredis.Redis,
    metrics: RolloutMetrics,
) -> EvalLoop:
    """The worker's EvalLoop: an EpisodeRunner of its own (pinned sessions, the eval request kwargs, episode
    metrics in an unexported registry so that `miles_rollout_episodes_total` stays rollout's), the same agent
    and reward."""
    sessions = PinnedSessionClient(
        settings.session_server_url,
        operator_token=settings.session_operator_token.get_secret_value(),
        request_timeout_s=settings.session_request_timeout_s,
        retry_budget_s=settings.retry_budget_s,
    )
    token = settings.sandbox_token.get_secret_value()
    sandbox = SandboxClient(settings.sandbox_address, token=token) if settings.sandbox_address else None
    runner_spec = EvalLoop.runner_spec(spec, rollout)
    runner = EpisodeRunner(
        runner_spec,
        sessions=sessions,
        agent=source.agent,
        scorer=Scorer(rollout.reward, job_id=settings.job_id, sandbox=sandbox),
        metrics=RolloutMetrics(Metrics("rollout")),
        worker_id=f"{settings.worker_id}-eval",
        agent_extra_metadata=sandbox_metadata(settings.sandbox_http_url, settings.sandbox_address, token),
    )
    return EvalLoop(
        spec,
        rollout,
        job_id=settings.job_id,
        runner=runner,
        sessions=sessions,
        source=source,
        redis_client=redis_client,
        metrics=metrics.eval,
        max_live_episodes=rollout.concurrency.resolved_max_live_episodes,
        worker_id=settings.worker_id,
    )
