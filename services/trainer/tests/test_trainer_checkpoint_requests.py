"""The control API's checkpoint requests: every request waiting when a checkpoint runs gets its outcome, and a
checkpoint that raises answers them with TrainerNotRunningError instead of leaving them waiting for good."""

from __future__ import annotations

import asyncio

import pytest

from miles.trainer.checkpoint_requests import CheckpointOutcome, CheckpointRequests
from miles.trainer.errors import TrainerNotRunningError


async def test_one_checkpoint_answers_every_waiting_request() -> None:
    requests, calls = CheckpointRequests(), []

    async def checkpoint() -> CheckpointOutcome:
        calls.append(1)
        return CheckpointOutcome(step=3, path="/ckpt/3", num_groups_acked=2)

    waiting = [asyncio.create_task(requests.wait()) for _ in range(3)]
    await asyncio.sleep(0)
    await requests.serve(checkpoint)
    assert [await w for w in waiting] == [CheckpointOutcome(3, "/ckpt/3", 2)] * 3 and calls == [1]
    await requests.serve(checkpoint)  # nobody waits: no checkpoint
    assert calls == [1]


@pytest.mark.parametrize("error", [OSError("disk full"), asyncio.CancelledError()])
async def test_a_checkpoint_that_raises_answers_the_requests_it_served(error: BaseException) -> None:
    requests = CheckpointRequests()

    async def checkpoint() -> CheckpointOutcome:
        raise error

    waiting = [asyncio.create_task(requests.wait()) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(type(error)):
        await requests.serve(checkpoint)
    for task in waiting:
        with pytest.raises(TrainerNotRunningError, match="the checkpoint failed"):
            await asyncio.wait_for(task, 5)
    late = asyncio.create_task(requests.wait())  # asked after: answered by the loop's `fail`
    await asyncio.sleep(0)
    requests.fail("trainer failed")
    with pytest.raises(TrainerNotRunningError, match="trainer failed"):
        await late
