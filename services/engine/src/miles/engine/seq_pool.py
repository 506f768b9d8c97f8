"""The scheduler's sequences and the KV they hold: the waiting queue, the running set and the token budget.

Memory model (SGLang's): a token budget `max_total_tokens` shared by the radix cache and running sequences. A
sequence is admitted when its uncached prompt tokens plus its remaining max_new_tokens fit, after evicting
least-recently-used cache leaves if needed; its matched prefix is locked in the cache until it finishes. Once
finished, its prompt + output except the last token is inserted into the cache (the last token never went
through the model). Sequences admitted before a cache flush do not insert (their KV may predate new weights):
each flush starts a new cache epoch.

`SeqPool` is driven by the scheduler thread (scheduler.py), which decides when to admit, release, retract and
flush; the scheduler's `snapshot` reads its counts from other threads.
"""

from __future__ import annotations

import collections
import time

from miles.engine.adapters import AdapterSlots
from miles.engine.metrics import EngineMetrics
from miles.engine.radix_cache import RadixCache, cached_tokens_limit
from miles.engine.requests import Sequence
from miles.engine.runner import Runner


class SeqPool:
    """Waiting and running sequences, the tokens reserved for them, and the prefix cache's epoch."""

    def __init__(
        self,
        runner: Runner,
        cache: RadixCache,
        adapters: AdapterSlots,
        *,
        max_total_tokens: int,
        max_running_requests: int,
        max_prefill_tokens: int,
        metrics: EngineMetrics | None,
    ) -> None:
        self._runner = runner
        self._cache = cache
        self._adapters = adapters
        self.max_total_tokens = max_total_tokens
        self._max_running = max_running_requests
        self._max_prefill_tokens = max_prefill_tokens
        self._metrics = metrics
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._reserved_tokens = 0
        self._epoch = 0

    def used_tokens(self) -> int:
        cache = self._cache
        return cache.num_tokens + cache.num_detached_tokens + self._reserved_tokens

    def available_tokens(self) -> int:
        return self.max_total_tokens - self.used_tokens()

    def admit(self, barrier: int | None) -> list[tuple[Sequence, int]]:
        """Take sequences off the head of the queue while they fit (running-request limit, adapters per batch,
        prefill budget, token budget), giving each its KV and locking its matched prefix: (sequence, matched
        prefix length) pairs. A sequence that arrived after `barrier` (the first pending weight update's) stops
        admission. The caller adds the admitted sequences to `running` as it prefills them."""
        admitted: list[tuple[Sequence, int]] = []
        prefill_budget = self._max_prefill_tokens
        while self.waiting and len(self.running) + len(admitted) < self._max_running:
            seq = self.waiting[0]
            if barrier is not None and seq.arrival_order > barrier:
                break
            batch_adapters = [s.lora_id for s in self.running] + [s.lora_id for s, _ in admitted]
            if not self._adapters.fits(batch_adapters, seq.lora_id):
                break
            tokens = seq.all_ids
            first = seq.cached_tokens is None
            options = seq.logprobs
            limit = cached_tokens_limit(len(tokens), first and options.return_logprob, options.logprob_start_len)
            match = self._cache.match(tokens, limit, seq.namespace)
            num_new = len(tokens) - match.length
            if admitted and num_new > prefill_budget:
                break
            self._cache.lock(match.node)
            need = num_new + seq.remaining_new_tokens
            if need > self.available_tokens():
                self._cache.evict(need - self.available_tokens())
                if need > self.available_tokens():
                    self._cache.unlock(match.node)
                    break
            seq.kv = self._runner.new_kv(len(tokens) + seq.remaining_new_tokens, match.kv_blocks)
            seq.prefix_node, seq.reserved_tokens, seq.cache_epoch = match.node, need, self._epoch
            self._reserved_tokens += need
            if first:
                seq.cached_tokens = match.length
            if self._metrics is not None:
                self._metrics.observe_admission(seq, time.monotonic())
            seq.state = "running"
            self.waiting.popleft()
            admitted.append((seq, match.length))
            prefill_budget -= num_new
        return admitted

    def routed_experts(self, seq: Sequence) -> bytes | None:
        """A running sequence's routed experts, read before its KV is released (None unless it asked for them).
        SGLang's rows [start_len, seqlen - 1): every fed position (the last sampled token never is); no rows when
        start_len >= seqlen - 1 (e.g. max_new_tokens 0 with start_len = prompt length)."""
        start = seq.routed_experts_start_len
        if start is None:
            return None
        return self._runner.routed_experts(seq, start, max(start, len(seq.prompt_ids) + len(seq.output_ids) - 1))

    def release(self, seq: Sequence, *, insert: bool) -> None:
        """Give back a running sequence's KV: insert it into the cache (same epoch only), unlock, unreserve."""
        if insert and seq.cache_epoch == self._epoch and seq.prefilled:
            num_committed = len(seq.prompt_ids) + max(len(seq.output_ids) - 1, 0)
            kv = seq.kv
            self._cache.insert(
                seq.all_ids[:num_committed], lambda s, e: self._runner.export_kv(kv, s, e), seq.namespace
            )
        self._cache.unlock(seq.prefix_node)
        self._reserved_tokens -= seq.reserved_tokens
        seq.prefix_node, seq.reserved_tokens, seq.kv = None, 0, None
        self.running.remove(seq)

    def retract(self) -> None:
        """Move every running sequence back to the head of the queue (in order), freeing its KV uninserted; it is
        re-prefilled when admitted again."""
        retracted = list(self.running)
        for seq in retracted:
            self.release(seq, insert=False)
            seq.state = "waiting"
            seq.num_retractions += 1
            if self._metrics is not None:
                self._metrics.retractions.inc()
        self.waiting.extendleft(reversed(retracted))

    def flush(self) -> None:
        """Empty the prefix cache and start a new epoch (sequences admitted before it will not insert)."""
        self._cache.flush()
        self._epoch += 1
