"""One chat turn, the three-phase lock (Miles' flow over a shared store):

1. prepare: read the session (with the auth read, one round trip, no lock), decide append / retry-rollback (a
   rollback re-reads the state and the records under the session lock, so they agree), build the prompt ids with
   TITO (only the new messages are rendered and encoded);
2. generate (no lock): SGLang-native /generate through the rollout router;
3. commit (atomic, waiting while another request holds the lock): the session's version must be the one phase 1
   read (fencing); then the new history, the token buffer (prompt + sampled ids) and the record are written.
   A turn that lost the race (another turn on the session committed first) is still answered, but not recorded,
   and says so in the response's `miles.recorded`.
Nothing is written before phase 3, so a failed turn (bad input, engine error) leaves the session as it was.
A session that records routing (R3) asks the engine in phase 2 for the routing rows it does not hold yet
(routing.py), checks their count, and commits them packed beside the record in phase 3; the agent's answer is built
from the parsed completion only, so routing never reaches it (a client's own `return_routed_experts` is ignored).
A LoRA job's phase 2 names the job's live adapter and records its version (adapters.py), for linear and tree turns.
`run` is a non-streamed turn; a streamed one (streaming.py) calls `prepare` (phase 1), relays phase 2 itself and
then `finish` (phase 3), so both commit exactly the same way.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from miles.common.errors import MilesError
from miles.session import openai_format, routing
from miles.session.adapters import JobAdapters
from miles.session.api_models import ChatCompletionRequest
from miles.session.errors import (
    InvalidRequestError,
    PromptTooLongError,
    SessionNotFoundError,
    UpstreamConflictError,
    UpstreamMalformedError,
    UpstreamRejectedError,
    UpstreamRoutingMismatchError,
)
from miles.session.history import TurnPlan, num_records_to_keep, plan_turn
from miles.session.metrics import SessionMetrics
from miles.session.model_assets import ModelRegistry, SessionModel
from miles.session.openai_format import CompletionBudget
from miles.session.records import CommitOutcome, Json, SessionMeta, SessionState, TurnCommit
from miles.session.store import SessionStore
from miles.session.tree import TreeTurnPlan
from miles.session.tree_turns import TreeLimits, check_tree_room, prepare_tree_turn, tree_commit, tree_fields
from miles.session.upstream import Completion, EngineClient, UpstreamAbortedError, pinned_weight_version

tracer = trace.get_tracer("miles.session")


@dataclass(frozen=True)
class TurnStart:
    """A turn's first read: the session's meta and state, read together with the auth check (store.load_turn_start).
    A tree turn uses only the meta."""

    meta: SessionMeta
    state: SessionState


@dataclass(frozen=True)
class TurnRouting:
    """A turn's routing rows (R3): the first position asked for and the packed chunk of rows from there on."""

    start_row: int
    chunk: bytes


@dataclass(frozen=True)
class PreparedTurn:
    """A turn after phase 1: what the engine is asked and what phase 3 commits against."""

    meta: SessionMeta
    request: ChatCompletionRequest
    model: SessionModel
    plan: TurnPlan | TreeTurnPlan
    budget: CompletionBudget
    routing_start: int | None
    attributes: dict[str, str]

    @property
    def prompt_ids(self) -> list[int]:
        return self.plan.prompt.prompt_ids


def _upstream_error_kind(error: MilesError) -> str:
    if isinstance(error, UpstreamAbortedError):
        return "aborted"
    if isinstance(error, UpstreamRejectedError):
        return "rejected"
    if isinstance(error, UpstreamConflictError):
        return "conflict"
    if isinstance(error, UpstreamMalformedError):
        return "malformed"
    return "unreachable"


