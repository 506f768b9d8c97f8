"""The tree part of RedisStore: a tree session's nodes beside its hash (same hash tag, so one slot).

Keys (`S` = the session's hash key `P:s:{id}`):
- `S:nodes` hash: node id -> TreeNode JSON (without ids).
- `S:node_ids` hash: node id -> the node's stored ids (`delta`, int32 little-endian).
- `S:node_routing` hash: node id -> the node's packed routing chunk (R3 sessions only).
- `S` itself keeps `tree_tokens` (stored ids over all nodes) and counts commits in `version`, not_recorded as for
  a linear session.
Adding a node is one Lua script that checks the bounds, writes the three fields and refreshes every expiry (the
same TTL rule as a linear commit); reads are plain HGETALL / HMGET and take no lock, so GET and samples never
block a turn.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from miles.session.errors import StoreUnavailableError
from miles.session.records import CommitOutcome, dumps, pack_ids, unpack_ids
from miles.session.tree import TreeCommit, TreeNode

P = ParamSpec("P")
T = TypeVar("T")

TREE_SUFFIXES = (":nodes", ":node_ids", ":node_routing")
# KEYS: hash, nodes, node_ids, live, node_routing. ARGV: node id, node JSON, ids, ttl ms, session id, expiry ms,
# max nodes, max tokens, number of ids, routing chunk, "1" when the commit carries a chunk.
# -> 1 added | -1 no session | -4 max nodes | -5 max tokens
_ADD_NODE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[7]) then
  redis.call('HINCRBY', KEYS[1], 'not_recorded', 1)
  return -4
end
local tokens = tonumber(redis.call('HGET', KEYS[1], 'tree_tokens') or '0')
if tokens + tonumber(ARGV[9]) > tonumber(ARGV[8]) then
  redis.call('HINCRBY', KEYS[1], 'not_recorded', 1)
  return -5
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('HINCRBY', KEYS[1], 'tree_tokens', tonumber(ARGV[9]))
redis.call('HINCRBY', KEYS[1], 'version', 1)
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
if ARGV[11] == '1' then
  redis.call('HSET', KEYS[5], ARGV[1], ARGV[10])
  redis.call('PEXPIRE', KEYS[5], ARGV[4])
end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
local idem = redis.call('HGET', KEYS[1], 'idem')
if idem then redis.call('PEXPIRE', idem, ARGV[4]) end
redis.call('ZADD', KEYS[4], ARGV[6], ARGV[5])
return 1
"""


def store_errors(method: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Redis failures become StoreUnavailableError (503 with Retry-After), never a 500."""

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await method(*args, **kwargs)
        except (RedisError, OSError) as exc:
            message = f"session store unavailable: {type(exc).__name__}: {exc}"
            raise StoreUnavailableError(message, retry_after_s=1.0) from exc

    return wrapper


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()  # the client never decodes: always bytes


class RedisTree:
    """Mixed into RedisStore (which provides `_redis`, `_prefix` and `_key`)."""

    _redis: aioredis.Redis
    _prefix: str

    def _key(self, session_id: str, suffix: str = "") -> str:
        raise NotImplementedError

    def _register_tree_scripts(self) -> None:
        self._add_node = self._redis.register_script(_ADD_NODE)

    @store_errors
    async def load_tree(self, session_id: str) -> list[TreeNode]:
        raw = await self._redis.hvals(self._key(session_id, ":nodes"))
        return [TreeNode.from_json(json.loads(item)) for item in raw]

    @store_errors
    async def load_tree_ids(self, session_id: str, node_ids: list[str] | None = None) -> dict[str, list[int]]:
        key = self._key(session_id, ":node_ids")
        if node_ids is None:
            items = await self._redis.hgetall(key)
            return {_text(node_id): unpack_ids(_bytes(data)) for node_id, data in items.items()}
        if not node_ids:
            return {}
        values = await self._redis.hmget(key, node_ids)
        pairs = zip(node_ids, values, strict=True)
        return {node_id: unpack_ids(_bytes(data)) for node_id, data in pairs if data is not None}

    @store_errors
    async def load_tree_routing(self, session_id: str) -> dict[str, bytes]:
        items = await self._redis.hgetall(self._key(session_id, ":node_routing"))
        return {_text(node_id): _bytes(data) for node_id, data in items.items()}

    @store_errors
    async def add_node(self, session_id: str, commit: TreeCommit) -> CommitOutcome:
        key = self._key(session_id)
        keys = [key, f"{key}:nodes", f"{key}:node_ids", f"{self._prefix}:live", f"{key}:node_routing"]
        ttl_ms = max(1, int(commit.ttl_s * 1000))
        args: list[str | bytes | int] = [
            commit.node.node_id,
            dumps(commit.node.to_json()),
            pack_ids(commit.delta_ids),
            ttl_ms,
            session_id,
            int(time.time() * 1000) + ttl_ms,
            commit.max_nodes,
            commit.max_tokens,
            len(commit.delta_ids),
            commit.routing or b"",
            "0" if commit.routing is None else "1",
        ]
        result = int(await self._add_node(keys=keys, args=args))
        if result == -1:
            return CommitOutcome.SESSION_GONE
        if result in (-4, -5):
            return CommitOutcome.TREE_FULL
        return CommitOutcome.COMMITTED
