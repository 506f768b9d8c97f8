"""Test infrastructure shared by every service's tests: real Redis, free ports, real service subprocesses.

Nothing here fakes a part that can run on this machine. Imported by tests only; never by service code.
"""

from miles.common.testing.ports import free_port
from miles.common.testing.processes import ServiceProcess, wait_for_http_ready
from miles.common.testing.redis_server import RedisServer, find_redis_server_binary

__all__ = ["RedisServer", "ServiceProcess", "find_redis_server_binary", "free_port", "wait_for_http_ready"]
