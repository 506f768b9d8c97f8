"""The scheduler: one thread that owns every sequence, the KV budget and the prefix cache, and steps the model.

Each loop turn runs the commands sent by the HTTP side (submit, abort, pause, weight updates, flush), then one
step: a pending weight update if its barrier is reached, else a prefill of newly admitted sequences, else one
decode step of every running sequence (continuous batching: new sequences join between decode steps). With
`mixed_chunk` (SGLang's --enable-mixed-chunk, the default here) a prefill step also decodes every running
sequence in the same forward, so that a new request does not cost the running ones a forward of waiting. Unlike
SGLang's, a prefill is never split into chunks: `max_prefill_tokens` bounds how many sequences join one step.

Memory model (seq_pool.py, SGLang's): a token budget `max_total_tokens` shared by the radix cache and running
sequences; `SeqPool` holds the waiting queue and the running set, admits sequences that fit and gives their KV
back to the cache when they end.

Pause modes: `abort` answers every in-flight sequence with an abort; `retract` moves running sequences back to
the queue and frees their KV (re-prefilled on continue, cached_tokens not recounted); `in_place` just stops
stepping. While paused, new sequences queue and wait. A weight update (weight_updates.py) waits for the
sequences that arrived before it to finish (new ones queue behind it) unless generation is paused, then it
applies at once.

Routed experts (MoE, `return_routed_experts`): a sequence that ends while holding KV (finished or aborted while
running) reports positions [routed_experts_start_len, seqlen - 1), read from the runner before its KV is
released (SeqPool.routed_experts); one aborted in the queue reports none, as SGLang's waiting-queue aborts carry
none.

LoRA adapters (adapters.py): a sequence runs with its own adapter (`lora_id`, part of its cache namespace); one
step batches at most `max_loras_per_batch` distinct adapters (the runner groups a step's sequences by adapter).
An unload waits for the adapter's last queued or running sequence (they run to their end, never aborted), then
drops its weights and cache entries.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from miles.common.contracts.engine_control import ENGINE_PAUSE_MODES
from miles.engine.adapters import AdapterSlots
from miles.engine.metrics import EngineMetrics
from miles.engine.radix_cache import RadixCache
from miles.engine.requests import FinishReason, LoadSnapshot, Sequence, SeqUpdate, TokenLogprobs
from miles.engine.runner import ForwardItem, ForwardResult, Runner
from miles.engine.seq_pool import SeqPool
from miles.engine.stopping import finish_reason_after
from miles.engine.tokenizer import TextTokenizer
from miles.engine.weight_updates import PendingUpdate, WeightUpdates

log = logging.getLogger(__name__)
T = TypeVar("T")


class Scheduler:
    def __init__(
        self,
        runner: Runner,
        cache: RadixCache,
        tokenizer: TextTokenizer,
        *,
        eos_token_ids: frozenset[int],
        max_total_tokens: int,
        max_running_requests: int,
        max_prefill_tokens: int,
        weight_version: str,
        metrics: EngineMetrics | None = None,
        max_loras_per_batch: int = 8,
        mixed_chunk: bool = True,
    ) -> None:
        self._runner = runner
        self._mixed_chunk = mixed_chunk
        self._cache = cache
        self._tokenizer = tokenizer
        self._eos_ids = eos_token_ids
        self._weights = WeightUpdates(runner, metrics, weight_version)
        self._metrics = metrics
        self._adapters = AdapterSlots(max_loras_per_batch)
        self._pool = SeqPool(
            runner,
            cache,
            self._adapters,
            max_total_tokens=max_total_tokens,
            max_running_requests=max_running_requests,
            max_prefill_tokens=max_prefill_tokens,
            metrics=metrics,
        )
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._wake = threading.Event()
        self._order = itertools.count()
        self._paused: str | None = None
        self._last_hit_rate = 0.0
        self._last_throughput = 0.0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="miles-engine-scheduler", daemon=True)

    # ---- called from other threads -------------------------------------------------------------------------
    @property
    def max_total_tokens(self) -> int:
        return self._pool.max_total_tokens

    @property
    def weight_version(self) -> str:
        return self._weights.version

    @property
    def paused(self) -> str | None:
        return self._paused

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    def submit(self, seq: Sequence) -> None:
        self._call(lambda: self._enqueue(seq))

    def abort(self, rid: str, abort_all: bool, *, exact: bool = False) -> Future[int]:
        """Abort every sequence whose rid starts with `rid` (equals it with exact=True), or all of them."""

        def matches(seq: Sequence) -> bool:
            if abort_all:
                return True
            return bool(rid) and (seq.rid == rid if exact else seq.rid.startswith(rid))

        return self._call(lambda: self._abort_matching(matches))

    def pause(self, mode: str) -> Future[int]:
        if mode not in ENGINE_PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}")
        return self._call(lambda: self._pause(mode))

    def resume(self) -> Future[None]:
        return self._call(lambda: setattr(self, "_paused", None))

    def update_weights(
        self, prepared: Any, *, flush_cache: bool, weight_version: str | None, abort_all: bool, source: str
    ) -> Future[str]:
        result: Future[str] = Future()

        def command() -> None:
            if abort_all:
                self._abort_matching(lambda s: True)
            barrier = next(self._order)
            self._weights.pending.append(PendingUpdate(prepared, flush_cache, weight_version, barrier, source, result))

        self._call(command)
        return result

    def set_weight_version(self, version: str, abort_all: bool) -> Future[None]:
        def command() -> None:
            if abort_all:
                self._abort_matching(lambda s: True)
            self._weights.version = version

        return self._call(command)

    def add_adapter(self, lora_id: str, prepared: Any, job: str) -> Future[None]:
        """Install a prepared LoRA adapter between steps (merged with the weights served then); `job` labels the
        tokens its requests generate (metrics.adapter_job)."""
        return self._call(lambda: self._adapters.install(self._runner, lora_id, prepared, job))

    def remove_adapter(self, lora_id: str) -> Future[None]:
        """Refuse new sequences of `lora_id` now; resolves once its last sequence ended and it is dropped."""
        result: Future[None] = Future()

        def command() -> None:
            self._adapters.live.discard(lora_id)
            self._adapters.removals.append((lora_id, result))

        self._call(command)
        return result

    def weights_snapshot(self) -> Future[tuple[str, Any]]:
        """The served weight version and the runner's copy of the weights, taken together between steps (no
        update or relabel can fall between the two reads)."""
        return self._call(lambda: (self._weights.version, self._runner.snapshot_weights()))

    def flush_cache(self) -> Future[bool]:
        """Empty the prefix cache if no sequence holds KV, i.e. none is running. SGLang also refuses while
        sequences wait in the queue, which blocks flushing after pause(retract); RL frameworks patch that out
        (e.g. slime), and queued sequences hold no KV here, so we allow it."""
        return self._call(self._flush_if_idle)

    def snapshot(self) -> LoadSnapshot:
        cache, pool = self._cache, self._pool
        return LoadSnapshot(
            num_running_reqs=len(pool.running),
            num_waiting_reqs=len(pool.waiting),
            num_waiting_tokens=sum(len(s.prompt_ids) + len(s.output_ids) for s in list(pool.waiting)),
            # As SGLang counts it: KV held by running requests and locked prefixes; the evictable part of the
            # prefix cache is free to reuse, so load balancers must not read it as usage.
            num_used_tokens=pool.used_tokens() - cache.num_evictable_tokens,
            max_total_num_tokens=pool.max_total_tokens,
            num_cached_tokens=cache.num_tokens,
            cache_hit_rate=self._last_hit_rate,
            gen_throughput=self._last_throughput,
            paused=self._paused,
        )

    def _call(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except Exception as exc:  # reported to the caller, the scheduler keeps serving
                future.set_exception(exc)

        self._commands.append(run)
        self._wake.set()
        return future

    # ---- scheduler thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            while self._commands:
                self._commands.popleft()()
            progressed = self._step()
            self._publish_gauges()
            if not progressed and not self._commands:
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _step(self) -> bool:
        if self._adapters.removals:
            self._drop_unused_adapters()
        update = self._weights.take_due(self._pool, paused=self._paused is not None)
        if update is not None:
            self._weights.apply(update, self._pool.flush)
            return True
        if self._paused is not None:
            return False
        admitted = self._pool.admit(self._weights.barrier)
        if admitted:
            self._prefill(admitted, with_decode=self._mixed_chunk)
            return True
        if self._pool.running:
            self._decode()
            return True
        return False

    def _enqueue(self, seq: Sequence) -> None:
        # A planned request holds its adapters until here (adapters.AdapterHold): this refuses only a sequence
        # submitted without a plan.
        if seq.lora_id is not None and seq.lora_id not in self._adapters.live:
            self._finish(seq, FinishReason("abort", message="its LoRA adapter was unloaded", status_code=400))
            return
        seq.arrival_order = next(self._order)
        seq.state = "waiting"
        self._pool.waiting.append(seq)

    def _prefill(self, admitted: list[tuple[Sequence, int]], *, with_decode: bool = False) -> None:
        """Prefill the admitted sequences; `with_decode`: in the same forward, one decode step of every sequence
        already running (SGLang's mixed chunk), so a new turn does not stall them for a forward of its own."""
        decoding = self._decode_items() if with_decode else []
        items = []
        for seq, matched in admitted:
            start = seq.logprobs.logprob_start_len
            wants_inputs = not seq.prefilled and seq.logprobs.return_logprob and 0 <= start < len(seq.prompt_ids)
            sample = seq.remaining_new_tokens > 0
            items.append(ForwardItem(seq, seq.all_ids[matched:], matched, sample, start if wants_inputs else None))
            self._pool.running.append(seq)
        total = sum(len(s.all_ids) for s, _ in admitted)
        self._last_hit_rate = sum(m for _, m in admitted) / total if total else 0.0
        started = time.monotonic()
        results = self._forward("mixed" if decoding else "prefill", decoding + items)
        if results is None:
            return
        if decoding:  # under steady arrivals most steps are mixed: the gauge must not freeze at the last decode
            self._last_throughput = len(decoding) / max(time.monotonic() - started, 1e-9)
        self._advance_decoded(decoding, results[: len(decoding)])
        for item, result in zip(items, results[len(decoding) :], strict=True):
            seq = item.seq
            input_logprobs = None
            cached = None
            if not seq.prefilled:
                seq.prefilled = True
                cached = seq.cached_tokens
                if seq.logprobs.return_logprob:
                    input_logprobs = _input_logprobs(seq, item, result)
            if result.next_token is None:
                self._finish(seq, FinishReason.max_length(seq.max_new_tokens), cached, input_logprobs)
            else:
                self._advance(seq, result.next_token, cached, input_logprobs)

    def _decode_items(self) -> list[ForwardItem]:
        return [
            ForwardItem(seq, [seq.output_ids[-1]], len(seq.prompt_ids) + len(seq.output_ids) - 1, True)
            for seq in self._pool.running
        ]

    def _decode(self) -> None:
        items = self._decode_items()
        started = time.monotonic()
        results = self._forward("decode", items)
        if results is None:
            return
        self._last_throughput = len(items) / max(time.monotonic() - started, 1e-9)
        self._advance_decoded(items, results)

    def _advance_decoded(self, items: list[ForwardItem], results: list[ForwardResult]) -> None:
        for item, result in zip(items, results, strict=True):
            assert result.next_token is not None
            self._advance(item.seq, result.next_token, None, None)

    def _forward(self, kind: str, items: list[ForwardItem]) -> list[ForwardResult] | None:
        started = time.monotonic()
        try:
            results = self._runner.forward(items)
        except Exception as exc:
            log.exception("model forward failed; failing the sequences of this step", extra={"kind": kind})
            for item in items:
                item.seq.routed_experts_start_len = None  # its KV may be half written
                reason = FinishReason("abort", message=f"internal error: {exc}", status_code=500)
                self._finish(item.seq, reason, insert=False)
            return None
        if self._metrics is not None:
            self._metrics.observe_forward(kind, sum(len(i.token_ids) for i in items), time.monotonic() - started)
        return results

    def _advance(
        self,
        seq: Sequence,
        entry: TokenLogprobs,
        cached: int | None,
        input_logprobs: tuple[TokenLogprobs | None, ...] | None,
    ) -> None:
        seq.output_ids.append(entry.token_id)
        now = time.monotonic()
        if self._metrics is not None:
            self._metrics.observe_token(seq, now)
        seq.last_token_time_s = now
        reason = finish_reason_after(seq, entry.token_id, self._tokenizer, self._eos_ids)
        if reason is not None:
            self._finish(seq, reason, cached, input_logprobs, new_entry=entry)
            return
        seq.emit(SeqUpdate((entry.token_id,), (entry,), cached, input_logprobs, None, self._weights.version))

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        cached: int | None = None,
        input_logprobs: tuple[TokenLogprobs | None, ...] | None = None,
        *,
        new_entry: TokenLogprobs | None = None,
        insert: bool = True,
    ) -> None:
        routed_experts = None
        if seq.state == "running":
            routed_experts = self._pool.routed_experts(seq)
            self._pool.release(seq, insert=insert)
        elif seq.state == "waiting":
            self._pool.waiting.remove(seq)
        seq.state = "finished"
        new_ids = () if new_entry is None else (new_entry.token_id,)
        new_entries = () if new_entry is None else (new_entry,)
        update = SeqUpdate(new_ids, new_entries, cached, input_logprobs, reason, self._weights.version, routed_experts)
        seq.emit(update)
        if self._metrics is not None:
            self._metrics.observe_finish(seq, reason, time.monotonic(), self._adapters.job_of(seq.lora_id))

    def _abort_matching(self, predicate: Callable[[Sequence], bool]) -> int:
        targets = [s for s in (*self._pool.waiting, *self._pool.running) if predicate(s)]
        for seq in targets:
            self._finish(seq, FinishReason.abort(waiting=seq.state == "waiting"))
        return len(targets)

    def _pause(self, mode: str) -> int:
        count = len(self._pool.running) + len(self._pool.waiting)
        if mode == "abort":
            self._abort_matching(lambda s: True)
        elif mode == "retract":
            self._pool.retract()
        self._paused = mode
        return count

    def _drop_unused_adapters(self) -> None:
        in_use = {s.lora_id for s in (*self._pool.waiting, *self._pool.running)}
        self._adapters.drop_unused(in_use, self._runner, self._cache, self._metrics)

    def _flush_if_idle(self) -> bool:
        if self._pool.running:
            return False
        self._pool.flush()
        return True

    def _publish_gauges(self) -> None:
        if self._metrics is not None:
            self._metrics.publish(self.snapshot(), self._cache.num_tokens, self._cache.num_evicted_tokens)


def _input_logprobs(seq: Sequence, item: ForwardItem, result: ForwardResult) -> tuple[TokenLogprobs | None, ...]:
    """SGLang's input_token_logprobs: prompt[start:] where the first entry has no logprob."""
    start = item.input_logprob_from
    if start is None:
        return ()
    first = TokenLogprobs(seq.prompt_ids[start], None)
    return (first, *result.input_logprobs)
