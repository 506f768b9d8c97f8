"""The Prometheus metrics of weight-sync (`miles_weightsync_*`), created once per process.

Labels are bounded: kind (full/delta/snapshot), phase (a fixed list), transport, outcome, stage, reason, path, and
`engine` (the job's engine URLs: a per-job daemon sees only its job's engines).
"""

from __future__ import annotations

from miles.common.telemetry import Metrics

PHASES = (
    "receive",
    "encode",
    "store",
    "prepare",
    "quiesce",
    "load",
    "set_version",
    "resume",
    "engine_update",
    "rollout",
)
_SECONDS_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0)
_BYTES_BUCKETS = tuple(float(1 << shift) for shift in range(16, 42, 2))
_SIZE_BUCKETS = (1e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)


class WeightsyncMetrics:
    def __init__(self, metrics: Metrics) -> None:
        self.registry = metrics
        self.publish_bytes = metrics.counter(
            "publish_bytes",
            "Bytes of published versions: kind=full (raw tensor bytes), delta or snapshot (bytes stored)",
            ["kind"],
        )
        self.publishes = metrics.counter(
            "publishes",
            "Publishes (PublishWeights, or OpenPublishChannel + CommitPublish) by outcome: stored, already_stored, "
            "rejected",
            ["outcome"],
        )
        self.published_bytes = metrics.counter(
            "published_bytes",
            "Tensor bytes received from the trainer, by path: data_channel (complete tensors, counted as they "
            "arrive) or grpc (PublishWeights streams that reached their commit)",
            ["path"],
        )
        self.delta_ratio = metrics.gauge("delta_ratio", "Stored delta bytes / full bytes of the last delta version")
        self.delta_ratio_hist = metrics.histogram(
            "delta_ratio_distribution", "Stored delta bytes / full bytes per delta version", buckets=_SIZE_BUCKETS
        )
        self.changed_elements_ratio = metrics.gauge(
            "changed_elements_ratio", "Share of elements whose bit pattern changed in the last delta version"
        )
        self.phase_duration_s = metrics.histogram(
            "phase_duration_seconds", "Time per phase of publishing and updating engines, seconds", ["phase"]
        )
        self.latest_version = metrics.gauge("latest_version", "Newest stored version (-1: none)")
        self.stored_versions = metrics.gauge("stored_versions", "Versions kept in the store after retention")
        self.engine_updates = metrics.counter(
            "engine_updates",
            "Engine updates by transport and outcome (delta, full, fallback, failed)",
            ["transport", "outcome"],
        )
        self.fallbacks = metrics.counter(
            "fallbacks", "Delta loads that fell back to a full load, by reason (verification, missing)", ["reason"]
        )
        self.failures = metrics.counter(
            "failures", "Failures by stage (publish, quiesce, load, set_version, resume, replicate, peer)", ["stage"]
        )
        self.drain_waits_cut = metrics.counter(
            "drain_waits_cut",
            "Drain-mode updates that paused the engine with abort while requests were still in flight at the router, "
            "by reason: timeout (drain_timeout_s passed), left_paused (this daemon had left the engine paused, so "
            "those requests could not finish; not waited for)",
            ["reason"],
        )
        self.engine_version = metrics.gauge(
            "engine_weight_version", "Version an engine serves (-1: unknown)", ["engine"]
        )
        self.engine_version_skew = metrics.gauge(
            "engine_version_skew", "Newest minus oldest version served by the job's engines after the last rollout"
        )
        self.bytes_to_engines = metrics.counter(
            "bytes_to_engines", "Raw tensor bytes sent to engines, by transport", ["transport"]
        )
        self.replicated_bytes = metrics.counter("replicated_bytes", "Stored bytes copied from the origin")
        self.fetched_bytes = metrics.counter("fetched_bytes", "Full tensor bytes streamed from the origin")
        self.served_bytes = metrics.counter(
            "served_bytes", "Bytes sent to other daemons, by rpc (or data_channel)", ["rpc"]
        )
        self.fetches = metrics.counter(
            "full_fetches",
            "Full loads fetched from the origin, by path: data_channel, grpc (data channel off or unsupported by "
            "the origin), fallback (the data channel could not be set up)",
            ["path"],
        )
        self.data_connections = metrics.counter(
            "data_connections",
            "Data channel connections served (fetches and publishes), by outcome (accepted, rejected, broken)",
            ["outcome"],
        )
        self.engine_pause_s = metrics.histogram(
            "engine_pause_seconds",
            "Per engine update: seconds the engine served nothing (quiesce until resumed)",
            buckets=_SECONDS_BUCKETS,
        )
        self.update_transfer_s = metrics.histogram(
            "update_transfer_seconds",
            "Per engine update: seconds preparing the version next to the engine while it kept serving",
            buckets=_SECONDS_BUCKETS,
        )
        self.update_wire_bytes = metrics.histogram(
            "update_wire_bytes",
            "Per engine update: bytes received from the origin plus raw tensor bytes sent to the engine",
            buckets=_BYTES_BUCKETS,
        )
        self.step_to_serving_s = metrics.histogram(
            "step_to_serving_seconds",
            "Per engine update: seconds from the trainer's optimizer step to the engine serving the version",
            buckets=_SECONDS_BUCKETS,
        )
        self.latest_version.set(-1)

    def observe_phase(self, phase: str, seconds: float) -> None:
        self.phase_duration_s.labels(phase).observe(seconds)
