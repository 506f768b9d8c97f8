"""The rollout worker's Prometheus metrics (`miles_rollout_*`); labels are bounded enums, never ids.

`role` is the sample's role in a multi-agent episode ("" without roles, which Prometheus reads as no label): the
job declares at most 8 (`rollout.roles`), so it is bounded too."""

from __future__ import annotations

from miles.common.telemetry import Metrics

EPISODE_SECONDS_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
REWARD_BUCKETS = (-1.0, -0.5, 0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 2.0)


class RolloutMetrics:
    """Every metric of the worker, registered once on the process's `Metrics("rollout")`."""

    def __init__(self, metrics: Metrics) -> None:
        self.registry = metrics
        self.episodes = metrics.counter(
            "episodes",
            "Finished episodes by sample status and reason (ok, truncated, agent_error, ...)",
            ["status", "reason"],
        )
        self.episode_duration_s = metrics.histogram(
            "episode_duration_seconds",
            "Episode wall time, session creation to deletion",
            ["status"],
            buckets=EPISODE_SECONDS_BUCKETS,
        )
        self.live_episodes = metrics.gauge("live_episodes", "Episodes in flight now")
        self.max_live_episodes = metrics.gauge("max_live_episodes", "Limit on episodes in flight")
        self.groups = metrics.counter(
            "groups", "Finished groups by outcome (queued, duplicate, filtered_*, rejected_all_aborted)", ["outcome"]
        )
        self.samples = metrics.counter(
            "samples", "Samples pushed to the buffer, by status and role", ["status", "role"]
        )
        self.response_tokens = metrics.counter("response_tokens", "Response tokens of pushed trainable samples")
        self.sample_reward = metrics.histogram(
            "sample_reward", "Reward of every scored trainable sample, by role", ["role"], buckets=REWARD_BUCKETS
        )
        self.push_retries = metrics.counter(
            "push_retries",
            "Pushes retried, by cause (resource_exhausted, unavailable, job_not_configured)",
            ["cause"],
        )
        self.paused = metrics.gauge("paused", "1 while new episodes are paused by buffer backpressure")
        self.session_call_retries = metrics.counter(
            "session_call_retries", "Session-server calls retried, by operation", ["operation"]
        )
        self.session_delete_failures = metrics.counter(
            "session_delete_failures", "Sessions whose deletion failed after every retry (their TTL removes them)"
        )
        self.orphan_sessions_deleted = metrics.counter(
            "orphan_sessions_deleted",
            "Sessions no episode owned any more, deleted: left by a dead worker (cause=reclaim) or created by a "
            "create whose reply was lost (cause=sweep)",
            ["cause"],
        )
        self.prompts_claimed = metrics.counter(
            "prompts_claimed", "Prompts claimed from the cursor, by source (new, reclaimed, requeued)", ["source"]
        )
        self.prompts_completed = metrics.counter("prompts_completed", "Prompts whose group was decided (any outcome)")
        self.dataset_epoch = metrics.gauge("dataset_epoch", "Epoch of the newest prompt claimed")
        self.dataset_exhausted = metrics.gauge(
            "dataset_exhausted", "1 once every epoch is claimed and this worker has nothing in flight"
        )
        self.partial_rollouts = metrics.counter(
            "partial_rollout_episodes", "Episodes that spanned several weight versions, by action taken", ["action"]
        )
        self.tito_critical_episodes = metrics.counter(
            "tito_critical_episodes", "Episodes whose token buffer differed critically from a fresh render"
        )
        self.environment_restarts = metrics.counter(
            "environment_restarts",
            "Environment-server restarts by cause (exited: its process ended; unresponsive: /healthz failed "
            "health_failures_to_restart checks in a row)",
            ["cause"],
        )
        self.environment_up = metrics.gauge("environment_up", "1 while the job's environment server answers /healthz")
        self.sync_barrier_wait_s = metrics.counter(
            "sync_barrier_wait_seconds", "train.mode sync: seconds prompts waited at the barrier for the next version"
        )
        self.sync_barrier_refills = metrics.counter(
            "sync_barrier_refills", "train.mode sync: places opened beyond the batch because the trainer starved"
        )
        self.sync_batch_version = metrics.gauge(
            "sync_batch_version", "train.mode sync: weight version of the batch last admitted into"
        )
        self.eval = EvalMetrics(metrics)
        """Evaluation per weight version (`miles.rollout.eval_loop`); exported idle too, for the dashboards."""


class EvalMetrics:
    """`miles_rollout_eval_*`: labels are the job's dataset names (at most 8) and bounded enums."""

    def __init__(self, metrics: Metrics) -> None:
        self.reward = metrics.gauge("eval_reward", "Mean reward of the last evaluated version, by dataset", ["dataset"])
        self.version = metrics.gauge("eval_version", "Weight version of the last evaluation written")
        self.lag_s = metrics.gauge("eval_lag_seconds", "Seconds from first sighting of a version to its score")
        self.episodes = metrics.counter(
            "eval_episodes",
            "Evaluation episodes by outcome (scored, discarded: served at another version)",
            ["outcome"],
        )
        self.versions = metrics.counter("eval_versions", "Versions written by status (scored, missed)", ["status"])
