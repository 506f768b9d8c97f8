"""SessionViews: the read side of a session (`GET /v1/sessions/{id}` and its training samples), without a web framework.

Both load the whole session (its state, every record, for a tree every node) and run TITO's end-of-session check;
for a long session that is seconds of CPU and ~100 MB of output. Nothing here takes the session's lock. The HTTP
layer answers small sessions with this class in its own process and long ones through an export process
(exports.py), which runs this same class on the same store.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from miles.session import samples_wire
from miles.session.api_models import SamplesRequest
from miles.session.errors import SessionNotFoundError
from miles.session.json_stream import json_body, release_in_slices
from miles.session.metrics import SessionMetrics
from miles.session.model_assets import ModelRegistry, SessionModel
from miles.session.openapi_docs import PROTOBUF_MEDIA_TYPE
from miles.session.records import Json, SessionMeta, SessionState, TurnRecord
from miles.session.routing import assemble as assemble_routing
from miles.session.samples import SampleData, build_samples
from miles.session.store import SessionStore
from miles.session.tito import ComparisonResult
from miles.session.tree import SessionTree
from miles.session.tree_samples import tree_samples, tree_view

JSON_MEDIA_TYPE = "application/json"
PROTOBUF_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class ViewRequest:
    """One read of a session: its view (`describe`) or its samples (`samples`, as JSON or protobuf)."""

    op: Literal["describe", "samples"]
    meta: SessionMeta
    samples: SamplesRequest = field(default_factory=SamplesRequest)
    protobuf: bool = False

    def to_json(self) -> Json:
        return {
            "op": self.op,
            "meta": self.meta.to_json(),
            "samples": self.samples.model_dump(mode="json"),
            "protobuf": self.protobuf,
        }

    @classmethod
    def from_json(cls, data: Json) -> ViewRequest:
        op: Literal["describe", "samples"] = "samples" if data["op"] == "samples" else "describe"
        meta, samples = SessionMeta.from_json(data["meta"]), SamplesRequest.model_validate(data["samples"])
        return cls(op=op, meta=meta, samples=samples, protobuf=bool(data["protobuf"]))


@dataclass
class Rendered:
    """An answer's media type and its body, in pieces (a long session's is ~100 MB)."""

    media_type: str
    body: AsyncIterator[bytes]


class SessionViews:
    def __init__(self, *, store: SessionStore, models: ModelRegistry, metrics: SessionMetrics) -> None:
        self.store = store
        self.models = models
        self.metrics = metrics

    async def _load(self, meta: SessionMeta) -> tuple[SessionState, list[TurnRecord], SessionModel]:
        state = await self.store.load_state(meta.session_id)
        if state is None:
            raise SessionNotFoundError(f"session {meta.session_id} does not exist (deleted or expired)")
        records = await self.store.load_records(meta.session_id)
        return state, records, await self.models.get(meta.model)

    @staticmethod
    def _comparison(model: SessionModel, state: SessionState, records: list[TurnRecord]) -> ComparisonResult | None:
        """TITO's end-of-session check: the token buffer against a fresh render of the stored history."""
        if not state.token_ids:
            return None
        expected = model.tito.encode_messages(state.messages, tools=state.tools)
        # A last turn cut at max_tokens has no stop token yet (the next prompt would add it): compare without it.
        comparator = model.tito.comparator()
        sampled = [(r.prompt_len, r.prompt_len + len(r.completion_ids)) for r in records]
        result = comparator.compare(
            expected=expected, actual=state.token_ids, trim_ids=model.tito.stop_token_ids, sampled_spans=sampled
        )
        release_in_slices(expected)  # millions of ids for a long session: not freed in one GIL-holding call
        return result

    async def describe(self, meta: SessionMeta) -> tuple[Json, list[list[Any]]]:
        """GET /v1/sessions/{id}: metadata, history, the token buffer, every record and the TITO check; a tree
        session's view is its tree's shape and records instead (no path is rendered, no lock is taken). With the
        view, its big lists that only it holds: to empty in slices once written (json_stream.release_on_loop)."""
        state, records, model = await self._load(meta)
        if meta.tree:
            tree = SessionTree(await self.store.load_tree(meta.session_id))
            return {**self._head(meta, state, model), "tree": await asyncio.to_thread(tree_view, tree)}, []
        comparison = await asyncio.to_thread(self._comparison, model, state, records)
        owned = self.store.hands_out_copies  # else the records' lists are the store's: the view gets copies
        views = await asyncio.to_thread(lambda: [r.to_json(copy_arrays=not owned) for r in records])
        release = [view[name] for view in views for name in ("completion_ids", "logprobs")]
        view = {
            **self._head(meta, state, model),
            "num_turns": len(records),
            "messages": state.messages,
            "tools": state.tools,
            "accumulated_token_ids": state.token_ids,
            "weight_versions": [r.weight_version for r in records],
            "records": views,
            "tito_session_mismatch": comparison.to_metadata() if comparison is not None else None,
        }
        return view, [state.token_ids, *release] if owned else release

    @staticmethod
    def _head(meta: SessionMeta, state: SessionState, model: SessionModel) -> Json:
        return {
            "session_id": meta.session_id,
            "job_id": meta.job_id,
            "episode_id": meta.episode_id,
            "created_at_unix_ms": meta.created_at_unix_ms,
            "ttl_s": meta.ttl_s,
            "metadata": meta.metadata,
            "model": meta.model.to_json(),
            "role": meta.role or None,
            "kind": "tree" if meta.tree else "linear",
            "version": state.version,
            "num_not_recorded_turns": state.num_not_recorded,
            "max_trim_tokens": model.tito.max_trim_tokens,
        }

    async def samples(self, meta: SessionMeta, request: SamplesRequest) -> Any:
        """POST /v1/sessions/{id}/samples as a `miles.session.v1.SessionSamples` message."""
        state, records, model = await self._load(meta)
        session_metadata: Json = {
            "num_not_recorded_turns": state.num_not_recorded,
            "max_trim_tokens": model.tito.max_trim_tokens,
            "model_family": meta.model.model_family,
        }
        if meta.tree:
            samples, empty_reason, comparison = await self._tree_samples(meta, model, request, session_metadata)
        else:
            chunks = await self.store.load_routing(meta.session_id) if model.routing is not None else []
            samples, empty_reason, comparison = await asyncio.to_thread(
                self._build_samples, meta, state, records, chunks, model, request
            )
            if comparison is not None:
                self.metrics.tito.record(comparison)
            session_metadata["num_turns"] = len(records)
        session_metadata["tito_session_mismatch"] = comparison.to_metadata() if comparison is not None else None
        num_critical = comparison.num_critical if comparison is not None else 0
        metadata = {**meta.metadata, **(request.metadata or {}), "tito_num_critical": num_critical}
        if meta.role:
            metadata["role"] = meta.role
        messages = []
        for sample in samples:
            self.metrics.samples.labels(status=sample.status).inc()
            messages.append(
                samples_wire.to_sample(
                    sample, meta, group_id=request.group_id, reward=request.reward, metadata=metadata
                )
            )
        return samples_wire.session_samples(
            meta, messages, empty_reason=empty_reason, session_metadata=session_metadata
        )

    async def _tree_samples(
        self, meta: SessionMeta, model: SessionModel, request: SamplesRequest, session_metadata: Json
    ) -> tuple[list[SampleData], str, ComparisonResult | None]:
        """A tree session's samples (tree_samples.py); the worst path's TITO check stands for the session."""
        tree = SessionTree(await self.store.load_tree(meta.session_id))
        deltas = await self.store.load_tree_ids(meta.session_id)
        chunks = await self.store.load_tree_routing(meta.session_id) if model.routing is not None else None
        built = await asyncio.to_thread(
            tree_samples,
            model,
            tree,
            deltas,
            chunks,
            episode_id=meta.episode_id,
            mode=request.mode,
            max_seq_len=request.max_seq_len,
        )
        for comparison in built.comparisons.values():
            self.metrics.tito.record(comparison)
        self.metrics.tree_path_tokens.inc(built.stats.num_path_tokens)
        self.metrics.tree_unique_tokens.inc(built.stats.num_tree_tokens)
        session_metadata["num_turns"] = built.stats.num_nodes
        session_metadata["tree"] = built.stats.to_json()
        session_metadata["tito_num_critical_paths"] = sum(1 for c in built.comparisons.values() if c.num_critical)
        return built.samples, built.empty_reason, built.worst

    def _build_samples(
        self,
        meta: SessionMeta,
        state: SessionState,
        records: list[TurnRecord],
        routing_chunks: list[bytes],
        model: SessionModel,
        request: SamplesRequest,
    ) -> tuple[list[SampleData], str, ComparisonResult | None]:
        routing = None
        if model.routing is not None:
            routing = assemble_routing(records, routing_chunks, model.routing, len(state.token_ids))
        samples, empty_reason = build_samples(
            records,
            state.token_ids,
            max_trim_tokens=model.tito.max_trim_tokens,
            mode=request.mode,
            max_seq_len=request.max_seq_len,
            episode_id=meta.episode_id,
            placeholder_token_id=model.eos_token_id or 0,
            routing=routing,
        )
        return samples, empty_reason, self._comparison(model, state, records)

    async def render(self, request: ViewRequest) -> Rendered:
        """The answer's body: loaded and built here (errors raise before any piece), written piece by piece."""
        if request.op == "describe":
            view, release = await self.describe(request.meta)
            return Rendered(JSON_MEDIA_TYPE, json_body(view, release=release))  # not in one piece, nor freed in one
        message = await self.samples(request.meta, request.samples)
        if request.protobuf:
            data: bytes = await asyncio.to_thread(message.SerializeToString)
            return Rendered(PROTOBUF_MEDIA_TYPE, _chunks(data))
        as_dict = await asyncio.to_thread(samples_wire.to_dict, message)
        return Rendered(JSON_MEDIA_TYPE, json_body(as_dict))


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    view = memoryview(data)
    for start in range(0, len(data), PROTOBUF_CHUNK_BYTES):
        yield bytes(view[start : start + PROTOBUF_CHUNK_BYTES])
