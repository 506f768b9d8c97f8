"""Exactly-once consumption of buffer groups: what the trainer holds leased, and when it acks.

The buffer delivers at least once; the trainer turns that into exactly-once *effect*:
- every pulled group stays leased (extended every lease_s / 3 by `keep_leases`) until a durable checkpoint
  contains its update, and only then is it acked;
- after a crash the restarted trainer releases its predecessor's leases (same consumer id), restores the last
  checkpoint, and trains again only what that checkpoint does not contain;
- a group that comes back although the restored checkpoint already holds its update (the crash fell between
  the checkpoint and its acks) is recognised by id (`TrainerState.committed_group_ids`), not trained, and acked
  with the next checkpoint. Groups trained since the last checkpoint are recognised the same way.
- a group the trainer cannot train on is nacked with discard and its reason, right away.

Limit: if a lease expires anyway (the trainer stalled longer than lease_s), the buffer may hand the group to
another consumer; the trainer counts it in `miles_trainer_leases_lost_total`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from miles.buffer.client import BufferClient
from miles.common.errors import InvalidArgumentError
from miles.proto.buffer.v1 import buffer_pb2

log = logging.getLogger(__name__)


@dataclass
class Holdings:
    """Leases the trainer holds: `pulled` (in hand, not trained yet), `trained` (trained since the last
    checkpoint), `redundant` (redelivered groups already trained: acked with the next checkpoint)."""

    pulled: dict[str, str] = field(default_factory=dict)
    trained: dict[str, str] = field(default_factory=dict)
    redundant: dict[str, str] = field(default_factory=dict)
    trained_group_ids: list[str] = field(default_factory=list)

    def all_lease_ids(self) -> list[str]:
        return [*self.pulled.values(), *self.trained.values(), *self.redundant.values()]

    def already_trained(self, group_id: str) -> bool:
        """Trained since the last checkpoint (the trainer also checks the recent checkpoints' ids)."""
        return group_id in self.trained

    def mark_trained(self, group_ids: list[str]) -> None:
        for group_id in group_ids:
            self.trained[group_id] = self.pulled.pop(group_id)
        self.trained_group_ids.extend(group_ids)

    def leases_to_ack(self) -> list[str]:
        return [*self.trained.values(), *self.redundant.values()]

    def committed(self) -> None:
        """A checkpoint made the trained groups durable (their acks follow)."""
        self.trained_group_ids = []
        self.trained.clear()
        self.redundant.clear()


@dataclass
class LeaseOutcome:
    num_acked: int
    expired_lease_ids: list[str]


class Consumer:
    """The trainer's side of the buffer protocol for one job."""

    def __init__(self, client: BufferClient, job_id: str, consumer_id: str, lease_s: float) -> None:
        self.client = client
        self.job_id = job_id
        self.consumer_id = consumer_id
        self.lease_s = lease_s
        self.holdings = Holdings()

    async def release_predecessor(
        self, *, retry_s: float = 1.0, should_stop: Callable[[], bool] = lambda: False
    ) -> int:
        """Hand back every lease a previous incarnation of this consumer held (a restart after a crash).

        Waits while the job is not configured in the buffer yet (the controller may start the trainer first)."""
        while True:
            try:
                return await self.client.release_consumer(self.job_id, self.consumer_id, reason="trainer restarted")
            except InvalidArgumentError as exc:
                if exc.field != "job_id":
                    raise
                if should_stop():
                    return 0
                log.info("waiting for the job to be configured in the buffer", extra={"job_id": self.job_id})
                await asyncio.sleep(retry_s)

    async def pull(
        self, num_groups: int, *, trainer_version: int, max_staleness: int, wait_s: float
    ) -> buffer_pb2.PullBatchResponse:
        return await self.client.pull_batch(
            self.job_id,
            num_groups=num_groups,
            trainer_version=trainer_version,
            max_staleness=max_staleness,
            lease_s=self.lease_s,
            wait_s=wait_s,
            min_groups=num_groups,
            consumer_id=self.consumer_id,
        )

    async def discard(self, lease_id: str, reason: str) -> None:
        await self.client.nack(self.job_id, [lease_id], reason=reason, discard=True)

    async def ack_committed(self) -> LeaseOutcome:
        """Ack every lease whose group a durable checkpoint now holds; then forget them."""
        lease_ids = self.holdings.leases_to_ack()
        self.holdings.committed()
        if not lease_ids:
            return LeaseOutcome(0, [])
        response = await self.client.ack(self.job_id, lease_ids)
        expired = list(response.expired_lease_ids)
        if expired:
            log.warning("leases expired before their ack", extra={"num_expired": len(expired)})
        return LeaseOutcome(response.num_acked + response.num_already_acked, expired)

    async def release_all(self, reason: str) -> int:
        """Give back every lease held (stop without checkpoint: the groups are retrained after a restart)."""
        self.holdings.pulled.clear()
        self.holdings.trained.clear()
        self.holdings.redundant.clear()
        try:
            return await self.client.release_consumer(self.job_id, self.consumer_id, reason=reason)
        except InvalidArgumentError as exc:
            if exc.field == "job_id":  # the job was never configured (or was deleted): nothing is held
                return 0
            raise

    async def drain_redundant(
        self, is_committed: Callable[[str], bool], batch_size: int, on_redundant: Callable[[], None]
    ) -> None:
        """After the last step: take back groups whose update a checkpoint already holds (a crash fell between
        that checkpoint and its acks) so that the next ack removes them instead of leaving them queued. They sit
        at the head of the queue; draining stops at the first group that is not one of them (handed back)."""
        while True:
            response = await self.client.pull_batch(
                self.job_id,
                num_groups=batch_size,
                trainer_version=0,
                max_staleness=2**62,
                lease_s=self.lease_s,
                wait_s=0.0,
                consumer_id=self.consumer_id,
            )
            leftovers = []
            for leased in response.groups:
                if is_committed(leased.group.group_id):
                    self.holdings.redundant[leased.group.group_id] = leased.lease_id
                    on_redundant()
                else:
                    leftovers.append(leased.lease_id)
            if leftovers:
                await self.client.nack(self.job_id, leftovers, reason="trainer finished")
            if leftovers or not response.groups:
                return

    async def extend_all(self) -> list[str]:
        lease_ids = self.holdings.all_lease_ids()
        if not lease_ids:
            return []
        response = await self.client.extend_lease(self.job_id, lease_ids, self.lease_s)
        return list(response.expired_lease_ids)

    async def keep_leases(self, on_expired: Callable[[int], None]) -> None:
        """Background task: extend every held lease every lease_s / 3 until cancelled; `on_expired(n)` is told
        about leases found expired."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                expired = await self.extend_all()
            except Exception:
                log.exception("extending leases failed; retrying at the next interval")
                continue
            if expired:
                log.warning("held leases expired", extra={"num_expired": len(expired)})
                on_expired(len(expired))
