"""The buffer's Redis store: key layout, and one Lua script per state transition.

Every transition (push, pull, ack, nack, extend, reap, delete) is a single script, so Redis applies it
atomically: a buffer process killed at any instant leaves Redis either before or after a transition, never in
between. The layout is documented in `lua/common.lua`. All keys of a job share the hash tag `{job_id}`; the
registry of job ids (used by the background loops) is one set outside it, written with MULTI.

Limits: Redis is the single source of truth, so the buffer is as durable as Redis's AOF setting makes it; times
(lease expiry, push time) come from the Redis server's clock, not the buffer's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from importlib import resources
from typing import Any, cast

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.typing import EncodableT, FieldT

from miles.buffer.errors import StoreUnavailableError, UnknownJobError
from miles.buffer.records import (
    AckResult,
    ExtendResult,
    FilterReason,
    GroupFilter,
    JobConfig,
    JobStats,
    LeasedRecord,
    PullResult,
    PushOutcome,
    PushResult,
    RequeuedPrompt,
    StalePolicy,
)
from miles.buffer.validation import GroupSummary
from miles.common.errors import ConfigError

_KEY_NAMES = ("cfg", "data", "info", "queue", "lease_expiry", "leases", "done", "acked", "requeued", "stats", "seq")
_SCRIPT_NAMES = ("push", "pull", "ack", "nack", "extend", "reap", "requeued", "stats", "delete")
_PUSH_OUTCOMES: dict[bytes, PushOutcome] = {
    b"QUEUED": "queued",
    b"DUPLICATE": "duplicate",
    b"REJECTED": "rejected_all_aborted",
    b"FILTERED": "filtered",
}
_REAP_LIMIT = 1000
_REDIS_DOWN = (redis_errors.ConnectionError, redis_errors.TimeoutError)
log = logging.getLogger(__name__)


class CapacityReachedError(Exception):
    """The job is at capacity; raised by `RedisStore.push` for the core to wait and retry."""


def connect_redis(url: str, *, max_connections: int, socket_timeout_s: float) -> aioredis.Redis:
    """A Redis client for the buffer: bounded pool, bytes replies, reconnect with jittered backoff."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=min(socket_timeout_s, 5.0),
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=3),
        retry_on_error=[redis_errors.ConnectionError, redis_errors.TimeoutError],
        health_check_interval=30,
    )
    return aioredis.Redis(connection_pool=pool)


async def check_redis_persistence(client: aioredis.Redis, mode: str) -> None:
    """Warns (or, with mode "require", refuses to start) when Redis does not write an append-only file."""
    if mode == "off":
        return
    try:
        config = await client.config_get("append*")
    except (redis_errors.ConnectionError, redis_errors.TimeoutError, redis_errors.ResponseError) as exc:
        if mode == "require":
            raise ConfigError(
                f"cannot read Redis persistence settings ({exc}); set redis_persistence_check=off "
                "only if Redis is known to run with appendonly yes"
            ) from exc
        log.warning("could not read Redis persistence settings", extra={"error": str(exc)})
        return
    values = {_text(key): _text(value) for key, value in dict(config).items()}
    appendonly_text, fsync_text = values.get("appendonly", ""), values.get("appendfsync", "")
    if appendonly_text != "yes":
        message = "Redis runs without AOF: buffered groups are lost when Redis restarts"
        if mode == "require":
            raise ConfigError(message + " (redis_persistence_check=require)", field="redis_persistence_check")
        log.warning(message)
    else:
        log.info("redis persistence", extra={"appendonly": appendonly_text, "appendfsync": fsync_text})


def _load_scripts() -> dict[str, str]:
    folder = resources.files("miles.buffer").joinpath("lua")
    prelude = folder.joinpath("common.lua").read_text()
    return {name: prelude + "\n" + folder.joinpath(f"{name}.lua").read_text() for name in _SCRIPT_NAMES}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pairs(flat: Sequence[Any]) -> dict[str, Any]:
    return {_text(flat[index]): flat[index + 1] for index in range(0, len(flat), 2)}


def _config_from_hash(values: dict[str, Any]) -> JobConfig:
    return JobConfig(
        capacity_groups=int(values["capacity_groups"]),
        stale_policy=cast(StalePolicy, _text(values["stale_policy"])),
        group_filter=cast(GroupFilter, _text(values["group_filter"])),
        min_valid_samples=int(values["min_valid_samples"]),
    )


