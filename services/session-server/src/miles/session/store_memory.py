"""MemoryStore: sessions in this process only (unit tests, single-process demos). Same semantics as RedisStore.

Limits: nothing survives a restart and no other replica sees these sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from miles.common.aio import acquire_within
from miles.session.errors import SessionBusyError
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
from miles.session.store import ReapResult
from miles.session.tree import TreeCommit, TreeNode


@dataclass
class _Entry:
    meta: SessionMeta
    state: SessionState = field(default_factory=SessionState)
    records: list[TurnRecord] = field(default_factory=list)
    routing: list[bytes] = field(default_factory=list)
    expires_at_s: float = 0.0
    idempotency_key_sha256: str | None = None
    nodes: dict[str, TreeNode] = field(default_factory=dict)
    node_ids: dict[str, list[int]] = field(default_factory=dict)
    node_routing: dict[str, bytes] = field(default_factory=dict)
    tree_tokens: int = 0


class MemoryStore:
    hands_out_copies = False
    shared_across_processes = False

    def __init__(self, *, lock_wait_s: float) -> None:
        self._sessions: dict[str, _Entry] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._job_configs: dict[str, ModelConfig] = {}
        self._adapters: dict[str, LiveAdapter] = {}
        self._idempotency: dict[str, IdempotencyRecord] = {}
        self._lock_wait_s = lock_wait_s

    async def ping(self) -> None:
        return None

    async def num_token_ids(self, session_id: str) -> int:
        entry = self._live(session_id)
        return len(entry.state.token_ids) if entry is not None else 0

    async def close(self) -> None:
        return None

    def _live(self, session_id: str) -> _Entry | None:
        entry = self._sessions.get(session_id)
        if entry is None or entry.expires_at_s <= time.time():
            return None
        return entry

    async def create(self, meta: SessionMeta, idempotency: IdempotencyRecord | None = None) -> IdempotencyRecord | None:
        if idempotency is not None:
            held = await self.get_idempotency(idempotency.key_sha256)
            if held is not None:
                return held
            self._idempotency[idempotency.key_sha256] = idempotency
        key = idempotency.key_sha256 if idempotency is not None else None
        expires_at_s = time.time() + meta.ttl_s
        self._sessions[meta.session_id] = _Entry(meta, expires_at_s=expires_at_s, idempotency_key_sha256=key)
        return None

    async def get_idempotency(self, key_sha256: str) -> IdempotencyRecord | None:
        record = self._idempotency.get(key_sha256)
        if record is not None and self._live(record.session_id) is None:
            self._idempotency.pop(key_sha256, None)  # its session expired or was deleted: the key went with it
            return None
        return record

    async def rotate_token(self, session_id: str, token_sha256: str) -> SessionMeta | None:
        entry = self._live(session_id)
        if entry is None:
            return None
        entry.meta = dataclasses.replace(entry.meta, token_sha256=token_sha256)
        return entry.meta

    async def get_meta(self, session_id: str) -> SessionMeta | None:
        entry = self._live(session_id)
        return entry.meta if entry else None

    async def load_state(self, session_id: str) -> SessionState | None:
        entry = self._live(session_id)
        return entry.state if entry else None

    async def load_turn_start(
        self, session_id: str, authorize: Callable[[SessionMeta], None]
    ) -> tuple[SessionMeta, SessionState] | None:
        entry = self._live(session_id)
        if entry is None:
            return None
        authorize(entry.meta)
        return entry.meta, entry.state

    async def load_records(self, session_id: str) -> list[TurnRecord]:
        entry = self._live(session_id)
        return list(entry.records) if entry else []

    async def load_routing(self, session_id: str) -> list[bytes]:
        entry = self._live(session_id)
        return list(entry.routing) if entry else []

    async def commit(self, session_id: str, commit: TurnCommit) -> CommitOutcome:
        async with self._lock(session_id):
            entry = self._live(session_id)
            if entry is None:
                return CommitOutcome.SESSION_GONE
            if entry.state.version != commit.expected_version:
                entry.state = dataclasses.replace(entry.state, num_not_recorded=entry.state.num_not_recorded + 1)
                return CommitOutcome.CONCURRENT_TURN
            entry.records = [*entry.records[: commit.num_kept_records], commit.record]
            if commit.routing is not None:
                del entry.routing[commit.num_kept_records :]
                entry.routing.append(commit.routing)
            entry.state = dataclasses.replace(
                entry.state,
                version=entry.state.version + 1,
                messages=commit.messages,
                token_ids=commit.token_ids,
                tools=commit.tools,
                message_ends=commit.message_ends,
            )
            entry.expires_at_s = time.time() + entry.meta.ttl_s
            return CommitOutcome.COMMITTED

    async def load_tree(self, session_id: str) -> list[TreeNode]:
        entry = self._live(session_id)
        return list(entry.nodes.values()) if entry else []

    async def load_tree_ids(self, session_id: str, node_ids: list[str] | None = None) -> dict[str, list[int]]:
        entry = self._live(session_id)
        if entry is None:
            return {}
        wanted = entry.node_ids.keys() if node_ids is None else node_ids
        return {node_id: entry.node_ids[node_id] for node_id in wanted if node_id in entry.node_ids}

    async def load_tree_routing(self, session_id: str) -> dict[str, bytes]:
        entry = self._live(session_id)
        return dict(entry.node_routing) if entry else {}

    async def add_node(self, session_id: str, commit: TreeCommit) -> CommitOutcome:
        async with self._lock(session_id):
            entry = self._live(session_id)
            if entry is None:
                return CommitOutcome.SESSION_GONE
            num_tokens = entry.tree_tokens + len(commit.delta_ids)
            if len(entry.nodes) >= commit.max_nodes or num_tokens > commit.max_tokens:
                entry.state = dataclasses.replace(entry.state, num_not_recorded=entry.state.num_not_recorded + 1)
                return CommitOutcome.TREE_FULL
            node_id = commit.node.node_id
            entry.nodes[node_id], entry.node_ids[node_id] = commit.node, list(commit.delta_ids)
            if commit.routing is not None:
                entry.node_routing[node_id] = commit.routing
            entry.tree_tokens = num_tokens
            entry.state = dataclasses.replace(entry.state, version=entry.state.version + 1)
            entry.expires_at_s = time.time() + entry.meta.ttl_s
            return CommitOutcome.COMMITTED

    async def delete(self, session_id: str) -> bool:
        async with self._lock(session_id):
            existed = self._live(session_id) is not None
            self._drop(session_id)
        self._locks.pop(session_id, None)
        return existed

    def _drop(self, session_id: str) -> None:
        entry = self._sessions.pop(session_id, None)
        if entry is not None and entry.idempotency_key_sha256 is not None:
            self._idempotency.pop(entry.idempotency_key_sha256, None)

    @contextlib.asynccontextmanager
    async def _lock(self, session_id: str) -> AsyncIterator[None]:
        lock = self._locks.setdefault(session_id, asyncio.Lock())
        if not await acquire_within(lock, self._lock_wait_s):
            raise SessionBusyError(
                f"session {session_id} is busy (its lock stayed taken for {self._lock_wait_s:g} s); retry",
                retry_after_s=1.0,
            ) from None
        try:
            yield
        finally:
            lock.release()

    @contextlib.asynccontextmanager
    async def locked_state(self, session_id: str) -> AsyncIterator[SessionState | None]:
        async with self._lock(session_id):
            yield await self.load_state(session_id)

    async def list_sessions(self, job_id: str | None, limit: int) -> list[str]:
        live = [(e.expires_at_s, sid) for sid, e in self._sessions.items() if self._live(sid) is not None]
        return [sid for _, sid in sorted(live) if job_id is None or self._sessions[sid].meta.job_id == job_id][:limit]

    async def reap(self) -> ReapResult:
        now = time.time()
        expired = [sid for sid, entry in self._sessions.items() if entry.expires_at_s <= now]
        for sid in expired:
            self._drop(sid)
            self._locks.pop(sid, None)
        return ReapResult(num_live=len(self._sessions), num_expired=len(expired))

    async def put_job_config(self, job_id: str, config: ModelConfig) -> None:
        self._job_configs[job_id] = config

    async def get_job_config(self, job_id: str) -> ModelConfig | None:
        return self._job_configs.get(job_id)

    async def delete_job_config(self, job_id: str) -> bool:
        self._adapters.pop(job_id, None)
        return self._job_configs.pop(job_id, None) is not None

    async def set_adapter(self, job_id: str, adapter: LiveAdapter) -> LiveAdapter | None:
        if job_id not in self._job_configs:
            return None
        held = self._adapters.get(job_id)
        if held is not None and held.weight_version > adapter.weight_version:
            return held
        self._adapters[job_id] = adapter
        return adapter

    async def get_adapter(self, job_id: str) -> LiveAdapter | None:
        return self._adapters.get(job_id)
