"""`miles follow` / `miles status` with a job that Kueue queues (state QUEUED): shown with why, counted active."""

from __future__ import annotations

from rich.console import Console

from miles.cli.follow import JobWatch, SseEvent
from miles.cli.main import ACTIVE_STATES


def _render(watch: JobWatch) -> str:
    console = Console(width=200, record=True)
    console.print(watch.render())
    return console.export_text()


def test_follow_shows_a_preempted_job_as_queued_with_the_reason_and_then_running_again() -> None:
    watch = JobWatch("j1")
    reason = "evicted by Kueue (Preempted): to accommodate a workload; waiting for readmission"
    watch.apply(SseEvent("1", "state", {"state": "QUEUED", "previous": "RUNNING", "reason": reason}))
    assert watch.state == "QUEUED" and not watch.ended
    assert "evicted by Kueue (Preempted)" in _render(watch)
    watch.apply(SseEvent("2", "progress", {"phase": "running", "step": 2, "num_steps": 3}))
    assert watch.state == "RUNNING"
    assert "evicted by Kueue" not in _render(watch)


def test_status_counts_queued_jobs_as_active() -> None:
    assert "QUEUED" in ACTIVE_STATES