class TurnRunner:
    def __init__(
        self,
        *,
        store: SessionStore,
        models: ModelRegistry,
        engine: EngineClient,
        metrics: SessionMetrics,
        tree_limits: TreeLimits,
        adapters: JobAdapters,
    ) -> None:
        self._store = store
        self._models = models
        self._engine = engine
        self._metrics = metrics
        self._tree_limits = tree_limits
        self._adapters = adapters

    async def run(self, start: TurnStart, request: ChatCompletionRequest) -> Json:
        """The chat.completion body of one turn (MilesError subclasses for every refusal)."""
        started_s = time.perf_counter()
        try:
            turn = await self.prepare(start, request)
            with tracer.start_as_current_span("session.upstream", attributes=turn.attributes) as span:
                phase_started_s = time.perf_counter()
                completion = await self._generate(turn)
                span.set_attribute("miles.weight_version", completion.weight_version)
                self._observe_phase("upstream", phase_started_s)
            body = await self.finish(turn, completion)
        except MilesError as exc:
            self.count_failure(exc)
            raise
        self.count_answered(body, started_s)
        return body

    def count_failure(self, exc: MilesError) -> None:
        self._metrics.turns.labels(result="failed").inc()
        self._metrics.turn_errors.labels(code=exc.code).inc()

    def count_answered(self, body: Json, started_s: float) -> None:
        recorded = body["miles"]["recorded"]
        self._metrics.turns.labels(result="recorded" if recorded else "not_recorded").inc()
        self._metrics.turn_duration_s.observe(time.perf_counter() - started_s)

    def count_upstream_error(self, exc: MilesError) -> None:
        if isinstance(exc, UpstreamRoutingMismatchError):
            self._metrics.routing_row_mismatches.inc()
        self._metrics.upstream_errors.labels(kind=_upstream_error_kind(exc)).inc()

    async def _prepare(self, start: TurnStart, model: SessionModel, request: ChatCompletionRequest) -> TurnPlan:
        """Phase 1 of a linear turn. An append plans from the state read with the auth check (the commit is fenced
        on its version); a rollback that keeps some records reads the state and the records again under the lock."""
        state, records = start.state, []
        num_keep = num_records_to_keep(state, request.messages)
        if 0 < num_keep < state.num_records:
            session_id = start.meta.session_id
            async with self._store.locked_state(session_id) as locked:
                if locked is None:
                    raise SessionNotFoundError(f"session {session_id} does not exist (deleted or expired)")
                state = locked
                num_keep = num_records_to_keep(state, request.messages)
                records = await self._store.load_records(session_id) if 0 < num_keep < state.num_records else []
        plan = plan_turn(
            model.tito,
            state,
            records,
            request.messages,
            num_keep=num_keep,
            request_tools=request.tools,
            chat_template_kwargs=request.chat_template_kwargs,
        )
        if num_keep < state.num_records:
            self._metrics.rollbacks.inc()
        return plan

    @staticmethod
    def _budget(
        meta: SessionMeta, model: SessionModel, request: ChatCompletionRequest, num_prompt_tokens: int
    ) -> CompletionBudget:
        """The turn's completion limit (openai_format.completion_budget); 400 when the prompt leaves no room."""
        context = model.max_context_tokens
        if context is not None and num_prompt_tokens + 1 >= context:
            raise PromptTooLongError(
                f"the prompt is {num_prompt_tokens} tokens; the model's context is {context} tokens and prompt + "
                "completion must stay below it, so at least one token must be left to generate",
                field="messages",
                details={"num_prompt_tokens": num_prompt_tokens, "max_context_tokens": context},
            )
        return openai_format.completion_budget(
            meta.model.sampling_defaults,
            request,
            num_prompt_tokens=num_prompt_tokens,
            max_context_tokens=context,
            max_new_tokens_cap=meta.model.max_new_tokens,
        )

    def upstream_args(self, turn: PreparedTurn) -> dict[str, Any]:
        """The EngineClient arguments of `turn` (all but `stream` and `lora_path`)."""
        meta = turn.meta
        params = openai_format.sampling_params(
            meta.model.sampling_defaults,
            turn.request,
            stop_token_ids=turn.model.tito.stop_token_ids,
            budget=turn.budget,
        )
        return {
            "input_ids": turn.prompt_ids,
            "sampling_params": params,
            "routing_key": meta.session_id,
            "pool": meta.model.engine_pool,
            "routed_experts_start_len": turn.routing_start,
            "min_weight_version": pinned_weight_version(meta.metadata),
        }

    async def _generate(self, turn: PreparedTurn) -> Completion:
        """The completion of a non-streamed turn. A LoRA job's turn is served with the job's live adapter and
        records its version (adapters.py)."""
        args = self.upstream_args(turn)

        async def call(lora_path: str | None) -> Completion:
            return await self._engine.generate(**args, stream=False, lora_path=lora_path)

        meta = turn.meta
        try:
            adapter = await self._adapters.wait_live(meta.job_id) if meta.model.lora_adapter else None
            if adapter is None:
                return await call(None)
            return await self._adapters.generate(meta.job_id, adapter, call)
        except MilesError as exc:
            self.count_upstream_error(exc)
            raise

    async def _turn_routing(self, turn: PreparedTurn, completion: Completion) -> TurnRouting | None:
        """The completion's checked routing rows from `turn.routing_start` on (None when not recorded)."""
        if turn.routing_start is None or turn.model.routing is None:
            return None
        try:
            # In a worker thread: a long first prompt of a large MoE model is millions of ids to check and pack.
            chunk = await asyncio.to_thread(
                routing.turn_chunk,
                completion.routed_experts,
                turn.model.routing,
                start=turn.routing_start,
                num_prompt_tokens=len(turn.prompt_ids),
                num_completion_tokens=len(completion.output_ids),
            )
        except MilesError as exc:
            self.count_upstream_error(exc)
            raise
        return TurnRouting(turn.routing_start, chunk)

    async def prepare(self, start: TurnStart, request: ChatCompletionRequest) -> PreparedTurn:
        """Phase 1 and the checks before the engine is called (nothing is written)."""
        meta = start.meta
        attributes = {"miles.session_id": meta.session_id, "miles.job_id": meta.job_id}
        model = await self._models.get(meta.model)
        if request.parent_node_id is not None and not meta.tree:
            raise InvalidRequestError(
                "parent_node_id needs a tree session (create it with tree: true, or a job with tree_sessions)",
                field="parent_node_id",
            )
        with tracer.start_as_current_span("session.prepare", attributes=attributes):
            phase_started_s = time.perf_counter()
            plan: TurnPlan | TreeTurnPlan
            if meta.tree:
                plan = await prepare_tree_turn(self._store, meta, model, request, self._tree_limits)
            else:
                plan = await self._prepare(start, model, request)
            self._observe_phase("prepare", phase_started_s)
        prompt_ids = plan.prompt.prompt_ids
        routing_start = None
        if model.routing is not None:
            routing_start = routing.start_row(len(plan.prompt.stored_ids), plan.prompt.num_trimmed_tokens)
        budget = self._budget(meta, model, request, len(prompt_ids))
        if isinstance(plan, TreeTurnPlan):
            check_tree_room(meta.session_id, plan, len(prompt_ids), budget.max_new_tokens, self._tree_limits)
        if budget.clamped_from is not None:
            self._metrics.max_tokens_clamped.inc()
        return PreparedTurn(meta, request, model, plan, budget, routing_start, attributes)

    async def finish(self, turn: PreparedTurn, completion: Completion, *, completion_id: str | None = None) -> Json:
        """Phase 3 for a finished generation: routing checked, the message parsed, the turn committed; the body."""
        turn_routing = await self._turn_routing(turn, completion)
        meta, plan, prompt_ids = turn.meta, turn.plan, turn.prompt_ids
        message = self._assistant_message(turn.model, plan, completion)
        tree: Json | None = None
        with tracer.start_as_current_span("session.commit", attributes=turn.attributes):
            phase_started_s = time.perf_counter()
            if isinstance(plan, TreeTurnPlan):
                outcome, tree = await self._commit_node(meta, plan, prompt_ids, completion, message, turn_routing)
            else:
                outcome = await self._commit(meta, plan, prompt_ids, completion, message, turn_routing)
            self._observe_phase("commit", phase_started_s)
        if turn_routing is not None and outcome is CommitOutcome.COMMITTED:
            self._metrics.routing_bytes.inc(len(turn_routing.chunk))
        self._count_tokens(meta, plan, prompt_ids, completion)
        body = self._body(turn, completion, message, outcome, completion_id or f"chatcmpl-{uuid.uuid4().hex}")
        if tree is not None:
            body["miles"]["tree"] = tree
        return body

    async def _commit_node(
        self,
        meta: SessionMeta,
        plan: TreeTurnPlan,
        prompt_ids: list[int],
        completion: Completion,
        message: Json,
        turn_routing: TurnRouting | None,
    ) -> tuple[CommitOutcome, Json]:
        commit = tree_commit(
            meta,
            plan,
            prompt_ids,
            completion,
            message,
            limits=self._tree_limits,
            routing_start_row=turn_routing.start_row if turn_routing is not None else None,
            routing_chunk=turn_routing.chunk if turn_routing is not None else None,
        )
        outcome = await self._store.add_node(meta.session_id, commit)
        if outcome is CommitOutcome.COMMITTED:
            self._metrics.tree_nodes.labels(kind="root" if plan.parent is None else "child").inc()
        return outcome, tree_fields(plan, commit, outcome)

    def _assistant_message(self, model: SessionModel, plan: TurnPlan | TreeTurnPlan, completion: Completion) -> Json:
        text = model.tito.codec.decode(completion.output_ids)
        matched = completion.finish_matched
        if isinstance(matched, str) and matched and matched in text:  # a stop string: OpenAI leaves it out
            text = text[: text.index(matched)]
        parsed = model.tito.parse_completion(text, reasoning_open=plan.prompt.reasoning_open, tools=plan.tools)
        return openai_format.assistant_message(parsed, plan.num_kept_records)

    async def _commit(
        self,
        meta: SessionMeta,
        plan: TurnPlan,
        prompt_ids: list[int],
        completion: Completion,
        message: Json,
        turn_routing: TurnRouting | None,
    ) -> CommitOutcome:
        messages = [*plan.base_messages, *plan.appended, message]
        record = completion.record(
            turn_index=plan.num_kept_records,
            prompt_len=len(prompt_ids),
            num_trimmed_tokens=plan.prompt.num_trimmed_tokens,
            messages_end=len(messages),
            routing_start_row=turn_routing.start_row if turn_routing is not None else None,
        )
        commit = TurnCommit(
            expected_version=plan.state_version,
            num_kept_records=plan.num_kept_records,
            messages=messages,
            token_ids=prompt_ids + completion.output_ids,
            tools=plan.tools,
            record=record,
            message_ends=[*plan.kept_message_ends, len(messages)],
            ttl_s=meta.ttl_s,
            routing=turn_routing.chunk if turn_routing is not None else None,
        )
        return await self._store.commit(meta.session_id, commit)

    @staticmethod
    def _body(turn: PreparedTurn, completion: Completion, message: Json, outcome: CommitOutcome, cid: str) -> Json:
        recorded = outcome is CommitOutcome.COMMITTED
        plan, budget = turn.plan, turn.budget
        return openai_format.completion_body(
            completion_id=cid,
            created=int(time.time()),
            model=turn.request.model or turn.model.name,
            message=message,
            finish=openai_format.finish_reason(message, completion.finish_type),
            usage_body=openai_format.usage(len(turn.prompt_ids), len(completion.output_ids), completion.cached_tokens),
            miles={
                "session_id": turn.meta.session_id,
                "turn_index": plan.num_kept_records,
                "recorded": recorded,
                "not_recorded_reason": None if recorded else outcome.value,
                "weight_version": completion.weight_version,
                "num_appended_tokens": len(plan.prompt.appended_ids),
                "max_new_tokens": budget.max_new_tokens,
                "max_tokens_clamped_from": budget.clamped_from,
            },
        )

    def _count_tokens(
        self, meta: SessionMeta, plan: TurnPlan | TreeTurnPlan, prompt_ids: list[int], completion: Completion
    ) -> None:
        self._metrics.prompt_tokens.inc(len(prompt_ids))
        self._metrics.completion_tokens.inc(len(completion.output_ids))
        self._metrics.cached_tokens.inc(completion.cached_tokens)
        self._metrics.appended_tokens.inc(len(plan.prompt.appended_ids))
        self._metrics.job_prompt_tokens.labels(job_id=meta.job_id).inc(len(prompt_ids))
        self._metrics.job_completion_tokens.labels(job_id=meta.job_id).inc(len(completion.output_ids))

    def _observe_phase(self, phase: str, started_s: float) -> None:
        self._metrics.phase_duration_s.labels(phase=phase).observe(time.perf_counter() - started_s)
