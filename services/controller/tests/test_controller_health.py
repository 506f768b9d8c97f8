"""The health summary `miles status` prints and GET /v1/jobs/{id} returns: the reward trend over the observed
steps and the statistics that announce a collapse, each warning on its own threshold."""

from __future__ import annotations

from miles.controller.cli import health_line
from miles.controller.health import job_health

HEALTHY = {
    "entropy": 0.9,
    "grad_norm": 0.4,
    "train_rollout_logprob_abs_diff": 0.01,
    "zero_signal_fraction": 0.25,
    "pg_clipfrac": 0.03,
}


def test_a_learning_job_is_healthy_and_its_trend_is_the_first_and_last_windows() -> None:
    health = job_health(HEALTHY, [0.2, 0.3, 0.4, 0.6, 0.7, 0.8])
    assert health.warnings == []
    assert round(health.reward_first or 0, 6) == 0.3 and round(health.reward_last or 0, 6) == 0.7
    assert (health.entropy, health.clip_fraction, health.zero_signal_fraction) == (0.9, 0.03, 0.25)


def test_each_collapse_indicator_warns_on_its_own() -> None:
    falling = job_health(HEALTHY, [0.2, 0.9, 0.95, 0.9, 0.5, 0.5, 0.5])
    assert len(falling.warnings) == 1 and falling.warnings[0].startswith("reward falling")
    assert job_health(HEALTHY, [0.9, 0.9, 0.9, 0.8, 0.8, 0.8]).warnings == []  # within the tolerance
    for key, bad, start in (
        ("entropy", 0.01, "entropy collapsed"),
        ("train_rollout_logprob_abs_diff", 0.6, "train/rollout logprob gap"),
        ("zero_signal_fraction", 0.9, "no signal"),
    ):
        warnings = job_health({**HEALTHY, key: bad}, [0.5] * 5).warnings
        assert len(warnings) == 1 and warnings[0].startswith(start), warnings
    assert job_health({}, []).warnings == []  # nothing observed yet: nothing to say


def test_health_line_shows_the_numbers_and_the_warnings() -> None:
    job = {"job_id": "j1", "health": {**job_health(HEALTHY, [0.2, 0.3, 0.4]).__dict__}}
    line = health_line(job)
    assert "reward 0.30 -> 0.30" in line and "zero_signal 25%" in line and "clip 3.0%" in line and "ok" in line
    sick = {"job_id": "j2", "health": {**job_health({**HEALTHY, "entropy": 0.0}, []).__dict__}}
    assert "entropy collapsed" in health_line(sick) and "reward - -> -" in health_line(sick)
