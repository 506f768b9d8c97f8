"""Prometheus metrics of the session-server (`miles_session_*`), on the process's `Metrics("session")` registry.

Labels are bounded (results, phases, error codes, kinds); never a session or request id. The one exception to
"no ids" is `job_id` on the per-job token counters: jobs sharing an engine pool (LoRA jobs) are accounted per job,
and a job lives for a whole training run (sessions without a job count under job_id ""). Prefix hit rate is
`rate(miles_session_cached_tokens_total) / rate(miles_session_prompt_tokens_total)`: both come from the engine's
own `cached_tokens` / `prompt_tokens`, so it holds for any engine behind the router.
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import Counter

from miles.common.telemetry import Metrics
from miles.session.tito import TitoMetrics, register_tito_metrics

TURN_RESULTS = ("recorded", "not_recorded", "failed")
TURN_PHASES = ("prepare", "upstream", "commit")
UPSTREAM_ERROR_KINDS = ("unreachable", "rejected", "conflict", "aborted", "malformed")
STREAM_INTERRUPTIONS = ("upstream_error", "failed", "client_disconnect")
SAMPLE_STATUSES = ("COMPLETED", "TRUNCATED", "ABORTED")


class SessionMetrics:
    def __init__(self, metrics: Metrics) -> None:
        self.registry = metrics
        self.turns = metrics.counter(
            "turns", "Chat turns answered, by result (failed: an error was returned)", ["result"]
        )
        self.turn_errors = metrics.counter("turn_errors", "Failed chat turns by error code", ["code"])
        self.rollbacks = metrics.counter("turn_rollbacks", "Turns that retried (rolled back) the last generated turn")
        self.tree_nodes = metrics.counter(
            "tree_nodes", "Nodes recorded in tree sessions (kind: root, a first turn or a compaction; child)", ["kind"]
        )
        self.tree_path_tokens = metrics.counter(
            "tree_path_tokens", "Tokens of tree sessions' leaf-path samples (a shared prefix counted once per path)"
        )
        self.tree_unique_tokens = metrics.counter(
            "tree_unique_tokens", "Tokens of tree sessions' samples counted once (what a packed tree sample trains)"
        )
        self.prompt_tokens = metrics.counter("prompt_tokens", "Prompt tokens sent to the engine (tokens in)")
        self.completion_tokens = metrics.counter("completion_tokens", "Tokens sampled by the engine (tokens out)")
        self.job_prompt_tokens = metrics.counter(
            "job_prompt_tokens",
            "Prompt tokens sent to the engine, per job (resource accounting on a shared pool)",
            ["job_id"],
        )
        self.job_completion_tokens = metrics.counter(
            "job_completion_tokens",
            "Tokens sampled by the engine, per job (resource accounting on a shared pool)",
            ["job_id"],
        )
        self.cached_tokens = metrics.counter("cached_tokens", "Prompt tokens the engine served from its prefix cache")
        self.appended_tokens = metrics.counter("appended_tokens", "Prompt tokens TITO encoded (new messages only)")
        self.turn_duration_s = metrics.histogram("turn_duration_seconds", "Chat turn latency, seconds")
        self.phase_duration_s = metrics.histogram(
            "turn_phase_duration_seconds", "Latency of each phase of a turn, seconds", ["phase"]
        )
        self.upstream_errors = metrics.counter("upstream_errors", "Failed upstream /generate calls by kind", ["kind"])
        self.live_sessions = metrics.gauge("live_sessions", "Sessions that exist and have not expired (all replicas)")
        self.sessions_created = metrics.counter("sessions_created", "Sessions created")
        self.sessions_deleted = metrics.counter("sessions_deleted", "Sessions deleted by a client or operator")
        self.sessions_expired = metrics.counter("sessions_expired", "Sessions that expired after ttl_s idle")
        self.idempotent_replays = metrics.counter(
            "idempotent_replays", "POST /v1/sessions answered with an existing session (same Idempotency-Key and body)"
        )
        self.max_tokens_clamped = metrics.counter(
            "max_tokens_clamped", "Turns whose max_tokens ask exceeded the completion limit and was clamped to it"
        )
        self.samples = metrics.counter("samples", "Training samples returned, by status", ["status"])
        self.routing_bytes = metrics.counter(
            "routing_stored_bytes", "Packed routing (R3) bytes committed with turn records (new rows only)"
        )
        self.routing_row_mismatches = metrics.counter(
            "routing_row_mismatches",
            "Turns whose engine answer had no routed experts or another number of rows than asked for (refused)",
        )
        self.adapter_retries = metrics.counter(
            "adapter_retries",
            "LoRA turns sent again with the job's new live adapter after the engine no longer had the one they named",
        )
        self.stream_first_token_s = metrics.histogram(
            "stream_first_token_seconds",
            "Streamed turns: seconds from the request to the first reasoning or content text sent to the agent",
        )
        self.stream_interruptions = metrics.counter(
            "stream_interruptions",
            "Streamed turns that ended with an error event or a client disconnect instead of a finish chunk "
            "(nothing recorded), by reason: upstream_error, failed (a check or the commit refused), client_disconnect",
            ["reason"],
        )
        self.stream_divergences = metrics.counter(
            "stream_divergences",
            "Streamed turns whose early text was not a prefix of the parsed message (the rest could not be sent)",
        )
        self.tito: TitoMetrics = register_tito_metrics(metrics)
        for result in TURN_RESULTS:
            self.turns.labels(result=result)
        for phase in TURN_PHASES:
            self.phase_duration_s.labels(phase=phase)
        for kind in UPSTREAM_ERROR_KINDS:
            self.upstream_errors.labels(kind=kind)
        for reason in STREAM_INTERRUPTIONS:
            self.stream_interruptions.labels(reason=reason)
        for status in SAMPLE_STATUSES:
            self.samples.labels(status=status)

    def _exported(self) -> dict[str, Counter]:
        """The counters an export process (exports.py) moves: what building a view or samples counts."""
        return {
            "samples": self.samples,
            "tree_path_tokens": self.tree_path_tokens,
            "tree_unique_tokens": self.tree_unique_tokens,
            "tito_mismatches": self.tito.mismatches,
            "tito_comparisons": self.tito.comparisons,
        }

    def exported_counter(self, name: str) -> Counter | None:
        return self._exported().get(name)

    def exported_values(self) -> dict[tuple[str, str], tuple[dict[str, str], float]]:
        """Every exported counter's value per label set, keyed by (name, labels as JSON)."""
        values: dict[tuple[str, str], tuple[dict[str, str], float]] = {}
        for name, counter in self._exported().items():
            for family in counter.collect():
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        key = (name, json.dumps(sample.labels, sort_keys=True))
                        values[key] = (dict(sample.labels), sample.value)
        return values


def counter_increments(
    before: dict[tuple[str, str], tuple[dict[str, str], float]],
    after: dict[tuple[str, str], tuple[dict[str, str], float]],
) -> list[dict[str, Any]]:
    """What was counted between two `exported_values` snapshots, as the export protocol's `counters`."""
    increments = []
    for key, (labels, value) in after.items():
        delta = value - before.get(key, (labels, 0.0))[1]
        if delta > 0:
            increments.append({"name": key[0], "labels": labels, "value": delta})
    return increments
