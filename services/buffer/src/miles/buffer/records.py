"""Small typed records passed between the store, the core and the gRPC layer (no protobuf, no Redis)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

StalePolicy = Literal["drop", "requeue", "mask"]
GroupFilter = Literal["none", "drop_equal_rewards"]
PushOutcome = Literal["queued", "duplicate", "rejected_all_aborted", "filtered"]
FilterReason = Literal["equal_rewards", "too_few_valid"]


@dataclass(frozen=True)
class JobConfig:
    """A job's buffer policy with defaults resolved: capacity_groups >= 1, min_valid_samples >= 1."""

    capacity_groups: int
    stale_policy: StalePolicy = "drop"
    group_filter: GroupFilter = "none"
    min_valid_samples: int = 1


@dataclass(frozen=True)
class PushResult:
    outcome: PushOutcome
    num_queued_groups: int
    filter_reason: FilterReason | None = None


@dataclass(frozen=True)
class LeasedRecord:
    """One leased group as stored: its serialized Group, staleness at pull time and redelivery count."""

    lease_id: str
    group_bytes: bytes
    staleness: int
    redelivery_count: int


@dataclass
class PullResult:
    """What one PullBatch did: the leased groups plus stale groups removed and expired leases returned."""

    groups: list[LeasedRecord] = field(default_factory=list)
    lease_expires_unix_ms: int = 0
    num_dropped_stale: int = 0
    num_requeued: int = 0
    num_expired_leases: int = 0
    num_stale_masked: int = 0
    """Leased groups with spans over the staleness bound (mask policy: the trainer masks those spans)."""


@dataclass(frozen=True)
class AckResult:
    num_acked: int
    num_already_acked: int
    expired_lease_ids: list[str]


@dataclass(frozen=True)
class ExtendResult:
    num_extended: int
    lease_expires_unix_ms: int
    expired_lease_ids: list[str]


@dataclass(frozen=True)
class RequeuedPrompt:
    group_id: str
    prompt_index: int
    epoch: int


@dataclass(frozen=True)
class JobStats:
    """One job's buffer as Redis holds it at one instant (counters are totals since the job was configured)."""

    config: JobConfig
    queued_groups: int
    queued_samples: int
    queued_tokens: int
    leased_groups: int
    requeued_pending: int
    oldest_group_age_s: float
    counters: dict[str, int]

    def counter(self, name: str) -> int:
        return self.counters.get(name, 0)

    @property
    def avg_staleness(self) -> float:
        pulled = self.counter("pulled")
        return self.counter("staleness_sum") / pulled if pulled else 0.0

    @property
    def filtered_total(self) -> int:
        return self.counter("filtered_equal_rewards") + self.counter("filtered_too_few_valid")
