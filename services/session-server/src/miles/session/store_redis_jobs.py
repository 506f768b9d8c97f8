"""The job part of RedisStore: job model configs and the live adapter of a LoRA job (no expiry on either).

Keys (`P` = key_prefix):
- `P:job:<job_id>:config` the job's ModelConfig JSON (deleted by the controller).
- `P:job:<job_id>:adapter` hash `lora_name`, `weight_version` (decimal): the job's live adapter (adapters.py), set
  by the trainer, deleted with the config. Setting it is one Lua script: it needs the config to exist and never
  lowers the version (compared as canonical decimal strings, so any int is exact), so concurrent publishers and a
  concurrent config delete cannot leave a regressed or orphaned adapter.
A turn of a LoRA job reads the adapter with one HMGET.
"""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis

from miles.session.records import LiveAdapter, ModelConfig, dumps
from miles.session.store_redis_tree import store_errors

# KEYS: config, adapter. ARGV: lora_name, weight_version (decimal, no leading zeros).
# -> nil (no config) | {lora_name, weight_version} live after the call (the held one when it is newer)
_SET_ADAPTER = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local held = redis.call('HMGET', KEYS[2], 'lora_name', 'weight_version')
local version = held[2]
if version and (#version > #ARGV[2] or (#version == #ARGV[2] and version > ARGV[2])) then return held end
redis.call('HSET', KEYS[2], 'lora_name', ARGV[1], 'weight_version', ARGV[2])
return {ARGV[1], ARGV[2]}
"""


def _adapter(values: list[Any]) -> LiveAdapter | None:
    name, version = values
    if name is None or version is None:
        return None
    as_text = [value.decode() if isinstance(value, bytes) else str(value) for value in (name, version)]
    return LiveAdapter(lora_name=as_text[0], weight_version=int(as_text[1]))


class RedisJobs:
    """Mixed into RedisStore (which provides `_redis` and `_prefix`)."""

    _redis: aioredis.Redis
    _prefix: str

    def _register_job_scripts(self) -> None:
        self._set_adapter = self._redis.register_script(_SET_ADAPTER)

    def _job_key(self, job_id: str, suffix: str = "config") -> str:
        return f"{self._prefix}:job:{job_id}:{suffix}"

    @store_errors
    async def put_job_config(self, job_id: str, config: ModelConfig) -> None:
        await self._redis.set(self._job_key(job_id), dumps(config.to_json()))

    @store_errors
    async def get_job_config(self, job_id: str) -> ModelConfig | None:
        raw = await self._redis.get(self._job_key(job_id))
        return None if raw is None else ModelConfig.from_json(json.loads(raw))

    @store_errors
    async def delete_job_config(self, job_id: str) -> bool:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._job_key(job_id))
            pipe.delete(self._job_key(job_id, "adapter"))
            num_configs, _ = await pipe.execute()
        return bool(num_configs)

    @store_errors
    async def set_adapter(self, job_id: str, adapter: LiveAdapter) -> LiveAdapter | None:
        keys = [self._job_key(job_id), self._job_key(job_id, "adapter")]
        held = await self._set_adapter(keys=keys, args=[adapter.lora_name, str(adapter.weight_version)])
        return None if held is None else _adapter(held)

    @store_errors
    async def get_adapter(self, job_id: str) -> LiveAdapter | None:
        return _adapter(await self._redis.hmget(self._job_key(job_id, "adapter"), ["lora_name", "weight_version"]))
