"""Free loopback ports for servers started by tests: the production helper, re-exported for the tests' imports."""

from __future__ import annotations

from miles.common.ports import free_port

__all__ = ["free_port"]
