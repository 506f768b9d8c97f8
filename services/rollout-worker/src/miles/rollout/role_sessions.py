"""The sessions of one episode attempt: one per role of a multi-agent episode (`rollout.roles`: e.g. a solver and
a verifier, the same model with different prompts), else one session without a role.

Every role's session has the attempt's episode id and is created with its role (the session server refuses a
role the job config does not declare, and puts `metadata.role` on the session's samples). Sessions are created
one after the other in the spec's role order and each is recorded in the ledger right after its creation, so
that a worker reclaiming the prompt of a dead one deletes every one of them. An episode cancelled while a create
is in flight (a timeout, the worker shutting down) hands that create to `on_abandoned`, which deletes the session
once it exists instead of leaving it to its TTL. `SessionCleaner` deletes them (every session in every case, also
after a cancellation); what an episode makes of their samples is `episode.py`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from miles.common.errors import MilesError
from miles.proto.common.v1 import common_pb2
from miles.proto.session.v1 import session_pb2
from miles.rollout import samples as sample_ops
from miles.rollout.ledger import SessionLedger
from miles.rollout.metrics import RolloutMetrics
from miles.rollout.sessions import SessionClient, SessionHandle


@dataclass(frozen=True)
class RoleSession:
    """One session of an episode attempt: its role ("" when the job declares none) and its handle."""

    role: str
    handle: SessionHandle


async def open_role_sessions(
    sessions: SessionClient,
    ledger: SessionLedger | None,
    roles: Sequence[str],
    *,
    job_id: str,
    group_id: str,
    episode_id: str,
    seq: int,
    ttl_s: float,
    opened: list[RoleSession],
    on_abandoned: Callable[[asyncio.Future[SessionHandle]], object],
) -> None:
    """Creates a session per role into `opened` (so that the caller deletes those created before a failure);
    raises the session client's MilesError when one cannot be created."""
    ids = {"job_id": job_id, "group_id": group_id, "episode_id": episode_id}
    for role in roles:
        creation = asyncio.ensure_future(
            sessions.create(job_id=job_id, episode_id=episode_id, ttl_s=ttl_s, metadata=ids, role=role)
        )
        try:
            handle = await asyncio.shield(creation)
        except asyncio.CancelledError:
            on_abandoned(creation)
            raise
        opened.append(RoleSession(role, handle))
        if ledger is not None:
            await ledger.record(seq, handle, ttl_s)


class SessionCleaner:
    """Deletes the sessions of episode attempts (retried by the session client; a failure is counted and left to
    the TTL) and forgets them in the ledger. Deletions run to their end even when their episode is cancelled:
    `drain` waits for those still running."""

    def __init__(self, sessions: SessionClient, ledger: SessionLedger | None, metrics: RolloutMetrics) -> None:
        self.sessions = sessions
        self.ledger = ledger
        self.metrics = metrics
        self._background: set[asyncio.Future[Any]] = set()

    def _in_background(self, work: Awaitable[Any]) -> asyncio.Future[Any]:
        future = asyncio.ensure_future(work)
        self._background.add(future)
        future.add_done_callback(self._background.discard)
        return future

    async def delete_all(self, opened: Sequence[RoleSession], seq: int) -> None:
        """Deletes every session of an attempt; shielded, so that a cancelled episode still deletes them."""
        deletions = [self._in_background(self.delete(session.handle, seq)) for session in opened]
        await asyncio.shield(asyncio.gather(*deletions))

    def delete_when_created(self, creation: asyncio.Future[SessionHandle]) -> None:
        """Deletes, once made, the session of a create its episode stopped waiting for (cancelled)."""

        async def delete() -> None:
            try:
                handle = await creation
            except MilesError:
                return
            await self.delete(handle, None)

        self._in_background(delete())

    async def delete(self, handle: SessionHandle, seq: int | None) -> bool:
        """Deletes one session (and forgets it in seq's ledger entry); False when the deletion failed."""
        try:
            await self.sessions.delete(handle)
        except MilesError:
            self.metrics.session_delete_failures.inc()
            return False
        if self.ledger is not None and seq is not None:
            await self.ledger.forget(seq, handle.session_id)
        return True

    async def drain(self) -> None:
        """Waits for deletions still running in the background (after cancelled episodes)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


async def collect_samples(
    sessions: SessionClient,
    opened: Sequence[RoleSession],
    *,
    mode: str,
    max_seq_len: int | None,
    group_id: str,
    metadata: dict[str, Any],
) -> list[tuple[str, session_pb2.SessionSamples]]:
    """(role, samples) of every session in role order; the first failure raises (SampleAssemblyFailedError,
    or the session client's MilesError): an episode is kept or lost as a whole."""
    collected = []
    for session in opened:
        session_samples = await sessions.samples(
            session.handle, mode=mode, max_seq_len=max_seq_len, group_id=group_id, metadata=metadata
        )
        collected.append((session.role, session_samples))
    return collected


def placeholders(roles: Sequence[str], episode_id: str, group_id: str) -> list[common_pb2.Sample]:
    """One placeholder sample per role (labelled with it) for an attempt the session server gave no samples for."""
    samples = []
    for role in roles:
        sample = sample_ops.placeholder(episode_id, group_id)
        if role:
            sample_ops.label_role([sample], role, episode_id)
        samples.append(sample)
    return samples


def agent_roles(opened: Sequence[RoleSession]) -> dict[str, dict[str, str]]:
    """`metadata["roles"]` for the agent: each role's OpenAI `base_url`, `api_key` and `session_id` ({} without
    roles)."""
    return {
        session.role: {
            "base_url": session.handle.base_url,
            "api_key": session.handle.token,
            "session_id": session.handle.session_id,
        }
        for session in opened
        if session.role
    }
