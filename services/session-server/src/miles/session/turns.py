"""One chat turn, the three-phase lock (Miles' flow over a shared store):

1. prepare (under the session lock): read the session, decide append / retry-rollback, build the prompt ids with
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
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

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
from miles.session.records import CommitOutcome, Json, SessionMeta, TurnCommit
from miles.session.store import SessionStore
from miles.session.tree import TreeTurnPlan
from miles.session.tree_turns import TreeLimits, check_tree_room, prepare_tree_turn, tree_commit, tree_fields
from miles.session.upstream import Completion, EngineClient, UpstreamAbortedError, pinned_weight_version

tracer = trace.get_tracer("miles.session")


@dataclass(frozen=True)
class TurnRouting:
    """A turn's routing rows (R3): the first position asked for and the packed chunk of rows from there on."""

    start_row: int
    chunk: bytes


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

    async def run(self, meta: SessionMeta, request: ChatCompletionRequest) -> Json:
        """The chat.completion body of one turn (MilesError subclasses for every refusal)."""
        started_s = time.perf_counter()
        try:
            body = await self._run(meta, request)
        except MilesError as exc:
            self._metrics.turns.labels(result="failed").inc()
            self._metrics.turn_errors.labels(code=exc.code).inc()
            raise
        recorded = body["miles"]["recorded"]
        self._metrics.turns.labels(result="recorded" if recorded else "not_recorded").inc()
        self._metrics.turn_duration_s.observe(time.perf_counter() - started_s)
        return body

    async def _prepare(self, meta: SessionMeta, model: SessionModel, request: ChatCompletionRequest) -> TurnPlan:
        async with self._store.locked_state(meta.session_id) as state:
            if state is None:
                raise SessionNotFoundError(f"session {meta.session_id} does not exist (deleted or expired)")
            num_keep = num_records_to_keep(state, request.messages)
            needs_records = 0 < num_keep < state.num_records
            records = await self._store.load_records(meta.session_id) if needs_records else []
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

    async def _generate(
        self,
        meta: SessionMeta,
        model: SessionModel,
        request: ChatCompletionRequest,
        prompt_ids: list[int],
        budget: CompletionBudget,
        routing_start: int | None,
    ) -> tuple[Completion, TurnRouting | None]:
        """The completion and, when `routing_start` is given, its checked routing rows from that position on. A
        LoRA job's turn is served with the job's live adapter and records its version (adapters.py)."""
        params = openai_format.sampling_params(
            meta.model.sampling_defaults, request, stop_token_ids=model.tito.stop_token_ids, budget=budget
        )

        async def call(lora_path: str | None) -> Completion:
            return await self._engine.generate(
                input_ids=prompt_ids,
                sampling_params=params,
                stream=request.stream,
                routing_key=meta.session_id,
                pool=meta.model.engine_pool,
                routed_experts_start_len=routing_start,
                lora_path=lora_path,
                min_weight_version=pinned_weight_version(meta.metadata),
            )

        adapter = await self._adapters.wait_live(meta.job_id) if meta.model.lora_adapter else None
        try:
            if adapter is None:
                completion = await call(None)
            else:
                completion = await self._adapters.generate(meta.job_id, adapter, call)
            if routing_start is None or model.routing is None:
                return completion, None
            # In a worker thread: a long first prompt of a large MoE model is millions of ids to check and pack.
            chunk = await asyncio.to_thread(
                routing.turn_chunk,
                completion.routed_experts,
                model.routing,
                start=routing_start,
                num_prompt_tokens=len(prompt_ids),
                num_completion_tokens=len(completion.output_ids),
            )
            return completion, TurnRouting(routing_start, chunk)
        except MilesError as exc:
            if isinstance(exc, UpstreamRoutingMismatchError):
                self._metrics.routing_row_mismatches.inc()
            self._metrics.upstream_errors.labels(kind=_upstream_error_kind(exc)).inc()
            raise

    async def _run(self, meta: SessionMeta, request: ChatCompletionRequest) -> Json:
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
                plan = await self._prepare(meta, model, request)
            prompt_ids = plan.prompt.prompt_ids
            self._observe_phase("prepare", phase_started_s)
        routing_start = None
        if model.routing is not None:
            routing_start = routing.start_row(len(plan.prompt.stored_ids), plan.prompt.num_trimmed_tokens)
        budget = self._budget(meta, model, request, len(prompt_ids))
        if isinstance(plan, TreeTurnPlan):
            check_tree_room(meta.session_id, plan, len(prompt_ids), budget.max_new_tokens, self._tree_limits)
        if budget.clamped_from is not None:
            self._metrics.max_tokens_clamped.inc()
        with tracer.start_as_current_span("session.upstream", attributes=attributes) as span:
            phase_started_s = time.perf_counter()
            completion, turn_routing = await self._generate(meta, model, request, prompt_ids, budget, routing_start)
            span.set_attribute("miles.weight_version", completion.weight_version)
            self._observe_phase("upstream", phase_started_s)
        message = self._assistant_message(model, plan, completion)
        tree: Json | None = None
        with tracer.start_as_current_span("session.commit", attributes=attributes):
            phase_started_s = time.perf_counter()
            if isinstance(plan, TreeTurnPlan):
                outcome, tree = await self._commit_node(meta, plan, prompt_ids, completion, message, turn_routing)
            else:
                outcome = await self._commit(meta, plan, prompt_ids, completion, message, turn_routing)
            self._observe_phase("commit", phase_started_s)
        if turn_routing is not None and outcome is CommitOutcome.COMMITTED:
            self._metrics.routing_bytes.inc(len(turn_routing.chunk))
        self._count_tokens(meta, plan, prompt_ids, completion)
        body = self._body(meta, model, request, plan, prompt_ids, completion, message, outcome, budget)
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

    def _body(
        self,
        meta: SessionMeta,
        model: SessionModel,
        request: ChatCompletionRequest,
        plan: TurnPlan | TreeTurnPlan,
        prompt_ids: list[int],
        completion: Completion,
        message: Json,
        outcome: CommitOutcome,
        budget: CompletionBudget,
    ) -> Json:
        recorded = outcome is CommitOutcome.COMMITTED
        return openai_format.completion_body(
            completion_id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=request.model or model.name,
            message=message,
            finish=openai_format.finish_reason(message, completion.finish_type),
            usage_body=openai_format.usage(len(prompt_ids), len(completion.output_ids), completion.cached_tokens),
            miles={
                "session_id": meta.session_id,
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
