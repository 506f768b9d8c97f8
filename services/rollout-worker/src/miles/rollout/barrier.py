"""Admission of groups by weight version: the barrier of `train.mode: sync`, and the staleness window of async.

**Sync** (`versions_ahead` 0): exactly one batch per weight version, then wait.

The classic synchronous RL loop, as the baseline users compare asynchronous training against: while the engines
serve version v, the job's workers start groups for v until `batch_size_groups` of them are admitted; then no
new group starts until every available engine of the job's pool serves a newer version (the trainer trained on
the batch and its weights are loaded). Nothing generated is thrown away: every admitted group is generated at v
and trained at staleness 0. A group the filters drop (`group_filters`), one that could not run (session server
down) and one the buffer already had (a duplicate push after a crash) give their place back, so a replacement is
admitted and the batch still fills. Under the trainer's dynamic sampling (the default), a group whose rewards are
all equal is such a filtered group: the trainer would discard it and wait for a batch the barrier never completes.
A batch can still leave the trainer short: a group it discards after pulling it (a malformed one; with dynamic
sampling, zero-signal groups the workers did not filter) never counts. The buffer counts those discards; for each
new one a waiting worker sees, one more place opens at the live version (one Lua script, so that of several
workers only one opens it; counted in `miles_rollout_sync_barrier_refills_total`), so a job never stops at a
version for good. In a barrier job groups the buffer drops as stale are not compensated: only a surplus group can
be stale there, and replacing it would make a surplus at every version.

Admission is shared by all of the job's workers through one Redis set per version (`sync:<v>`, one Lua
script): a seq already in the set is admitted again (a dead worker's leased prompt, reclaimed by another, keeps
its place), otherwise it is added while the set holds fewer than `batch_size_groups`. A claimed prompt waits
for admission inside its lease (the scheduler's heartbeat renews it).

Which version is live comes from the rollout router (`GET /v1/weight_version?pool=<job pool>`: the lowest
version among the pool's available engines). The router learns a new version when weight-sync undrains an
updated engine (pause_mode drain, the default) or at its next version poll (`version_poll_interval_s`, 2 s)
otherwise.

**Async** (`versions_ahead` = the trainer's max_staleness S): a group is admitted into the batch of one of the
versions v .. v+S (v live), the first with a place. The trainer trains batch u at version u, so a group admitted
while v is live is trained at most S versions after the weights it starts with: staleness is bounded by what is
admitted instead of by dropping what was generated. At most (S+1) batches are ahead of the trainer; when the
window is full, new groups wait for the next version, and the engines stay busy with the groups already admitted.
Only a straggler (a long-tail episode still running when the trainer has moved S versions past its batch) can
still end up stale, and the buffer drops (or requeues) it as before; each such group opens a place, like a discard
(the worker counts the buffer's stale drops and requeues with its discards): a place left taken by a group that
will never be trained shrinks the window for good, and in `make bench-async` the window had shrunk to ~4 episodes
in flight of its 24. Places given back and discards work as for sync.

Limits: a job on a shared LoRA pool has no engine version of its own (adapter versions): its workers run
without admission, `sync` then means the trainer takes only staleness-0 groups, and async the trainer's bound.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from miles.common.aio import raise_if_cancel_requested
from miles.rollout.metrics import RolloutMetrics

log = logging.getLogger(__name__)

LiveVersionFn = Callable[[], Awaitable[int | None]]
"""The version every available engine of the job's pool serves (the lowest), None while unknown."""
KEY_TTL_S = 86_400
"""How long a version's admission set is kept after its last change (a version lasts one trainer step)."""

DiscardedFn = Callable[[], Awaitable[int | None]]
"""How many of the job's groups the trainer discarded after pulling them (the buffer's count); None: unknown now."""
REFILL_CHECK_S = 1.0
"""How often a waiting prompt asks the buffer for new discards."""
STUCK_LOG_S = 60.0
"""A prompt waiting this long (for a known live version, or for a place) says so in a WARNING, then again after
as long: a job stopped at admission must be diagnosable from its worker's log."""

_REFILL = """
local seen = tonumber(redis.call('GET', KEYS[1]) or ARGV[1])
local now = tonumber(ARGV[1])
redis.call('SET', KEYS[1], now, 'EX', tonumber(ARGV[2]))
if now <= seen then
  return 0
end
redis.call('INCRBY', KEYS[2], now - seen)
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
return now - seen
"""

