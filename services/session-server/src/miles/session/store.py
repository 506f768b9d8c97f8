"""The session store interface and `make_store`, the one place a backend is chosen.

Backends: `RedisStore` (default; every replica shares it, so any replica serves any session) and `MemoryStore`
(one process; unit tests and single-process demos). Both keep the same semantics:
- `load_turn_start(session_id, authorize)` is phase 1 of an appending turn: the meta and the state in one atomic
  read (one round trip), without the lock; the commit's fencing makes the lock redundant there, since nothing in
  phase 1 writes. `locked_state(session_id)` is phase 1 of a rollback, which also reads the records: it takes the
  per-session lock and reads the state in one step, and releases the lock on exit, so that state and records
  agree. The lock is a lease: a holder that dies frees it after lock_ttl_s.
- `commit` is phase 3: one atomic step that waits while another request holds the lock, and is fenced by the
  session's version counter: it applies only if nothing committed since the turn read the session
  (`CommitOutcome.CONCURRENT_TURN` otherwise, counted as a not-recorded turn), so an expired lease cannot corrupt
  a session. `delete` waits for the lock the same way. A commit with a routing chunk (R3) appends it beside the
  record and trims the chunks with the records: chunks already stored are never rewritten, so a turn's write
  does not grow with the session.
- a tree session (tree.py) keeps its nodes beside the session: `add_node` adds one atomically, bounded by node
  count and stored tokens; nodes are never rewritten, and go with the session.
- a session expires `ttl_s` after its creation or last commit; `reap()` counts expiries once across replicas.
- an Idempotency-Key of a create is stored with its session (`create(meta, idempotency)` claims it atomically)
  and expires, or is deleted, with it; `rotate_token` replaces the session's token hash (a replay's new token).
- a job's config and its live adapter (a LoRA job, adapters.py) never expire; `set_adapter` is atomic and never
  lowers the version; deleting the config deletes the adapter.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from miles.session.records import (
    CommitOutcome,
    IdempotencyRecord,
    LiveAdapter,
    ModelConfig,
    SessionMeta,
    SessionState,
    TurnCommit,
    TurnRecord,
)
from miles.session.settings import SessionSettings
from miles.session.tree import TreeCommit, TreeNode


@dataclass(frozen=True)
class ReapResult:
    num_live: int
    num_expired: int
    """Sessions found expired by this call (each expiry is counted by exactly one reap across replicas)."""


class SessionStore(Protocol):
    hands_out_copies: bool
    """load_state / load_records return objects no one else holds (a Redis read); False: the store's own (memory),
    which a reader must not change."""
    shared_across_processes: bool
    """Another process given the same settings sees the same sessions (Redis; not memory): the export process
    (exports.py) can answer for this one."""

    async def ping(self) -> None:
        """Raise when the store cannot serve (readiness)."""
        ...

    async def close(self) -> None: ...

    async def create(self, meta: SessionMeta, idempotency: IdempotencyRecord | None = None) -> IdempotencyRecord | None:
        """Create the session, and bind `idempotency` to it in the same atomic step. When a live session already
        holds that key, create nothing and return its record; else None."""
        ...

    async def get_idempotency(self, key_sha256: str) -> IdempotencyRecord | None:
        """The record of a key whose session is live, else None."""
        ...

    async def rotate_token(self, session_id: str, token_sha256: str) -> SessionMeta | None:
        """Replace the session's token hash (the old token stops working); the new meta, None when it is gone."""
        ...

    async def get_meta(self, session_id: str) -> SessionMeta | None:
        """The session's fixed part, or None when there is no live session with this id."""
        ...

    async def load_turn_start(
        self, session_id: str, authorize: Callable[[SessionMeta], None]
    ) -> tuple[SessionMeta, SessionState] | None:
        """The meta and the state of a live session read in one atomic step without the lock (None: no session).
        `authorize(meta)` runs before the state is parsed and raises to refuse, so a refused caller costs no parse."""
        ...

    async def num_token_ids(self, session_id: str) -> int:
        """Length of a linear session's token buffer, read without loading it (0: no session, or a tree)."""
        ...

    async def load_state(self, session_id: str) -> SessionState | None:
        """The state without taking the lock (GET, samples)."""
        ...

    def locked_state(self, session_id: str) -> AbstractAsyncContextManager[SessionState | None]:
        """Phase 1: the state (None when the session is gone) read under the session lock, held until exit.

        Raises SessionBusyError when the lock stays taken for lock_wait_s."""
        ...

    async def load_records(self, session_id: str) -> list[TurnRecord]: ...

    async def load_routing(self, session_id: str) -> list[bytes]:
        """The routing chunk of every record, in order ([] for a session without routing)."""
        ...

    async def commit(self, session_id: str, commit: TurnCommit) -> CommitOutcome:
        """Phase 3 (see the module docstring); SessionBusyError when the lock stays taken for lock_wait_s."""
        ...

    async def load_tree(self, session_id: str) -> list[TreeNode]:
        """A tree session's nodes without their ids ([] for none yet, or a linear session)."""
        ...

    async def load_tree_ids(self, session_id: str, node_ids: list[str] | None = None) -> dict[str, list[int]]:
        """The stored ids (`delta`) of the given nodes (every node when None)."""
        ...

    async def load_tree_routing(self, session_id: str) -> dict[str, bytes]:
        """The routing chunk of every node of a tree session that records routing."""
        ...

    async def add_node(self, session_id: str, commit: TreeCommit) -> CommitOutcome:
        """Phase 3 of a tree turn: one atomic step, never fenced by other turns (they branch); TREE_FULL past the
        bounds (counted as a not-recorded turn); restarts the expiry clock like a commit."""
        ...

    async def delete(self, session_id: str) -> bool:
        """Remove the session once no request holds its lock; False when it did not exist."""
        ...

    async def list_sessions(self, job_id: str | None, limit: int) -> list[str]:
        """Ids of live sessions (of one job when given), oldest expiry first."""
        ...

    async def reap(self) -> ReapResult: ...

    async def put_job_config(self, job_id: str, config: ModelConfig) -> None: ...

    async def get_job_config(self, job_id: str) -> ModelConfig | None: ...

    async def delete_job_config(self, job_id: str) -> bool:
        """Delete the job's config and its live adapter; False when there was no config."""
        ...

    async def set_adapter(self, job_id: str, adapter: LiveAdapter) -> LiveAdapter | None:
        """Make `adapter` the job's live one unless the held one has a higher weight_version, in one atomic step.
        The live adapter after the call (the held one when it is newer); None when the job has no config."""
        ...

    async def get_adapter(self, job_id: str) -> LiveAdapter | None:
        """The job's live adapter; None when none was set (or the job has no config)."""
        ...


def make_store(settings: SessionSettings) -> SessionStore:
    """The backend named by settings.store_backend."""
    if settings.store_backend == "memory":
        from miles.session.store_memory import MemoryStore

        return MemoryStore(lock_wait_s=settings.lock_wait_s)
    from miles.session.store_redis import RedisStore

    return RedisStore.from_settings(settings)
