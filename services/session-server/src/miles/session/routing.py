"""Rollout Routing Replay (R3) in a session: which routing rows a turn asks the engine for, the check of what comes
back, and how the stored per-turn chunks become each sample's rows. Pure functions over
`miles.common.contracts.routing` (the one packer); the turn flow (turns.py) and the samples (samples.py) call them.

Rows: row r of a token sequence is the experts position r went through when it was fed (SGLang's `routed_experts`;
the last sampled token was never fed, so n tokens have n - 1 rows). A row depends only on the tokens up to its
position, so rows computed for a prefix stay valid for every sequence that extends that prefix.

Per turn: the prompt extends the base ids (the token buffer, or a rollback's checkpoint) minus `num_trimmed_tokens`;
the base's rows [0, len(base) - 1) are stored, and the first `len(base) - num_trimmed` of them still describe the
prompt's tokens, so the turn asks for `routed_experts_start_len` = the smaller of the two and gets rows
[start, prompt + completion - 1): the new messages the engine prefills and the sampled tokens. That chunk is packed
(narrow dtype) and stored with the record, its start in `TurnRecord.routing_start_row`; chunks are appended, never
rewritten. A chunk that starts before the previous one ends supersedes the rows from its start (a trimmed junction
token); a rollback drops the rolled-back record's chunk with the record, and the retry asks again from the
checkpoint's rows. So rows are never reused for other tokens.

Limits: the engine's routing must be prefix-consistent (SGLang's and miles-engine's are: rows of cached prefixes
come from the KV cache as computed then); a model whose expert ids do not fit the shape is refused at packing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from miles.common.contracts.routing import RoutingError, RoutingShape, decode_sglang, pack
from miles.proto.common.v1 import common_pb2
from miles.session.errors import SampleAssemblyError, UpstreamMalformedError, UpstreamRoutingMismatchError
from miles.session.records import TurnRecord


def start_row(num_base_tokens: int, num_trimmed_tokens: int) -> int:
    """The turn's `routed_experts_start_len`: rows stored for the base ids that still hold for the new prompt."""
    return max(0, min(num_base_tokens - 1, num_base_tokens - num_trimmed_tokens))


def turn_chunk(
    encoded: str | None, shape: RoutingShape, *, start: int, num_prompt_tokens: int, num_completion_tokens: int
) -> bytes:
    """The packed rows of one turn's answer (`meta_info.routed_experts`), exactly the rows asked for.

    UpstreamRoutingMismatchError when the answer has none or another number of rows (an engine without
    --enable-return-routed-experts, a router that drops the request fields); UpstreamMalformedError when it is not
    base64 int32 or holds ids outside the model's experts."""
    num_asked = num_prompt_tokens + num_completion_tokens - 1 - start
    if encoded is None:
        raise UpstreamRoutingMismatchError(
            f"the engine answered no routed_experts for {num_asked} asked rows: serve this MoE job's engines with "
            "--enable-return-routed-experts behind a router that forwards return_routed_experts (or register the "
            "job with record_routing false)"
        )
    try:
        ids = decode_sglang(encoded)
        num_rows, partial = divmod(len(ids), shape.row_width)
        if partial or num_rows != num_asked:
            raise UpstreamRoutingMismatchError(
                f"the engine answered {len(ids)} routed expert ids, not the {num_asked} rows of {shape.num_layers} "
                f"MoE layers x {shape.top_k} experts asked for (positions [{start}, "
                f"{num_prompt_tokens + num_completion_tokens - 1})): is the engine serving another model?"
            )
        return bytes(pack(ids, shape).data)
    except RoutingError as exc:
        raise UpstreamMalformedError(f"malformed routed_experts from the upstream: {exc}") from None


@dataclass(frozen=True)
class SessionRouting:
    """A session's routing, assembled for its whole token buffer: `rows` holds (len(token_ids) - 1) rows."""

    rows: bytes
    shape: RoutingShape

    def for_tokens(self, tokens: Sequence[int], token_ids: Sequence[int]) -> common_pb2.RoutedExperts:
        """The rows of a sample whose `tokens` are a prefix of the buffer (row r = position r), or of a one-token
        placeholder (no rows)."""
        if len(tokens) > 1 and list(tokens) != list(token_ids[: len(tokens)]):
            raise SampleAssemblyError("a sample's tokens are not a prefix of the token buffer: no routing rows")
        data = self.rows[: (len(tokens) - 1) * self.shape.bytes_per_row()] if tokens else b""
        return common_pb2.RoutedExperts(
            data=data, dtype=self.shape.dtype, num_layers=self.shape.num_layers, top_k=self.shape.top_k
        )


def assemble(
    records: Sequence[TurnRecord], chunks: Sequence[bytes], shape: RoutingShape, num_tokens: int
) -> SessionRouting:
    """The buffer's rows from the records' chunks (module docstring); SampleAssemblyError when they do not fit."""
    if len(chunks) != len(records):
        raise SampleAssemblyError(f"{len(records)} turn records but {len(chunks)} routing chunks")
    row_bytes = shape.bytes_per_row()
    rows = bytearray()
    for index, (record, chunk) in enumerate(zip(records, chunks, strict=True)):
        start = record.routing_start_row
        end = record.prompt_len + len(record.completion_ids) - 1
        if start is None or not 0 <= start * row_bytes <= len(rows) or len(chunk) != (end - start) * row_bytes:
            raise SampleAssemblyError(
                f"record {index}: its routing chunk ({len(chunk)} bytes from row {start}) does not cover rows "
                f"[{start}, {end}) after the {len(rows) // row_bytes} rows before it",
                details={"record": index},
            )
        del rows[start * row_bytes :]
        rows += chunk
    if records and len(rows) != (num_tokens - 1) * row_bytes:
        raise SampleAssemblyError(f"routing covers {len(rows) // row_bytes} rows of a {num_tokens}-token buffer")
    return SessionRouting(bytes(rows), shape)
