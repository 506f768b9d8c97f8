"""The buffer's job-control RPCs need the operator token; the jobs' data plane stays open (real subprocess)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from miles.buffer.client import BufferClient, RetryPolicy
from miles.common.errors import MilesError, PermissionDeniedError, UnauthenticatedError

if TYPE_CHECKING:
    from conftest import BufferProcess, GroupFactory

pytestmark = pytest.mark.integration

OPERATOR_TOKEN = "buffer-operator-token-for-tests-0123456789"
NO_RETRY = RetryPolicy(max_attempts=1)


def _client(buffer: BufferProcess, token: str) -> BufferClient:
    return buffer.client(operator_token=token, retry=NO_RETRY)


async def _error_of_configure(buffer: BufferProcess, token: str, job_id: str) -> type[MilesError] | None:
    async with _client(buffer, token) as client:
        try:
            await client.configure_job(job_id, capacity_groups=8, stale_policy="drop")
        except MilesError as error:
            return type(error)
    return None


async def test_control_rpcs_need_the_operator_token_and_data_rpcs_do_not(
    redis_url: str, start_buffer: Callable[..., BufferProcess], make_group: GroupFactory, job_id: str
) -> None:
    buffer = start_buffer(redis_url, MILES_BUFFER_OPERATOR_TOKEN=OPERATOR_TOKEN)

    assert await _error_of_configure(buffer, "", job_id) is UnauthenticatedError
    assert await _error_of_configure(buffer, "x" * 40, job_id) is PermissionDeniedError
    assert await _error_of_configure(buffer, OPERATOR_TOKEN, job_id) is None

    async with _client(buffer, "") as worker:
        await worker.push_group(job_id, make_group("g-0"))
        stats = await worker.stats(job_id)
        assert stats.queued_groups == 1
        with pytest.raises(UnauthenticatedError):
            await worker.delete_job(job_id)

    async with _client(buffer, OPERATOR_TOKEN) as operator:
        await operator.delete_job(job_id)


async def test_without_a_token_on_loopback_everything_is_open(buffer_process: BufferProcess, job_id: str) -> None:
    assert await _error_of_configure(buffer_process, "", job_id) is None