class RedisStore:
    """Buffer state of every job in one Redis. Raises UnknownJobError and StoreUnavailableError; nothing else
    on purpose."""

    def __init__(self, client: aioredis.Redis, *, key_prefix: str, dedupe_window_s: float, dedupe_max_ids: int) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.dedupe_args = (int(dedupe_window_s * 1000), dedupe_max_ids)
        self._scripts = {name: client.register_script(source) for name, source in _load_scripts().items()}

    def job_keys(self, job_id: str) -> list[str]:
        return [f"{self.key_prefix}:{{{job_id}}}:{name}" for name in _KEY_NAMES]

    @property
    def registry_key(self) -> str:
        return f"{self.key_prefix}:jobs"

    async def _run(self, script: str, job_id: str, *args: Any) -> list[Any]:
        try:
            reply = await self._scripts[script](keys=self.job_keys(job_id), args=list(args))
        except _REDIS_DOWN as exc:
            raise StoreUnavailableError(f"redis unavailable: {exc}") from exc
        if reply[0] == b"NOJOB":
            raise UnknownJobError(job_id)
        return cast(list[Any], reply)

    async def ping(self) -> None:
        try:
            await self.client.ping()
        except _REDIS_DOWN as exc:
            raise StoreUnavailableError(f"redis unavailable: {exc}") from exc

    async def configure_job(self, job_id: str, config: JobConfig) -> None:
        fields: dict[FieldT, EncodableT] = {
            "capacity_groups": config.capacity_groups,
            "stale_policy": config.stale_policy,
            "group_filter": config.group_filter,
            "min_valid_samples": config.min_valid_samples,
        }
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.hset(self.job_keys(job_id)[0], mapping=fields)
                pipe.sadd(self.registry_key, job_id)
                await pipe.execute()
        except _REDIS_DOWN as exc:
            raise StoreUnavailableError(f"redis unavailable: {exc}") from exc

    async def delete_job(self, job_id: str) -> int:
        reply = await self._run("delete", job_id)
        try:
            await self.client.srem(self.registry_key, job_id)
        except _REDIS_DOWN as exc:
            raise StoreUnavailableError(f"redis unavailable: {exc}") from exc
        return int(reply[1])

    async def list_jobs(self) -> list[str]:
        try:
            members = await self.client.smembers(self.registry_key)
        except _REDIS_DOWN as exc:
            raise StoreUnavailableError(f"redis unavailable: {exc}") from exc
        return sorted(_text(member) for member in members)

    async def push(
        self, job_id: str, group_id: str, group_bytes: bytes, summary: GroupSummary, prompt_index: int, epoch: int
    ) -> PushResult:
        """Stores the group unless it is a duplicate, filtered or rejected; raises CapacityReachedError at capacity."""
        reply = await self._run(
            "push",
            job_id,
            group_id,
            group_bytes,
            summary.min_weight_version,
            summary.num_samples,
            summary.num_tokens,
            summary.num_trainable,
            1 if summary.trainable_rewards_equal else 0,
            prompt_index,
            epoch,
            *self.dedupe_args,
            summary.max_weight_version,
        )
        if reply[0] == b"FULL":
            raise CapacityReachedError(job_id)
        reason = cast(FilterReason, _text(reply[2])) if reply[2] else None
        return PushResult(outcome=_PUSH_OUTCOMES[reply[0]], num_queued_groups=int(reply[1]), filter_reason=reason)

    async def pull(
        self,
        job_id: str,
        *,
        num_groups: int,
        min_groups: int,
        trainer_version: int,
        max_staleness: int,
        lease_ms: int,
        lease_id_prefix: str,
        consumer_id: str,
        max_bytes: int,
    ) -> tuple[bool, PullResult]:
        """One pull attempt; returns (leased, result). Not leased: fewer than min_groups were eligible."""
        reply = await self._run(
            "pull",
            job_id,
            num_groups,
            min_groups,
            trainer_version,
            max_staleness,
            lease_ms,
            lease_id_prefix,
            consumer_id,
            *self.dedupe_args,
            _REAP_LIMIT,
            max_bytes,
        )
        result = PullResult(
            lease_expires_unix_ms=int(reply[4]),
            num_dropped_stale=int(reply[1]),
            num_requeued=int(reply[2]),
            num_expired_leases=int(reply[3]),
        )
        result.num_stale_masked = int(reply[5])
        for index in range(6, len(reply), 4):
            result.groups.append(
                LeasedRecord(
                    lease_id=_text(reply[index]),
                    group_bytes=reply[index + 1],
                    staleness=int(reply[index + 2]),
                    redelivery_count=int(reply[index + 3]),
                )
            )
        return reply[0] == b"OK", result

    async def ack(self, job_id: str, lease_ids: Sequence[str]) -> AckResult:
        reply = await self._run("ack", job_id, *self.dedupe_args, *lease_ids)
        return AckResult(
            num_acked=int(reply[1]), num_already_acked=int(reply[2]), expired_lease_ids=[_text(x) for x in reply[3:]]
        )

    async def nack(self, job_id: str, lease_ids: Sequence[str], *, discard: bool, consumer_id: str) -> int:
        reply = await self._run("nack", job_id, 1 if discard else 0, consumer_id, *self.dedupe_args, *lease_ids)
        return int(reply[1])

    async def extend(self, job_id: str, lease_ids: Sequence[str], lease_ms: int) -> ExtendResult:
        reply = await self._run("extend", job_id, lease_ms, *lease_ids)
        return ExtendResult(
            num_extended=int(reply[1]),
            lease_expires_unix_ms=int(reply[2]),
            expired_lease_ids=[_text(x) for x in reply[3:]],
        )

    async def reap(self, job_id: str) -> int:
        """Returns groups of expired leases to the queue; returns how many leases expired."""
        reply = await self._run("reap", job_id, _REAP_LIMIT)
        return int(reply[1])

    async def pull_requeued(self, job_id: str, max_prompts: int) -> list[RequeuedPrompt]:
        reply = await self._run("requeued", job_id, max_prompts)
        return [
            RequeuedPrompt(group_id=_text(reply[i]), prompt_index=int(reply[i + 1]), epoch=int(reply[i + 2]))
            for i in range(1, len(reply), 3)
        ]

    async def stats(self, job_id: str) -> JobStats:
        reply = await self._run("stats", job_id)
        counters = {name: int(value) for name, value in _pairs(reply[5]).items()}
        return JobStats(
            config=_config_from_hash(_pairs(reply[6])),
            queued_groups=int(reply[1]),
            queued_samples=counters.pop("queued_samples", 0),
            queued_tokens=counters.pop("queued_tokens", 0),
            leased_groups=int(reply[2]),
            requeued_pending=int(reply[3]),
            oldest_group_age_s=int(reply[4]) / 1000.0,
            counters=counters,
        )
