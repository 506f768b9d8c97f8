"""The Redis test fixture starts a real redis-server, and AOF makes its data survive a crash."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from miles.common.testing import RedisServer, free_port

pytestmark = pytest.mark.integration  # real redis-servers


def test_redis_fixture_is_a_real_server(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    info = client.info("server")
    client.set("miles:test", "value")
    assert info["redis_version"].count(".") == 2
    assert int(info["process_id"]) > 0
    assert client.get("miles:test") == b"value"
    client.close()


def test_redis_fixture_db_is_flushed_per_test(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    assert client.dbsize() == 0
    client.close()


def test_aof_keeps_writes_across_kill9_restart(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", free_port(), appendfsync="always")
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        client.rpush("miles:queue", "a", "b", "c")
        client.close()
        server.restart(kill=True)
        client = redis.Redis.from_url(server.url)
        assert client.lrange("miles:queue", 0, -1) == [b"a", b"b", b"c"]
        client.close()
    finally:
        server.stop()
