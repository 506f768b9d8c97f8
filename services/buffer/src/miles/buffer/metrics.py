"""Prometheus metrics of the buffer (`miles_buffer_*`), labelled by job_id only.

Counters count what *this process* did (sum them over replicas); gauges mirror Redis (every replica reports the
same value, take max over replicas) and are refreshed every `stats_refresh_interval_s`. Label sets of a deleted
job are removed, so the job_id label stays bounded by the number of live jobs.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from miles.buffer.records import JobStats, PullResult, PushResult
from miles.common.telemetry import Metrics

STALENESS_BUCKETS_STEPS: tuple[float, ...] = (0, 1, 2, 3, 4, 5, 6, 8, 10, 16, 32, 64)
_FILTER_REASONS = ("equal_rewards", "too_few_valid")


class BufferMetrics:
    """Every metric the buffer exports, with one method per event the core reports."""

    def __init__(self, metrics: Metrics) -> None:
        job = ["job_id"]
        self.pushed = metrics.counter("pushed_groups", "Groups queued by PushGroup", job)
        self.duplicates = metrics.counter("duplicate_pushes", "PushGroup calls for a group_id already decided", job)
        self.filtered = metrics.counter(
            "filtered_groups", "Groups removed at push by the job's filter", [*job, "reason"]
        )
        self.rejected = metrics.counter("rejected_aborted_groups", "Groups refused because no sample is trainable", job)
        self.push_full = metrics.counter("push_resource_exhausted", "PushGroup calls that found the job full", job)
        self.pulled = metrics.counter("pulled_groups", "Groups leased by PullBatch", job)
        self.redelivered = metrics.counter("redelivered_groups", "Groups leased again after a lease ended", job)
        self.acked = metrics.counter("acked_groups", "Groups removed for good by Ack", job)
        self.nacked = metrics.counter("nacked_groups", "Groups returned to the queue by Nack", job)
        self.discarded = metrics.counter("discarded_groups", "Groups deleted by Nack with discard", job)
        self.expired = metrics.counter("expired_leases", "Leases that expired and returned their group", job)
        self.dropped_stale = metrics.counter("dropped_stale_groups", "Groups over the staleness bound, dropped", job)
        self.requeued = metrics.counter("requeued_groups", "Groups over the staleness bound, sent back to rollout", job)
        self.stale_masked = metrics.counter(
            "stale_masked_groups", "Groups leased with spans over the staleness bound, masked by the trainer", job
        )
        self.staleness: Histogram = metrics.histogram(
            "pulled_group_staleness_steps", "Staleness of pulled groups (weight versions)", job, STALENESS_BUCKETS_STEPS
        )
        self.batch_avg_staleness = metrics.gauge("pulled_staleness_avg_steps", "Mean staleness of the last batch", job)
        self.batch_max_staleness = metrics.gauge("pulled_staleness_max_steps", "Max staleness of the last batch", job)
        self.queued_groups = metrics.gauge("queued_groups", "Groups waiting to be pulled", job)
        self.queued_samples = metrics.gauge("queued_samples", "Samples in queued groups", job)
        self.queued_tokens = metrics.gauge("queued_tokens", "Tokens in queued groups", job)
        self.leased_groups = metrics.gauge("leased_groups", "Groups leased and not yet acked", job)
        self.capacity_groups = metrics.gauge("capacity_groups", "Capacity of the job (queued + leased)", job)
        self.oldest_age_s = metrics.gauge("oldest_group_age_seconds", "Age of the oldest queued group", job)
        self.requeued_pending = metrics.gauge("requeued_pending_prompts", "Requeued prompts not yet taken", job)
        self._per_job: tuple[Counter | Gauge | Histogram, ...] = (
            self.pushed, self.duplicates, self.rejected, self.push_full, self.pulled, self.redelivered, self.acked,
            self.nacked, self.discarded, self.expired, self.dropped_stale, self.requeued, self.stale_masked,
            self.staleness, self.batch_avg_staleness, self.batch_max_staleness, self.queued_groups, self.queued_samples,
            self.queued_tokens, self.leased_groups, self.capacity_groups, self.oldest_age_s, self.requeued_pending,
        )  # fmt: skip
        self._jobs: set[str] = set()

    def on_push(self, job_id: str, result: PushResult) -> None:
        self._jobs.add(job_id)
        if result.outcome == "queued":
            self.pushed.labels(job_id).inc()
        elif result.outcome == "duplicate":
            self.duplicates.labels(job_id).inc()
        elif result.outcome == "rejected_all_aborted":
            self.rejected.labels(job_id).inc()
        elif result.filter_reason is not None:
            self.filtered.labels(job_id, result.filter_reason).inc()

    def on_push_full(self, job_id: str) -> None:
        self.push_full.labels(job_id).inc()

    def on_pull(self, job_id: str, result: PullResult) -> None:
        """Records one pull attempt (leased groups, stale removals and expired leases it returned)."""
        self._jobs.add(job_id)
        self.dropped_stale.labels(job_id).inc(result.num_dropped_stale)
        self.requeued.labels(job_id).inc(result.num_requeued)
        self.stale_masked.labels(job_id).inc(result.num_stale_masked)
        self.expired.labels(job_id).inc(result.num_expired_leases)
        if not result.groups:
            return
        self.pulled.labels(job_id).inc(len(result.groups))
        self.redelivered.labels(job_id).inc(sum(1 for group in result.groups if group.redelivery_count > 0))
        stalenesses = [group.staleness for group in result.groups]
        for staleness in stalenesses:
            self.staleness.labels(job_id).observe(staleness)
        self.batch_avg_staleness.labels(job_id).set(sum(stalenesses) / len(stalenesses))
        self.batch_max_staleness.labels(job_id).set(max(stalenesses))

    def on_ack(self, job_id: str, num_acked: int) -> None:
        self.acked.labels(job_id).inc(num_acked)

    def on_nack(self, job_id: str, num_returned: int, *, discard: bool) -> None:
        (self.discarded if discard else self.nacked).labels(job_id).inc(num_returned)

    def on_expired(self, job_id: str, num_expired: int) -> None:
        self.expired.labels(job_id).inc(num_expired)

    def set_job_gauges(self, job_id: str, stats: JobStats) -> None:
        self._jobs.add(job_id)
        self.queued_groups.labels(job_id).set(stats.queued_groups)
        self.queued_samples.labels(job_id).set(stats.queued_samples)
        self.queued_tokens.labels(job_id).set(stats.queued_tokens)
        self.leased_groups.labels(job_id).set(stats.leased_groups)
        self.capacity_groups.labels(job_id).set(stats.config.capacity_groups)
        self.oldest_age_s.labels(job_id).set(stats.oldest_group_age_s)
        self.requeued_pending.labels(job_id).set(stats.requeued_pending)

    def forget_jobs_except(self, live_job_ids: set[str]) -> None:
        """Removes every label set of jobs that no longer exist."""
        for job_id in self._jobs - live_job_ids:
            for metric in self._per_job:
                try:
                    metric.remove(job_id)
                except KeyError:
                    continue
            for reason in _FILTER_REASONS:
                try:
                    self.filtered.remove(job_id, reason)
                except KeyError:
                    continue
        self._jobs &= live_job_ids
