"""The health summary GET /v1/jobs/{id} returns (and `miles status` prints): the reward trend over the observed
steps and the statistics that announce a collapse, each warning on its own threshold."""

from __future__ import annotations

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