# KEYS: (admission set, extra places) per version of the window, oldest first. ARGV: seq, batch size, ttl s.
# -> the window index of the set holding seq (already there, or added to the first with a place), else -1.
_ADMIT = """
for i = 1, #KEYS, 2 do
  if redis.call('SISMEMBER', KEYS[i], ARGV[1]) == 1 then
    return (i - 1) / 2
  end
end
for i = 1, #KEYS, 2 do
  local limit = tonumber(ARGV[2]) + tonumber(redis.call('GET', KEYS[i + 1]) or '0')
  if redis.call('SCARD', KEYS[i]) < limit then
    redis.call('SADD', KEYS[i], ARGV[1])
    redis.call('EXPIRE', KEYS[i], tonumber(ARGV[3]))
    return (i - 1) / 2
  end
end
return -1
"""


class SyncBarrier:
    def __init__(
        self,
        client: aioredis.Redis,
        *,
        key_prefix: str,
        job_id: str,
        batch_size_groups: int,
        live_version: LiveVersionFn,
        metrics: RolloutMetrics,
        poll_interval_s: float = 0.1,
        http_client: httpx.AsyncClient | None = None,
        drop_equal_rewards: bool = False,
        discarded: DiscardedFn | None = None,
        refill_check_s: float = REFILL_CHECK_S,
        versions_ahead: int = 0,
    ) -> None:
        """`http_client`: the client `live_version` uses, closed with the barrier. `drop_equal_rewards`: groups
        of equal rewards do not count (the trainer's dynamic sampling would discard them). `discarded`: the
        buffer's count of groups the trainer discarded; each new one opens a place (see the module docstring).
        `versions_ahead`: 0 is the sync barrier; S > 0 the async staleness window of S versions past the live one."""
        if batch_size_groups < 1:
            raise ValueError("batch_size_groups must be >= 1")
        if versions_ahead < 0:
            raise ValueError("versions_ahead must be >= 0")
        self.versions_ahead = versions_ahead
        self._client = client
        self._base = f"{key_prefix}:{{{job_id}}}:sync"
        self.batch_size_groups = batch_size_groups
        self._live_version = live_version
        self._metrics = metrics
        self.poll_interval_s = poll_interval_s
        self._admit = client.register_script(_ADMIT)
        self._admitted: dict[int, int] = {}
        """seq -> the version it was admitted for (to give the place back)."""
        self._http_client = http_client
        self.drop_equal_rewards = drop_equal_rewards
        self._discarded = discarded
        self.refill_check_s = refill_check_s
        self._refill = client.register_script(_REFILL)

    @classmethod
    def through_router(
        cls,
        client: aioredis.Redis,
        *,
        key_prefix: str,
        job_id: str,
        batch_size_groups: int,
        router_url: str,
        pool: str,
        metrics: RolloutMetrics,
        drop_equal_rewards: bool = False,
        discarded: DiscardedFn | None = None,
        versions_ahead: int = 0,
    ) -> SyncBarrier:
        http_client = httpx.AsyncClient(timeout=10.0)
        return cls(
            client,
            key_prefix=key_prefix,
            job_id=job_id,
            batch_size_groups=batch_size_groups,
            live_version=router_live_version(http_client, router_url, pool),
            metrics=metrics,
            http_client=http_client,
            drop_equal_rewards=drop_equal_rewards,
            discarded=discarded,
            versions_ahead=versions_ahead,
        )

    async def start(self) -> None:
        """Records the buffer's discard count the job starts from, unless a worker did before (a restart)."""
        count = await self._discarded() if self._discarded is not None else None
        if count is not None:
            key = f"{self._base}:discarded"
            await _retrying(functools.partial(self._client.set, key, count, nx=True, ex=KEY_TTL_S))

    async def close(self) -> None:
        if self._http_client is not None:
            await self._http_client.aclose()

    async def admit(self, seq: int) -> int:
        """Waits until `seq` has a place in the batch of a version of the window (the live one's for sync; one
        given back, or a later version's); returns that version."""
        waited_since: float | None = None
        refill_at = time.monotonic() + self.refill_check_s
        warn_at = time.monotonic() + STUCK_LOG_S
        while True:
            raise_if_cancel_requested()  # a cancellation a Redis call swallowed must still end the wait
            live = await self._wait_for_version()
            keys = []
            for version in range(live, live + self.versions_ahead + 1):
                keys += [f"{self._base}:{version}", f"{self._base}:{version}:extra"]
            args = [seq, self.batch_size_groups, KEY_TTL_S]
            index = int(await _retrying(functools.partial(self._admit, keys=keys, args=args)))
            if index >= 0:
                version = live + index
                break
            waited_since = waited_since or time.monotonic()
            if time.monotonic() >= warn_at:
                warn_at = time.monotonic() + STUCK_LOG_S
                await self._log_full_window(seq, live, waited_since)
            if time.monotonic() >= refill_at:
                refill_at = time.monotonic() + self.refill_check_s
                await self._refill_discarded(live, keys[1])
            await asyncio.sleep(self.poll_interval_s)
        if waited_since is not None:
            self._metrics.sync_barrier_wait_s.inc(time.monotonic() - waited_since)
        self._admitted[seq] = version
        self._metrics.sync_batch_version.set(version)
        return version

    async def give_back(self, seq: int) -> None:
        """`seq`'s group will not reach the trainer (filtered, or retried later): its place goes to another."""
        version = self._admitted.pop(seq, None)
        if version is not None:  # retried: a place never given back would leave the batch short forever
            await _retrying(lambda: self._client.srem(f"{self._base}:{version}", seq))

    async def _refill_discarded(self, version: int, extra_key: str) -> None:
        """Opens one place at `version` per group the trainer discarded since any worker last looked."""
        count = await self._discarded() if self._discarded is not None else None
        if count is None:
            return
        keys = [f"{self._base}:discarded", extra_key]
        opened = int(await _retrying(functools.partial(self._refill, keys=keys, args=[count, KEY_TTL_S])))
        if opened > 0:
            self._metrics.sync_barrier_refills.inc(opened)
            log.info("places opened for groups the trainer discarded", extra={"version": version, "num": opened})

    def forget(self, seq: int) -> None:
        """`seq`'s group was pushed: it keeps its place; nothing more to remember here."""
        self._admitted.pop(seq, None)

    async def _log_full_window(self, seq: int, live: int, waited_since: float) -> None:
        sizes = []
        for version in range(live, live + self.versions_ahead + 1):
            sizes.append(await _retrying(functools.partial(self._client.scard, f"{self._base}:{version}")))
        log.warning(
            "a prompt still waits for a place in the admission window",
            extra={"seq": seq, "live_version": live, "admitted_per_version": sizes, "waited_s": _since(waited_since)},
        )

    async def _wait_for_version(self) -> int:
        started = time.monotonic()
        warn_at = started + STUCK_LOG_S
        while True:
            raise_if_cancel_requested()
            try:
                version = await self._live_version()
            except (httpx.HTTPError, ValueError) as exc:  # the router restarting: keep waiting
                log.warning("could not read the live weight version", extra={"error": str(exc)})
                version = None
            if version is not None:
                return version
            if time.monotonic() >= warn_at:
                warn_at = time.monotonic() + STUCK_LOG_S
                log.warning(
                    "the router knows no live weight version of the pool (no available engine, or one whose "
                    "version it has not read yet): admission waits",
                    extra={"waited_s": _since(started)},
                )
            await asyncio.sleep(self.poll_interval_s)


def _since(started: float) -> float:
    return round(time.monotonic() - started, 1)


async def _retrying(call: Callable[[], Awaitable[Any]]) -> Any:
    """`call()`, retried with backoff while Redis is unreachable."""
    delay_s = 0.1
    while True:
        try:
            return await call()
        except RedisError:
            raise_if_cancel_requested()  # redis-py can turn a cancellation into a connection error
            log.warning("barrier call failed (Redis); retrying", exc_info=True)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 5.0)


def router_live_version(client: httpx.AsyncClient, router_url: str, pool: str) -> LiveVersionFn:
    """The live version of `pool` as the rollout router sees it (`GET /v1/weight_version`)."""
    url = f"{router_url.rstrip('/')}/v1/weight_version"

    async def live_version() -> int | None:
        response = await client.get(url, params={"pool": pool})
        response.raise_for_status()
        version = response.json().get("min_weight_version")
        return None if version is None else int(version)

    return live_version
