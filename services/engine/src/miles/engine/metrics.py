"""The engine's Prometheus metrics: SGLang's names (`sglang:*`, label `model_name`) so that dashboards and
alerts written for SGLang pods read a miles-engine unchanged, plus our own under `miles_engine_*`.

All live in the process registry of `miles.common.telemetry.Metrics` and are served by /metrics. Requests the
engine makes for itself (/health_generate, the n>1 prefix warm-up) are not counted.

LoRA: generated tokens are also counted per adapter *job* (`job`: the job part of an adapter named
`<job_id>@<version>`, miles.common.contracts.adapters; "base" for the base model; "other" for an adapter name of
another form). A job's series is removed once no adapter of it is loaded any more, so the label set stays bounded
by the jobs being served (a job id spelled "base" or "other" would share that series).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from prometheus_client import Counter, Gauge, Histogram

from miles.common.contracts.adapters import parse_adapter_name
from miles.common.telemetry import LATENCY_BUCKETS_S, Metrics
from miles.engine.requests import FinishReason, LoadSnapshot, Sequence

_TOKEN_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768)
BASE_JOB = "base"
"""The `job` label of requests served by the base model (no adapter)."""
OTHER_JOB = "other"
"""The `job` label of adapters whose name is not `<job_id>@<version>`."""


def adapter_job(lora_name: str) -> str:
    """The `job` label of an adapter's requests: the job of `<job_id>@<version>`, else OTHER_JOB."""
    parsed = parse_adapter_name(lora_name)
    return OTHER_JOB if parsed is None else parsed[0]


