"""Following a job from the CLI: the controller's SSE stream parsed into events, and the live rich display.

`iter_events` reads `GET /v1/jobs/{id}/events` and reconnects with `Last-Event-ID` when the connection drops
(the controller replays what was missed), until the stream ends after the job's terminal state event.
`JobWatch` folds events into what the display shows and what `miles submit` / the demo report at the end:
the latest state, step, metrics, and the reward of every step it saw (the controller observes the trainer every
`observe_interval_s`, so a step shorter than that may be skipped; the table says which steps were seen).

Limits: tokens/s is the trainer's forward/backward throughput of its last step (the metric it reports), not
the engines' generation rate.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.console import Group, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from miles.controller.health import policy_reward

TERMINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


@dataclass(frozen=True)
class SseEvent:
    event_id: str
    type: str
    data: dict[str, Any]


def parse_sse_lines(lines: Iterator[str]) -> Iterator[SseEvent]:
    """Server-sent events from a line iterator (comments and `retry:` lines skipped)."""
    event_id, event_type = "", "message"
    data_lines: list[str] = []
    for line in lines:
        if line == "":
            if data_lines:
                yield SseEvent(event_id, event_type, json.loads("\n".join(data_lines)))
            event_type, data_lines = "message", []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "id":
            event_id = value
        elif name == "event":
            event_type = value
        elif name == "data":
            data_lines.append(value)


def iter_events(
    client: httpx.Client, job_id: str, *, after_id: str = "0", max_reconnects: int = 30
) -> Iterator[SseEvent]:
    """The job's events from `after_id` on; returns after the terminal state event (or when the stream ends)."""
    last_id, failures = after_id, 0
    while True:
        try:
            headers = {"Last-Event-ID": last_id, "Accept": "text/event-stream"}
            with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers, timeout=None) as response:
                response.raise_for_status()
                for event in parse_sse_lines(response.iter_lines()):
                    failures = 0
                    last_id = event.event_id or last_id
                    yield event
                    if event.type == "state" and event.data.get("state") in TERMINAL_STATES:
                        return
            return  # the server closed the stream: the job has ended
        except (httpx.TransportError, httpx.RemoteProtocolError):
            failures += 1
            if failures > max_reconnects:
                raise
            time.sleep(min(5.0, 0.5 * failures))


@dataclass
class JobWatch:
    """What the display shows, folded from events."""

    job_id: str
    num_steps: int = 0
    state: str = "PENDING"
    step: int = 0
    weight_version: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    pools: dict[str, int] = field(default_factory=dict)
    rewards_by_step: dict[int, float] = field(default_factory=dict)
    staleness_by_step: dict[int, float] = field(default_factory=dict)
    last_error: str = ""
    reason: str = ""
    started_at_s: float = field(default_factory=time.monotonic)

    def apply(self, event: SseEvent) -> None:
        data = event.data
        if event.type == "state":
            self.state = str(data.get("state", self.state))
            self.reason = str(data.get("reason", ""))
        elif event.type == "progress":
            self.step = int(data.get("step", self.step))
            self.num_steps = int(data.get("num_steps", self.num_steps))
            self.weight_version = int(data.get("weight_version", self.weight_version))
            self.pools = {k: int(v) for k, v in (data.get("pools") or {}).items()}
            self.metrics = {k: float(v) for k, v in (data.get("metrics") or {}).items() if _is_number(v)}
            reward = policy_reward(self.metrics)
            if self.step > 0 and reward is not None:
                self.rewards_by_step[self.step] = reward
                if "staleness_mean" in self.metrics:
                    self.staleness_by_step[self.step] = self.metrics["staleness_mean"]
            if self.state in ("PENDING", "QUEUED") and data.get("phase") == "running":
                self.state = "RUNNING"
        elif event.type == "error":
            self.last_error = str(data.get("message", ""))

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL_STATES

    def line(self) -> str:
        """One plain line of the current state (for logs)."""
        m = self.metrics
        return (
            f"job {self.job_id} {self.state} step {self.step}/{self.num_steps or '?'} "
            f"reward {_fmt(policy_reward(m))} staleness {_fmt(m.get('staleness_mean'))} "
            f"prefix_hit {_fmt(m.get('prefix_hit_rate'))} tokens/s {_fmt(m.get('tokens_per_second'), digits=0)}"
        )

    def render(self) -> RenderableType:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold cyan")
        table.add_column()
        m = self.metrics
        table.add_row("job", f"{self.job_id}  [{_state_style(self.state)}]{self.state}[/]")
        table.add_row("step", f"{self.step}/{self.num_steps or '?'}  (weights v{self.weight_version})")
        table.add_row("reward", _fmt(policy_reward(m)))
        table.add_row("staleness", _fmt(m.get("staleness_mean")) + " versions")
        table.add_row("prefix hit rate", _fmt(m.get("prefix_hit_rate")))
        table.add_row("tokens/s", _fmt(m.get("tokens_per_second"), digits=0) + " (trainer)")
        table.add_row("tito critical", _fmt(m.get("tito_critical_episodes"), digits=0))
        if self.pools:
            table.add_row("pools", ", ".join(f"{name} {size}" for name, size in sorted(self.pools.items())))
        if self.state == "QUEUED" and self.reason:  # waiting for Kueue's admission, or preempted by it
            table.add_row("queued", self.reason[:160])
        if self.last_error:
            table.add_row("last error", f"[red]{self.last_error[:160]}[/]")
        progress = Progress(
            TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), auto_refresh=False
        )
        task = progress.add_task("steps", total=max(self.num_steps, 1), completed=self.step)
        progress.tasks[task].start_time = self.started_at_s
        return Group(table, progress)


def reward_table(watch: JobWatch) -> Table:
    """Reward (and staleness) of every step the follower saw."""
    table = Table(title=f"job {watch.job_id}: reward per step")
    table.add_column("step", justify="right")
    table.add_column("reward", justify="right")
    table.add_column("staleness", justify="right")
    for step in sorted(watch.rewards_by_step):
        staleness = watch.staleness_by_step.get(step)
        table.add_row(str(step), f"{watch.rewards_by_step[step]:.3f}", _fmt(staleness))
    return table


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _state_style(state: str) -> str:
    return {"SUCCEEDED": "green", "FAILED": "red", "CANCELLED": "yellow", "QUEUED": "magenta"}.get(state, "blue")
