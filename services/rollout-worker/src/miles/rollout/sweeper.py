"""Deleting sessions no episode knows about: those whose create reply was lost (the session server created
them, then died or the connection broke before the worker read the answer, so the retried create made
another), and those a killed worker created but had not recorded yet.

After such an uncertain create, or when a dead worker's prompt is reclaimed, the sweeper waits `min_age_s`,
lists the job's live sessions (ids only), subtracts every session any worker recorded in the ledger, and
deletes the rest that are older than `min_age_s` (a session is recorded within milliseconds of its creation, so
an unrecorded older one belongs to no episode). It needs the session server's operator token (to read and
delete sessions it holds no token for); without one (loopback development) it does nothing and the sessions'
TTL removes orphans.
"""

from __future__ import annotations

import asyncio
import logging
import time

from miles.rollout.ledger import SessionLedger
from miles.rollout.metrics import RolloutMetrics
from miles.rollout.sessions import SessionClient

log = logging.getLogger(__name__)


class OrphanSweeper:
    def __init__(
        self,
        sessions: SessionClient,
        ledger: SessionLedger,
        *,
        job_id: str,
        min_age_s: float,
        metrics: RolloutMetrics,
    ) -> None:
        self.sessions = sessions
        self.ledger = ledger
        self.job_id = job_id
        self.min_age_s = min_age_s
        self.metrics = metrics
        self._wanted = asyncio.Event()
        self._sweeping = False

    @property
    def pending(self) -> bool:
        """A sweep was asked for and has not finished yet."""
        return self._wanted.is_set() or self._sweeping

    def request(self) -> None:
        """Asks for a sweep (called when a create's reply may have been lost)."""
        self._wanted.set()

    async def run(self) -> None:
        """Sweeps after every request (coalesced), until cancelled."""
        while True:
            await self._wanted.wait()
            await asyncio.sleep(self.min_age_s)
            self._sweeping = True
            self._wanted.clear()
            try:
                deleted = await self.sweep()
            except Exception:  # the session server or Redis may still be recovering: try again later
                log.warning("orphan session sweep failed; retrying", exc_info=True)
                self._wanted.set()
                continue
            finally:
                self._sweeping = False
            if deleted:
                log.info("deleted orphan sessions", extra={"job_id": self.job_id, "num_sessions": deleted})

    async def sweep(self) -> int:
        """Deletes the job's sessions that no worker recorded and that are older than min_age_s."""
        if not self.sessions.has_operator_token:
            return 0
        live = await self.sessions.list_job_sessions(self.job_id)
        known = await self.ledger.known_session_ids()
        deleted = 0
        for session_id in live:
            if session_id in known:
                continue
            created_at_ms = await self.sessions.created_at_unix_ms(session_id)
            if created_at_ms is None or time.time() * 1000 - created_at_ms < self.min_age_s * 1000:
                continue
            await self.sessions.delete_by_id(session_id)
            deleted += 1
        self.metrics.orphan_sessions_deleted.labels(cause="sweep").inc(deleted)
        return deleted