class EngineMetrics:
    def __init__(self, metrics: Metrics, model_name: str) -> None:
        registry = metrics.registry
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"sglang:{name}", doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"sglang:{name}", doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> Histogram:
            return Histogram(f"sglang:{name}", doc, labels, registry=registry, buckets=buckets).labels(model_name)

        self.num_running_reqs = gauge("num_running_reqs", "Requests in the running batch")
        self.num_queue_reqs = gauge("num_queue_reqs", "Requests in the waiting queue")
        self.num_used_tokens = gauge(
            "num_used_tokens",
            "KV tokens used by running requests and locked prefixes (evictable cache excluded)",
        )
        self.token_usage = gauge("token_usage", "num_used_tokens / max_total_num_tokens")
        self.max_total_num_tokens = gauge("max_total_num_tokens", "KV-cache capacity in tokens")
        self.cache_hit_rate = gauge("cache_hit_rate", "Cached / total prompt tokens of the last prefill batch")
        self.gen_throughput = gauge("gen_throughput", "Generated tokens per second of the last decode step")
        self.num_paused_reqs = gauge("num_paused_reqs", "Requests held while generation is paused")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests")
        self.cached_tokens = Counter(
            "sglang:cached_tokens",
            "Prompt tokens served from the prefix cache",
            ["model_name", "cache_source"],
            registry=registry,
        ).labels(model_name, "device")
        self.num_requests = counter("num_requests", "Finished requests")
        self.num_aborted_requests = counter("num_aborted_requests", "Aborted requests")
        self.ttft_s = histogram("time_to_first_token_seconds", "Time to first token, seconds")
        self.itl_s = histogram("inter_token_latency_seconds", "Time between two generated tokens, seconds")
        self.e2e_s = histogram("e2e_request_latency_seconds", "Request latency, seconds")
        self.queue_time_s = histogram("queue_time_seconds", "Time from arrival to first admission, seconds")
        self.prompt_tokens_histogram = histogram("prompt_tokens_histogram", "Prompt length", _TOKEN_BUCKETS)
        self.generation_tokens_histogram = histogram("generation_tokens_histogram", "Output length", _TOKEN_BUCKETS)
        self.weight_load_s = Histogram(
            "sglang:weight_load_duration_seconds",
            "Time to swap weights in, seconds",
            ["model_name", "source"],
            registry=registry,
            buckets=LATENCY_BUCKETS_S,
        )
        self._model_name = model_name
        self.forward_s = metrics.histogram(
            "forward_duration_seconds", "One model forward (kind: prefill, decode, or mixed: both), seconds", ["kind"]
        )
        self.computed_tokens = metrics.counter("computed_tokens", "Tokens run through the model", ["kind"])
        self.radix_cache_tokens = metrics.gauge("radix_cache_tokens", "Tokens held by the radix prefix cache")
        self.radix_evicted_tokens = metrics.counter("radix_cache_evicted_tokens", "Tokens evicted from the cache")
        self.weight_updates = metrics.counter(
            "weight_updates", "Weight updates, by source and outcome", ["source", "outcome"]
        )
        self._evicted_reported = 0
        self.retractions = metrics.counter("retracted_requests", "Requests moved back to the queue by pause(retract)")
        self.loaded_lora_adapters = metrics.gauge(
            "loaded_lora_adapters", "LoRA adapters resident: loaded, or unloading until their last request ends"
        )
        self.lora_loads = metrics.counter("lora_adapter_loads", "/load_lora_adapter calls, by outcome", ["outcome"])
        self.lora_unloads = metrics.counter(
            "lora_adapter_unloads", "/unload_lora_adapter calls, by outcome", ["outcome"]
        )
        self.job_adapter_slots = metrics.gauge(
            "lora_adapter_slots", "Registered LoRA adapters (slots of max_loaded_loras), by adapter job", ["job"]
        )
        self._slot_jobs: set[str] = set()
        self.job_generated_tokens = metrics.counter(
            "generated_tokens", "Generated tokens of finished requests, by adapter job (base: no adapter)", ["job"]
        )

    def publish(self, snapshot: LoadSnapshot, num_cached_tokens: int, num_evicted_tokens_total: int) -> None:
        """Set the gauges from the scheduler's state (called after every scheduler step)."""
        self.num_running_reqs.set(snapshot.num_running_reqs)
        self.num_queue_reqs.set(snapshot.num_waiting_reqs)
        held = snapshot.num_running_reqs + snapshot.num_waiting_reqs
        self.num_paused_reqs.set(held if snapshot.paused else 0)
        self.num_used_tokens.set(snapshot.num_used_tokens)
        self.token_usage.set(snapshot.token_usage)
        self.max_total_num_tokens.set(snapshot.max_total_num_tokens)
        self.cache_hit_rate.set(snapshot.cache_hit_rate)
        self.gen_throughput.set(0.0 if snapshot.paused else snapshot.gen_throughput)
        self.radix_cache_tokens.set(num_cached_tokens)
        new_evictions = num_evicted_tokens_total - self._evicted_reported
        if new_evictions > 0:
            self.radix_evicted_tokens.inc(new_evictions)
            self._evicted_reported = num_evicted_tokens_total

    def observe_forward(self, kind: str, num_tokens: int, duration_s: float) -> None:
        self.forward_s.labels(kind).observe(duration_s)
        self.computed_tokens.labels(kind).inc(num_tokens)

    def observe_token(self, seq: Sequence, now_s: float) -> None:
        if seq.internal:
            return
        if seq.last_token_time_s is None:
            self.ttft_s.observe(now_s - seq.arrival_time_s)
        else:
            self.itl_s.observe(now_s - seq.last_token_time_s)

    def observe_admission(self, seq: Sequence, now_s: float) -> None:
        if not seq.internal and seq.num_retractions == 0:
            self.queue_time_s.observe(now_s - seq.arrival_time_s)

    def observe_finish(self, seq: Sequence, reason: FinishReason, now_s: float, job: str = BASE_JOB) -> None:
        """A request ended; `job` labels its generated tokens (adapter_job, BASE_JOB without an adapter)."""
        if seq.internal:
            return
        if seq.output_ids:
            self.job_generated_tokens.labels(job).inc(len(seq.output_ids))
        self.num_requests.inc()
        if reason.kind == "abort":
            self.num_aborted_requests.inc()
        self.prompt_tokens.inc(len(seq.prompt_ids))
        self.generation_tokens.inc(len(seq.output_ids))
        self.cached_tokens.inc(seq.cached_tokens or 0)
        self.e2e_s.observe(now_s - seq.arrival_time_s)
        self.prompt_tokens_histogram.observe(len(seq.prompt_ids))
        self.generation_tokens_histogram.observe(len(seq.output_ids))

    def observe_weight_update(self, source: str, duration_s: float, ok: bool) -> None:
        if ok:
            self.weight_load_s.labels(self._model_name, source).observe(duration_s)
        self.weight_updates.labels(source, "ok" if ok else "failed").inc()

    def observe_lora_update(self, kind: str, ok: bool) -> None:
        """A load or unload (`kind`) was done (for an unload: the adapter left the registry) or refused."""
        counter = self.lora_loads if kind == "load" else self.lora_unloads
        counter.labels("ok" if ok else "refused").inc()

    def set_adapter_slots(self, slots_by_job: Mapping[str, int]) -> None:
        """Registered adapters per job (each takes one of the engine's max_loaded_loras slots); jobs without one
        lose their series."""
        for job in set(self._slot_jobs) - set(slots_by_job):
            self.job_adapter_slots.remove(job)
        for job, count in slots_by_job.items():
            self.job_adapter_slots.labels(job).set(count)
        self._slot_jobs = set(slots_by_job)

    def forget_job(self, job: str) -> None:
        """Drop a job's generated-tokens series (its last adapter was unloaded); the base model's stays."""
        if job != BASE_JOB:
            with contextlib.suppress(KeyError):  # no request of it finished: the series never existed
                self.job_generated_tokens.remove(job)
