"""The engine core as the HTTP layer sees it: async operations over the scheduler thread (no web framework).

`Engine` validates and plans /generate bodies, submits sequences, turns the scheduler's updates into SGLang
response objects (whole or streamed), and runs the control operations (abort, pause/continue, weight updates
from disk, tensors or a weight-update group, weight checksums, flush, health generation). The scheduler's
updates arrive through `loop.call_soon_threadsafe` into one queue per request. Leaving a request early (client
gone, task cancelled) aborts its unfinished sequences.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from miles.common.contracts.weight_version import INITIAL_WEIGHT_VERSION, parse_weight_version
from miles.common.errors import MilesError
from miles.engine.adapters import AdapterLimits, Adapters
from miles.engine.distributed import UpdateGroups
from miles.engine.errors import BadRequestError, WeightsCheckError, WeightUpdateError, WeightVersionBehindError
from miles.engine.output import ResponseBuilder
from miles.engine.planning import GeneratePlan, Limits, PlannedSequence, plan_generate
from miles.engine.protocol import GenerateRequest, UpdateWeightsFromDistributedBody
from miles.engine.radix_cache import CacheNamespace
from miles.engine.requests import LogprobOptions, SamplingParams, Sequence, SeqUpdate
from miles.engine.runner import Checksum, Runner
from miles.engine.scheduler import Scheduler
from miles.engine.tokenizer import TextTokenizer
from miles.engine.weights import FLOAT_DTYPE_BYTES, check_tensor_specs, decode_payloads

_Updates = asyncio.Queue[tuple[int, SeqUpdate]]


class EngineInternalError(MilesError):
    """A sequence failed inside the engine (a model forward raised); the engine keeps serving."""


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        tokenizer: TextTokenizer,
        limits: Limits,
        update_groups: UpdateGroups,
        adapters: Adapters | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.limits = limits
        self.update_groups = update_groups
        self.adapters = adapters or Adapters(runner, scheduler, AdapterLimits(), enabled=False, max_loaded_loras=0)
        self._staged_id = ""
        self._staged: list[Any] = []
        self._inflight_rids: set[str] = set()

    # ---- generation -----------------------------------------------------------------------------------------
    def plan(self, request: GenerateRequest, min_weight_version: int | None = None) -> GeneratePlan:
        """Validate a /generate body; raises BadRequestError (rids in flight included) before any reply starts,
        and WeightVersionBehindError when the request demands a newer version than the one served."""
        self._check_min_weight_version(
            min_weight_version if min_weight_version is not None else request.min_weight_version
        )
        resolve_lora = self.adapters.resolve if self.adapters.enabled else None
        plan = plan_generate(request, self.tokenizer, self.limits, resolve_lora)
        self._check_rids(plan)
        # Resolved and held in one go (no await between): an unload from now on waits for this request.
        hold = self.adapters.hold(s.lora_id for s in plan.sequences)
        return plan if hold is None else dataclasses.replace(plan, adapter_hold=hold)

    def _check_min_weight_version(self, required: int | None) -> None:
        if required is None:
            return
        served = self.scheduler.weight_version
        served_number = parse_weight_version(served)  # SGLang's "default" is 0, the initial weights
        if served_number is None:  # a label that is no version ("v2"): count it as the oldest weights there are
            served_number = INITIAL_WEIGHT_VERSION
        if served_number < required:
            raise WeightVersionBehindError(
                f"engine serves weight version {served}, request needs >= {required}; retry once it is updated",
                field="min_weight_version",
                retry_after_s=1.0,
            )

    def _check_rids(self, plan: GeneratePlan) -> None:
        rids = [s.rid for s in plan.sequences]
        if len(set(rids)) != len(rids) or self._inflight_rids.intersection(rids):
            raise BadRequestError("Duplicate request ID detected")

    async def generate(self, plan: GeneratePlan) -> dict[str, Any] | list[dict[str, Any]]:
        """Run a planned request to the end: one response object, or a list for batches and n > 1."""
        builders, queue = await self._start(plan)
        try:
            while not all(b.finished for b in builders):
                index, update = await queue.get()
                builders[index].apply(update)
        finally:
            self._leave(builders)
        for builder in builders:
            if builder.finish is not None and builder.finish.status_code == 500:
                raise EngineInternalError(builder.finish.message or "internal error")
        responses = [_rendered(b) for b in builders]
        return responses if plan.is_batch else responses[0]

    async def stream(self, plan: GeneratePlan) -> AsyncIterator[dict[str, Any]]:
        """Chunks as SGLang streams them: cumulative, `index` on batch items, the finish reason on the last."""
        builders, queue = await self._start(plan)
        try:
            while not all(b.finished for b in builders):
                index, update = await queue.get()
                builder = builders[index]
                builder.apply(update)
                chunk = builder.render()
                if chunk is None:
                    continue
                if plan.is_batch:
                    chunk["index"] = index
                yield chunk
        finally:
            self._leave(builders)

    async def _start(self, plan: GeneratePlan) -> tuple[list[ResponseBuilder], _Updates]:
        try:
            return await self._submit(plan)
        finally:
            plan.release_adapters()  # its sequences are in the scheduler now (or never will be)

    async def _submit(self, plan: GeneratePlan) -> tuple[list[ResponseBuilder], _Updates]:
        self._check_rids(plan)  # again: another request may have taken a rid since plan()
        self._inflight_rids.update(s.rid for s in plan.sequences)
        try:
            for prompt, namespace, lora_id in plan.warmup_prompts:
                await self._prefill_only(prompt, namespace, lora_id)
        except BaseException:
            self._inflight_rids.difference_update(s.rid for s in plan.sequences)
            raise
        loop = asyncio.get_running_loop()
        queue: _Updates = asyncio.Queue()
        arrival_s = time.monotonic()
        builders = []
        for index, planned in enumerate(plan.sequences):
            builders.append(
                ResponseBuilder(
                    rid=planned.rid,
                    prompt_ids=planned.prompt_ids,
                    sampling=planned.sampling,
                    options=planned.logprobs,
                    tokenizer=self.tokenizer,
                    arrival_time_s=arrival_s,
                    return_prompt_token_ids=plan.return_prompt_token_ids,
                )
            )
            self.scheduler.submit(_sequence(planned, _emitter(loop, queue, index), arrival_s))
        return builders, queue

    def _leave(self, builders: list[ResponseBuilder]) -> None:
        for builder in builders:
            if not builder.finished:
                self.scheduler.abort(builder.rid, abort_all=False, exact=True)
            self._inflight_rids.discard(builder.rid)

    async def _run_internal(
        self, prompt: list[int], max_new_tokens: int, namespace: CacheNamespace, lora_id: str | None = None
    ) -> SeqUpdate:
        loop = asyncio.get_running_loop()
        queue: _Updates = asyncio.Queue()
        planned = PlannedSequence(
            f"HEALTH_CHECK_{uuid.uuid4().hex}" if max_new_tokens else f"WARMUP_{uuid.uuid4().hex}",
            prompt,
            SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0),
            LogprobOptions(),
            max_new_tokens,
            namespace,
            lora_id=lora_id,
        )
        seq = _sequence(planned, _emitter(loop, queue, 0), time.monotonic(), internal=True)
        self.scheduler.submit(seq)
        try:
            while True:
                _, update = await queue.get()
                if update.finish is not None:
                    return update
        finally:
            if seq.state != "finished":
                self.scheduler.abort(seq.rid, abort_all=False, exact=True)

    async def _prefill_only(self, prompt: list[int], namespace: CacheNamespace, lora_id: str | None) -> None:
        """SGLang's n > 1 warm-up: prefill the prompt once so that every sample finds it cached."""
        await self._run_internal(prompt, 0, namespace, lora_id)

    async def health_generate(self, timeout_s: float) -> bool:
        """One greedy token from input_ids [0]; False while paused or when it takes longer than timeout_s."""
        if self.scheduler.paused is not None:
            return False
        try:
            update = await asyncio.wait_for(self._run_internal([0], 1, None), timeout_s)
        except TimeoutError:
            return False
        return update.finish is not None and update.finish.kind != "abort"

    # ---- control --------------------------------------------------------------------------------------------
    async def abort(self, rid: str, abort_all: bool) -> int:
        return await asyncio.wrap_future(self.scheduler.abort(rid, abort_all))

    async def pause(self, mode: str) -> int:
        return await asyncio.wrap_future(self.scheduler.pause(mode))

    async def resume(self) -> None:
        await asyncio.wrap_future(self.scheduler.resume())

    async def update_weights_from_disk(
        self, model_path: str, *, weight_version: str | None, abort_all: bool, flush_cache: bool
    ) -> int:
        """Load a checkpoint directory; returns the number of requests held by a pause. Raises WeightUpdateError."""
        prepared = await asyncio.to_thread(self.runner.prepare_weights_from_disk, model_path)
        return await self._apply(prepared, weight_version, abort_all, flush_cache, "disk")

    async def update_weights_from_tensor(
        self,
        serialized: list[str],
        load_format: str | None,
        *,
        weight_version: str | None,
        abort_all: bool,
        flush_cache: bool,
    ) -> int:
        payloads = decode_payloads(serialized, load_format)
        prepared = await asyncio.to_thread(self.runner.prepare_weights_from_tensors, payloads)
        return await self._apply(prepared, weight_version, abort_all, flush_cache, "tensor")

    async def stage_weights_from_tensor(self, serialized: list[str], load_format: str | None, stage_id: str) -> int:
        """Decode and validate tensors now, while generation goes on, and hold them under `stage_id` (a miles
        extension: the weight-sync daemon stages a version before it pauses the engine, so that the pause only
        swaps). Batches of one stage accumulate; a new stage id drops the previous stage. Returns the tensors
        staged so far. Raises WeightUpdateError (nothing of that batch is kept)."""
        if not stage_id:
            raise WeightUpdateError("stage_id is empty")
        payloads = decode_payloads(serialized, load_format)
        prepared = await asyncio.to_thread(self.runner.prepare_weights_from_tensors, payloads)
        if self._staged_id != stage_id:
            self._staged_id, self._staged = stage_id, []
        self._staged.append(prepared)
        return sum(len(p) for p in self._staged if isinstance(p, dict))

    async def apply_staged_weights(
        self, stage_id: str, *, weight_version: str | None, abort_all: bool, flush_cache: bool
    ) -> int:
        """Swap in what was staged under `stage_id` as /update_weights_from_tensor would (immediately when paused);
        raises WeightUpdateError when nothing is staged under it (e.g. the engine restarted since)."""
        if not stage_id or stage_id != self._staged_id:
            raise WeightUpdateError(f"nothing is staged under {stage_id!r}; stage the tensors again")
        staged, self._staged_id, self._staged = self._staged, "", []
        if all(isinstance(p, dict) for p in staged):
            merged: dict[str, Any] = {}
            for part in staged:
                merged.update(part)
            return await self._apply(merged, weight_version, abort_all, flush_cache, "staged")
        for index, part in enumerate(staged):
            last = index == len(staged) - 1
            num_paused = await self._apply(
                part, weight_version if last else None, abort_all, flush_cache and last, "staged"
            )
        return num_paused

    async def update_weights_from_distributed(self, body: UpdateWeightsFromDistributedBody) -> None:
        """Receive the announced tensors over the group (generation goes on meanwhile), then apply them as
        /update_weights_from_tensor does. Raises WeightUpdateError: at once on bad input; after receiving (every
        broadcast consumed, so the trainer is not left hanging) on names or shapes the model does not have."""
        if body.load_format is not None:
            raise WeightUpdateError(f"load_format {body.load_format!r} is not supported (use null)")
        specs = check_tensor_specs(body.names, body.dtypes, body.shapes, self.runner.max_update_bytes)
        group = self.update_groups.claim(body.group_name)

        async def receive_and_apply() -> None:
            try:
                received = await self.update_groups.receive(group, specs)
                prepared = await asyncio.to_thread(self.runner.prepare_weights_from_named, received)
                await self._apply(
                    prepared, body.weight_version, body.abort_all_requests, body.flush_cache, "distributed"
                )
            finally:
                self.update_groups.release(group)

        await self.update_groups.run_to_completion(receive_and_apply())

    async def _apply(
        self, prepared: Any, weight_version: str | None, abort_all: bool, flush_cache: bool, source: str
    ) -> int:
        held = self.scheduler.snapshot()
        num_paused = held.num_running_reqs + held.num_waiting_reqs if held.paused else 0
        future = self.scheduler.update_weights(
            prepared, flush_cache=flush_cache, weight_version=weight_version, abort_all=abort_all, source=source
        )
        await asyncio.wrap_future(future)
        return num_paused

    async def weights_checksum(self, dtype: str | None) -> tuple[str, Checksum]:
        """(weight_version, checksum) of the served weights, both read at the same point between steps."""
        if dtype is not None and dtype not in FLOAT_DTYPE_BYTES:
            raise WeightsCheckError(f"dtype {dtype!r} is not supported; use one of {', '.join(FLOAT_DTYPE_BYTES)}")
        version, snapshot = await asyncio.wrap_future(self.scheduler.weights_snapshot())
        return version, await asyncio.to_thread(self.runner.weights_checksum, snapshot, dtype)

    async def update_weight_version(self, version: str, abort_all: bool) -> None:
        await asyncio.wrap_future(self.scheduler.set_weight_version(version, abort_all))

    async def flush_cache(self, timeout_s: float = 0.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            if await asyncio.wrap_future(self.scheduler.flush_cache()):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)


def _emitter(loop: asyncio.AbstractEventLoop, queue: _Updates, index: int) -> Any:
    def emit(update: SeqUpdate) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (index, update))

    return emit


def _sequence(planned: PlannedSequence, emit: Any, arrival_s: float, *, internal: bool = False) -> Sequence:
    seed = planned.sampling.sampling_seed
    return Sequence(
        rid=planned.rid,
        prompt_ids=planned.prompt_ids,
        sampling=planned.sampling,
        logprobs=planned.logprobs,
        max_new_tokens=planned.max_new_tokens,
        emit=emit,
        arrival_time_s=arrival_s,
        internal=internal,
        namespace=planned.namespace,
        lora_id=planned.lora_id,
        routed_experts_start_len=planned.routed_experts_start_len,
        rng=random.Random(seed if seed is not None else secrets.randbits(64)),
    )


def _rendered(builder: ResponseBuilder) -> dict[str, Any]:
    response = builder.render()
    assert response is not None, "a finished response is never held back"
    return response
