"""One episode: session(s) -> agent (with a timeout) -> samples -> partial-rollout policy -> score -> delete.

A job with `rollout.roles` (multi-agent episodes) opens one session per role for each episode (same episode id,
each created with its role), hands them to the agent as `metadata["roles"]`, and collects, scores and deletes
them together: the episode is one unit, so its samples (every role's, each with `metadata.role`) share one
status and reason, and a role whose session has no trainable sample (`no_model_call`, `all_truncated`) ends the
whole episode ABORTED. Without roles there is one session without a role, as this table describes.

Every failure ends as a sample status with a reason, never as an exception out of `EpisodeRunner.run`:

| what happened                                   | status    | reason                   |
|-------------------------------------------------|-----------|--------------------------|
| normal end                                      | COMPLETED | ok                       |
| a turn hit max_tokens last, or max_seq_len cut  | TRUNCATED | truncated                |
| the agent raised (error text kept in metadata)  | ABORTED   | agent_error              |
| the agent returned something else than a dict   | ABORTED   | agent_error              |
| the agent ran past agent.timeout_s (cancelled)  | ABORTED   | timeout                  |
| the environment raised, or its server was down  | ABORTED   | environment_error        |
| the environment's result broke the protocol     | ABORTED   | bad_reward               |
| the agent never called the model                | ABORTED   | no_model_call            |
| nothing fits max_seq_len                        | ABORTED   | all_truncated            |
| session server unreachable at create (retried)  | ABORTED   | session_unavailable      |
| session server unreachable for samples          | ABORTED   | samples_unavailable      |
| several weight versions, policy regenerate, out of attempts | ABORTED | version_span      |
| the reward function raised                      | ABORTED   | reward_error             |
| its rewards per role miss or add a role         | ABORTED   | bad_reward               |
| the session could not be assembled (422)        | FAILED    | sample_assembly_failed   |
| its worker died (counted by the worker that reclaims the prompt) | ABORTED | worker_lost |

Every session is deleted in every case (retried within the budget; its TTL is the last resort), also when the
episode is cancelled; each is recorded in the ledger while it lives. Samples of a failed agent keep whatever the
session recorded (for inspection), marked ABORTED: they are never trained on.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from miles.common.errors import MilesError
from miles.common.jobspec.rollout import RolloutSpec
from miles.proto.common.v1 import common_pb2
from miles.proto.session.v1 import session_pb2
from miles.rollout import role_sessions
from miles.rollout import samples as sample_ops
from miles.rollout.contracts import AgentFn, AgentResult, parse_agent_result
from miles.rollout.errors import BadRewardError, EpisodeAbortedError, SampleAssemblyFailedError
from miles.rollout.ledger import SessionLedger
from miles.rollout.metrics import RolloutMetrics
from miles.rollout.rewards import EpisodeToScore, Scorer
from miles.rollout.role_sessions import RoleSession, SessionCleaner
from miles.rollout.sessions import SessionClient, SessionHandle
from miles.rollout.teacher import TeacherScorer, TeacherUnavailableError

log = logging.getLogger(__name__)

WORKER_LOST = "worker_lost"
"""Reason of the episodes a dead worker had in flight (counted by the worker that reclaims their prompt)."""


@dataclass(frozen=True)
class EpisodeTask:
    """One of the n episodes of a prompt group."""

    job_id: str
    group_id: str
    seq: int
    sample_index: int
    prompt_index: int
    epoch: int
    prompt: dict[str, Any]
    label: Any

    @property
    def episode_id(self) -> str:
        return f"{self.group_id}/{self.sample_index}"


@dataclass
class EpisodeOutcome:
    samples: list[common_pb2.Sample]
    status: int
    reason: str
    num_attempts: int = 1
    duration_s: float = 0.0


@dataclass
class _Attempt:
    samples: list[common_pb2.Sample]
    reason: str = "ok"
    agent_result: AgentResult = field(default_factory=AgentResult)
    agent_failed: bool = False
    spans_versions: bool = False


def _error_text(exc: BaseException) -> str:
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3)
    return "".join(lines)[-sample_ops.MAX_ERROR_CHARS :]


class EpisodeRunner:
    """Runs episodes of one job (shared by every in-flight episode of the worker)."""

    def __init__(
        self,
        spec: RolloutSpec,
        *,
        sessions: SessionClient,
        agent: AgentFn,
        scorer: Scorer,
        metrics: RolloutMetrics,
        worker_id: str,
        agent_extra_metadata: dict[str, Any] | None = None,
        ledger: SessionLedger | None = None,
        teacher: TeacherScorer | None = None,
    ) -> None:
        self.spec = spec
        self.sessions = sessions
        self.agent = agent
        self.scorer = scorer
        self.metrics = metrics
        self.worker_id = worker_id
        self.agent_extra_metadata = dict(agent_extra_metadata or {})
        self.ledger = ledger
        self.teacher = teacher
        """On-policy distillation: scores every trainable sample on the teacher pool after the reward."""
        self.roles: tuple[str, ...] = tuple(spec.roles) or ("",)
        """The roles of each episode's sessions, in the spec's order; ("",): one session without a role."""
        self.cleaner = SessionCleaner(sessions, ledger, metrics)

    async def run(self, task: EpisodeTask) -> EpisodeOutcome:
        start_s = time.monotonic()
        policy = self.spec.partial_rollout
        max_attempts = 1 + (policy.max_regenerations if policy.policy == "regenerate" else 0)
        for attempt in range(max_attempts):
            result = await self._attempt(task, attempt)
            if not result.spans_versions or policy.policy != "regenerate":
                break
            if attempt + 1 < max_attempts:
                self.metrics.partial_rollouts.labels(action="regenerated").inc()
                continue
            self.metrics.partial_rollouts.labels(action="aborted").inc()
            sample_ops.mark(result.samples, sample_ops.ABORTED, "version_span", "spanned several weight versions")
            result.reason = "version_span"
        sample_ops.update_metadata(result.samples, {"num_attempts": attempt + 1})
        status = result.samples[0].status
        duration_s = time.monotonic() - start_s
        self.metrics.episodes.labels(status=sample_ops.status_name(status), reason=result.reason).inc()
        self.metrics.episode_duration_s.labels(status=sample_ops.status_name(status)).observe(duration_s)
        return EpisodeOutcome(result.samples, status, result.reason, attempt + 1, duration_s)

    async def drain(self) -> None:
        """Waits for session deletions still running in the background (after cancelled episodes)."""
        await self.cleaner.drain()

    def _attempt_episode_id(self, task: EpisodeTask, attempt: int) -> str:
        return task.episode_id if attempt == 0 else f"{task.episode_id}/attempt-{attempt}"

    async def _attempt(self, task: EpisodeTask, attempt: int) -> _Attempt:
        episode_id = self._attempt_episode_id(task, attempt)
        opened: list[RoleSession] = []
        try:
            try:
                await role_sessions.open_role_sessions(
                    self.sessions,
                    self.ledger,
                    self.roles,
                    job_id=task.job_id,
                    group_id=task.group_id,
                    episode_id=episode_id,
                    seq=task.seq,
                    ttl_s=self.spec.resolved_session_ttl_s,
                    opened=opened,
                    on_abandoned=self.cleaner.delete_when_created,
                )
            except MilesError as exc:
                return self._failed(task, episode_id, sample_ops.ABORTED, "session_unavailable", exc.message)
            return await self._in_session(task, attempt, episode_id, opened)
        finally:
            if opened:
                await self.cleaner.delete_all(opened, task.seq)

    def _failed(
        self, task: EpisodeTask, episode_id: str, status: common_pb2.SampleStatus, reason: str, message: str
    ) -> _Attempt:
        """The attempt's result when the session server gave no samples: a placeholder per role, marked."""
        samples = role_sessions.placeholders(self.roles, episode_id, task.group_id)
        sample_ops.mark(samples, status, reason, message)
        return _Attempt(samples, reason)

    async def reap_orphans(self, seq: int) -> int:
        """Deletes the sessions a dead worker left for seq (see ledger.py); returns how many were deleted.

        Each is an episode that worker had in flight: it is counted as ABORTED with reason `worker_lost` (the dead
        worker could not record it, and its group is regenerated from the reclaimed prompt)."""
        if self.ledger is None:
            return 0
        orphans = await self.ledger.take_orphans(seq)
        if orphans:
            # An episode holds a session per role. The ledger does not say which session is whose, so an episode
            # the worker died in while it created its sessions (a few ms) can make this one short.
            num_episodes = math.ceil(len(orphans) / len(self.roles))
            self.metrics.episodes.labels(status="ABORTED", reason=WORKER_LOST).inc(num_episodes)
            log.warning(
                "episodes of a dead worker aborted",
                extra={"seq": seq, "num_episodes": num_episodes, "reason": WORKER_LOST},
            )
        deleted = 0
        for handle in orphans:
            deleted += await self.cleaner.delete(handle, None)
        self.metrics.orphan_sessions_deleted.labels(cause="reclaim").inc(deleted)
        return deleted

    def _agent_metadata(
        self, task: EpisodeTask, attempt: int, episode_id: str, opened: list[RoleSession]
    ) -> dict[str, Any]:
        first = opened[0].handle  # an agent unaware of roles keeps working on the first role's session
        roles = role_sessions.agent_roles(opened)
        return {
            **self.agent_extra_metadata,
            **({"roles": roles} if roles else {}),
            "api_key": first.token,
            "session_id": first.session_id,
            "job_id": task.job_id,
            "group_id": task.group_id,
            "episode_id": episode_id,
            "sample_index": task.sample_index,
            "prompt_index": task.prompt_index,
            "epoch": task.epoch,
            "attempt": attempt,
            "label": copy.deepcopy(task.label),
            "max_seq_len": self.spec.max_seq_len,
            "agent_config": copy.deepcopy(self.spec.agent.config if self.spec.agent is not None else {}),
            "worker_id": self.worker_id,
        }

    async def _run_agent(
        self, task: EpisodeTask, metadata: dict[str, Any], base_url: str
    ) -> tuple[AgentResult, str | None, str]:
        """(result, error text or None, reason)."""
        timeout_s = self.spec.episode_timeout_s
        deadline = asyncio.timeout(timeout_s)
        try:
            async with deadline:
                raw = await self.agent(base_url, copy.deepcopy(task.prompt), dict(self.spec.request_kwargs), metadata)
        except TimeoutError as exc:
            if deadline.expired():  # ours, not a TimeoutError the agent raised itself
                return AgentResult(), f"the agent ran past its timeout of {timeout_s:g} s and was cancelled", "timeout"
            return AgentResult(), _error_text(exc), "agent_error"
        except EpisodeAbortedError as exc:  # an environment's own reasons (environment_error, bad_reward)
            return AgentResult(), exc.message[-sample_ops.MAX_ERROR_CHARS :], exc.reason
        except Exception as exc:  # the agent is user code: any exception becomes an ABORTED sample
            return AgentResult(), _error_text(exc), "agent_error"
        try:
            return parse_agent_result(raw), None, "ok"
        except ValueError as exc:
            return AgentResult(), f"invalid agent result: {exc}", "agent_error"

    async def _in_session(
        self, task: EpisodeTask, attempt: int, episode_id: str, opened: list[RoleSession]
    ) -> _Attempt:
        metadata = self._agent_metadata(task, attempt, episode_id, opened)
        agent_result, error, agent_reason = await self._run_agent(task, metadata, opened[0].handle.base_url)
        collected = await self._collect(task, attempt, episode_id, opened)
        if isinstance(collected, _Attempt):
            return collected
        samples: list[common_pb2.Sample] = []
        for role, session_samples in collected:
            role_samples = list(session_samples.samples)
            sample_ops.update_metadata(role_samples, agent_result.metadata)
            if role:  # after the agent's metadata, which must not relabel a sample's role
                sample_ops.label_role(role_samples, role, episode_id)
            samples += role_samples
        if any(sample.metadata["tito_num_critical"] for sample in samples if "tito_num_critical" in sample.metadata):
            self.metrics.tito_critical_episodes.inc()
        if error is not None:
            sample_ops.mark(samples, sample_ops.ABORTED, agent_reason, error)
            return _Attempt(samples, agent_reason, agent_failed=True)
        empty = [(role, got.empty_reason) for role, got in collected if got.empty_reason]
        if empty:
            role, empty_reason = empty[0]
            reason = "no_model_call" if empty_reason == "no_records" else empty_reason
            why = f"role {role!r} has no trainable sample ({reason}): the episode needs every role" if role else None
            sample_ops.mark(samples, sample_ops.ABORTED, reason, why)
            return _Attempt(samples, reason, agent_result)
        reason = "truncated" if any(s.status == sample_ops.TRUNCATED for s in samples) else "ok"
        sample_ops.update_metadata(samples, {"status_reason": reason})
        result = _Attempt(samples, reason, agent_result)
        if self._apply_partial_rollout(result):
            return result
        await self._score(task, opened[0].handle, result)
        if self.teacher is not None and result.reason in ("ok", "truncated"):
            await self._score_on_teacher(self.teacher, result)
        return result

    async def _score_on_teacher(self, teacher: TeacherScorer, result: _Attempt) -> None:
        try:
            await teacher.score([s for s in result.samples if sample_ops.is_trainable(s)])
        except TeacherUnavailableError as exc:
            sample_ops.mark(result.samples, sample_ops.ABORTED, "teacher_unavailable", str(exc))
            result.reason = "teacher_unavailable"

    async def _collect(
        self, task: EpisodeTask, attempt: int, episode_id: str, opened: list[RoleSession]
    ) -> list[tuple[str, session_pb2.SessionSamples]] | _Attempt:
        """Every session's samples in role order, or the failed attempt when one of them could not be had."""
        sample_metadata = {
            "job_id": task.job_id,
            "sample_index": task.sample_index,
            "prompt_index": task.prompt_index,
            "epoch": task.epoch,
            "attempt": attempt,
            "worker_id": self.worker_id,
        }
        try:
            return await role_sessions.collect_samples(
                self.sessions,
                opened,
                mode=self.spec.sample_mode,
                max_seq_len=self.spec.max_seq_len,
                group_id=task.group_id,
                metadata=sample_ops.json_safe(sample_metadata),
            )
        except SampleAssemblyFailedError as exc:
            return self._failed(task, episode_id, sample_ops.FAILED, "sample_assembly_failed", exc.message)
        except MilesError as exc:
            return self._failed(task, episode_id, sample_ops.ABORTED, "samples_unavailable", exc.message)

    def _apply_partial_rollout(self, result: _Attempt) -> bool:
        """Applies keep / keep_per_span; True when the attempt must be regenerated (scoring skipped)."""
        versions = sample_ops.weight_versions(s for s in result.samples if sample_ops.is_trainable(s))
        if len(versions) <= 1:
            return False
        result.spans_versions = True
        sample_ops.update_metadata(result.samples, {"weight_versions_seen": sorted(versions)})
        policy = self.spec.partial_rollout.policy
        if policy == "regenerate":
            return True
        if policy == "keep":
            for sample in result.samples:
                sample_ops.fold_spans_to_oldest(sample)
        self.metrics.partial_rollouts.labels(action="kept" if policy == "keep" else "kept_per_span").inc()
        result.spans_versions = False
        return False

    async def _final_message_text(self, handle: SessionHandle) -> str | None:
        for message in reversed(await self.sessions.messages(handle)):
            if message.get("role") == "assistant":
                content = message.get("content")
                return content if isinstance(content, str) else None
        return None

    async def _score(self, task: EpisodeTask, handle: SessionHandle, result: _Attempt) -> None:
        trainable = [s for s in result.samples if sample_ops.is_trainable(s)]
        if not trainable:
            return
        episode = EpisodeToScore(
            prompt=copy.deepcopy(task.prompt),
            label=task.label,
            samples=trainable,
            agent_result=result.agent_result,
            final_message_text=lambda: self._final_message_text(handle),
            roles=tuple(self.spec.roles),
        )
        try:
            rewards, info = await self.scorer.score(episode)
        except BadRewardError as exc:
            sample_ops.mark(result.samples, sample_ops.ABORTED, "bad_reward", str(exc))
            result.reason = "bad_reward"
            return
        except Exception as exc:  # reward functions are user code (and verifiers call the sandbox)
            sample_ops.mark(result.samples, sample_ops.ABORTED, "reward_error", _error_text(exc))
            result.reason = "reward_error"
            return
        for sample, reward in zip(trainable, rewards, strict=True):
            sample.reward = reward
            self.metrics.sample_reward.labels(role=sample_ops.role_of(sample)).observe(reward)
        turn_rewards = result.agent_result.turn_rewards
        if turn_rewards is not None:
            if self.spec.sample_mode == "per_turn" and len(turn_rewards) == len(trainable):
                placed = all(sample_ops.put_turn_rewards(s, [r]) for s, r in zip(trainable, turn_rewards, strict=True))
            else:
                placed = all(sample_ops.put_turn_rewards(sample, turn_rewards) for sample in trainable)
            sample_ops.update_metadata(trainable, {"turn_rewards_placed": placed})
        reward_info = {**result.agent_result.reward_info, **info}
        if reward_info:
            sample_ops.update_metadata(trainable, {"reward_info": reward_info})
