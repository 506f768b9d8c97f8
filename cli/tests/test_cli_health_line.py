"""The health line `miles status` prints for each active job: the numbers of the controller's health summary
(miles.controller.health) and its warnings."""

from __future__ import annotations

from miles.cli.main import health_line
from miles.controller.health import job_health

HEALTHY = {
    "entropy": 0.9,
    "grad_norm": 0.4,
    "train_rollout_logprob_abs_diff": 0.01,
    "zero_signal_fraction": 0.25,
    "pg_clipfrac": 0.03,
}


def test_health_line_shows_the_numbers_and_the_warnings() -> None:
    job = {"job_id": "j1", "health": {**job_health(HEALTHY, [0.2, 0.3, 0.4]).__dict__}}
    line = health_line(job)
    assert "reward 0.30 -> 0.30" in line and "zero_signal 25%" in line and "clip 3.0%" in line and "ok" in line
    sick = {"job_id": "j2", "health": {**job_health({**HEALTHY, "entropy": 0.0}, []).__dict__}}
    assert "entropy collapsed" in health_line(sick) and "reward - -> -" in health_line(sick)
