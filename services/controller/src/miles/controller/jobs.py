"""The job record and its state machine (no I/O: the store persists it, the supervisor drives it).

    PENDING ──▶ RUNNING ──▶ SUCCEEDED
       │        ▲  │ ├──────▶ FAILED
       │        │  ▼ └──────▶ CANCELLED
       │       QUEUED ─────▶ SUCCEEDED | FAILED | CANCELLED
       ├──▶ QUEUED
       ├──────────────────▶ FAILED
       └──────────────────▶ CANCELLED

PENDING: accepted; shared services being configured, per-job resources being created or not ready yet.
QUEUED: waiting for admission by a queue (Kueue, `spec.kueue`): the per-job resources exist but are scaled to zero;
a RUNNING job that the queue preempts goes back to QUEUED (its resources are suspended) and runs again when
readmitted.
RUNNING: the backend reports the job's resources running. The three others are terminal: nothing leaves them.
"""

from __future__ import annotations

import enum
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from miles.common.jobspec.job import JobSpec


class JobState(enum.StrEnum):
    PENDING = "PENDING"
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE_STATES = frozenset({JobState.PENDING, JobState.QUEUED, JobState.RUNNING})

LEGAL_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.QUEUED, JobState.RUNNING, JobState.FAILED, JobState.CANCELLED}),
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}),
    JobState.RUNNING: frozenset({JobState.QUEUED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}
"""Every allowed state change; anything else is refused (the store checks it atomically in Redis)."""


def is_legal_transition(current: JobState, new: JobState) -> bool:
    return new in LEGAL_TRANSITIONS[current]


def sources_of(new: JobState) -> list[JobState]:
    """The states from which `new` may be reached."""
    return [state for state, targets in LEGAL_TRANSITIONS.items() if new in targets]


def new_job_id() -> str:
    """`j` + 12 hex digits: a DNS label short enough for every per-job object name (Kubernetes: <= 20)."""
    return f"j{secrets.token_hex(6)}"


MAX_ERRORS_KEPT = 20


@dataclass
class JobRecord:
    """One job as stored: its spec, state and what was last observed of it.

    `progress` holds the latest observation (step, weight_version, pools, metrics); `errors` the latest problems
    (newest last, at most MAX_ERRORS_KEPT).
    """

    job_id: str
    spec: JobSpec
    state: JobState
    created_at_s: float
    updated_at_s: float
    started_at_s: float | None = None
    ended_at_s: float | None = None
    cancel_requested: bool = False
    resize_pending: bool = False
    step: int = 0
    weight_version: int = 0
    pools: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    """Mean reward of each step the controller observed, oldest first (health.py)."""

    @property
    def spec_json(self) -> str:
        """The spec as stored (compare-and-set of resizes compares this text)."""
        return self.spec.model_dump_json()

    def to_redis(self) -> dict[str, str]:
        """Hash fields; each is written on its own so that concurrent writers of different fields never clash."""
        return {
            "job_id": self.job_id,
            "spec": self.spec_json,
            "state": self.state.value,
            "created_at_s": repr(self.created_at_s),
            "updated_at_s": repr(self.updated_at_s),
            "started_at_s": "" if self.started_at_s is None else repr(self.started_at_s),
            "ended_at_s": "" if self.ended_at_s is None else repr(self.ended_at_s),
            "cancel_requested": "1" if self.cancel_requested else "",
            "resize_pending": "1" if self.resize_pending else "",
            "step": str(self.step),
            "weight_version": str(self.weight_version),
            "pools": json.dumps(self.pools),
            "metrics": json.dumps(self.metrics),
            "errors": json.dumps(self.errors),
            "rewards": json.dumps(self.rewards),
        }

    @classmethod
    def from_redis(cls, data: dict[str, str]) -> JobRecord:
        def optional_float(name: str) -> float | None:
            raw = data.get(name, "")
            return float(raw) if raw else None

        return cls(
            job_id=data["job_id"],
            spec=JobSpec.model_validate_json(data["spec"]),
            state=JobState(data["state"]),
            created_at_s=float(data["created_at_s"]),
            updated_at_s=float(data["updated_at_s"]),
            started_at_s=optional_float("started_at_s"),
            ended_at_s=optional_float("ended_at_s"),
            cancel_requested=bool(data.get("cancel_requested")),
            resize_pending=bool(data.get("resize_pending")),
            step=int(data.get("step") or 0),
            weight_version=int(data.get("weight_version") or 0),
            pools=_json_dict(data.get("pools")),
            metrics=_json_dict(data.get("metrics")),
            errors=list(json.loads(data.get("errors") or "[]")),
            rewards=[float(r) for r in json.loads(data.get("rewards") or "[]")],
        )


def _json_dict(raw: str | None) -> dict[str, Any]:
    value = json.loads(raw or "{}")
    return value if isinstance(value, dict) else {}
