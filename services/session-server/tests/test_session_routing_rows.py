"""Routing replay (R3) rows without a model: the start row of a turn, the check and packing of an engine's answer,
the assembly of stored chunks (superseded rows cut, gaps refused), the stores' chunk lists, and the turn flow
in-process against the scripted engine (its routing is a prefix-consistent function of the tokens): job configs,
a retry, a client's own `return_routed_experts`, and answers with the wrong rows."""

from __future__ import annotations

import base64
from array import array
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from miles.common.contracts.routing import RoutingShape, unpack
from miles.common.contracts.samples import sample_problem
from miles.proto.session.v1 import session_pb2
from miles.session.errors import SampleAssemblyError, UpstreamMalformedError, UpstreamRoutingMismatchError
from miles.session.records import CommitOutcome, FinishType, ModelConfig, SessionMeta, TurnCommit, TurnRecord
from miles.session.routing import assemble, start_row, turn_chunk
from miles.session.store_memory import MemoryStore
from miles.session.store_redis import RedisStore

SHAPE = RoutingShape(num_layers=2, top_k=2, num_experts=8)  # 4 ids a row, uint8


def b64(ids: list[int]) -> str:
    return base64.b64encode(array("i", ids).tobytes()).decode()


def record(index: int, prompt_len: int, num_output: int, routing_start: int | None) -> TurnRecord:
    output = list(range(num_output))
    return TurnRecord(
        index, prompt_len, 0, output, [0.0] * num_output, "1", 0, prompt_len, FinishType.STOP, None, 2, 0, 0.0,
        routing_start_row=routing_start,
    )  # fmt: skip


def rows(*values: int) -> bytes:
    """Packed rows, each row all `value` (4 uint8 ids)."""
    return bytes(v for value in values for v in [value] * 4)


def test_a_turn_asks_only_for_rows_whose_tokens_are_unchanged() -> None:
    assert start_row(0, 0) == 0  # first turn: everything
    assert start_row(10, 0) == 9  # the base's last token was never fed: its row comes with this turn
    assert start_row(10, 1) == 9  # GLM: the trimmed stop token had no row anyway
    assert start_row(10, 2) == 8  # a longer trim drops the rows of the replaced tokens


def test_an_answer_is_packed_only_with_exactly_the_rows_asked_for() -> None:
    ids = [1, 2, 3, 4] * 3
    chunk = turn_chunk(b64(ids), SHAPE, start=4, num_prompt_tokens=6, num_completion_tokens=2)  # rows [4, 7)
    assert chunk == bytes(ids)  # narrowed to uint8
    assert turn_chunk("", SHAPE, start=6, num_prompt_tokens=6, num_completion_tokens=1) == b""
    for encoded, start in ((None, 4), (b64(ids), 3), (b64(ids[:-4]), 4), (b64(ids[:-1]), 4)):
        with pytest.raises(UpstreamRoutingMismatchError):
            turn_chunk(encoded, SHAPE, start=start, num_prompt_tokens=6, num_completion_tokens=2)
    for encoded in ("not base64!", b64([1, 2, 3, 9] * 3), b64([-1, 2, 3, 4] * 3)):
        with pytest.raises(UpstreamMalformedError, match="malformed routed_experts"):
            turn_chunk(encoded, SHAPE, start=4, num_prompt_tokens=6, num_completion_tokens=2)


def test_assembly_cuts_superseded_rows_and_refuses_chunks_that_do_not_fit() -> None:
    first = record(0, 3, 2, 0)  # tokens [0, 5): rows [0, 4)
    second = record(1, 7, 3, 3)  # its prompt trimmed 2 base tokens: rows [3, 9) supersede row 3
    assembled = assemble([first, second], [rows(1, 2, 3, 4), rows(5, 6, 7, 8, 9, 10)], SHAPE, 10)
    assert assembled.rows == rows(1, 2, 3, 5, 6, 7, 8, 9, 10)
    assert len(assembled.for_tokens(list(range(10)), list(range(10))).data) == 9 * 4
    assert assembled.for_tokens([99], list(range(10))).data == b""  # the ABORTED placeholder: no rows
    with pytest.raises(SampleAssemblyError, match="not a prefix"):
        assembled.for_tokens([0, 1, 5], list(range(10)))
    gap = record(1, 7, 3, 5)  # would leave row 4 unknown
    with pytest.raises(SampleAssemblyError, match="does not cover"):
        assemble([first, gap], [rows(1, 2, 3, 4), rows(5, 6, 7, 8)], SHAPE, 10)
    with pytest.raises(SampleAssemblyError, match="routing chunks"):
        assemble([first, second], [rows(1, 2, 3, 4)], SHAPE, 10)
    with pytest.raises(SampleAssemblyError, match="does not cover"):  # a chunk of the wrong length
        assemble([first], [rows(1, 2, 3)], SHAPE, 5)


def store_commit(version: int, num_kept: int, chunk: bytes) -> TurnCommit:
    ids = list(range(2 * (num_kept + 1)))
    turn = record(num_kept, len(ids) - 1, 1, 0)
    return TurnCommit(version, num_kept, [], ids, None, turn, [2] * (num_kept + 1), 60.0, routing=chunk)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.integration)])
def store(request: pytest.FixtureRequest) -> Any:
    if request.param == "memory":
        return MemoryStore(lock_wait_s=0.2)
    url = request.getfixturevalue("redis_url")
    return RedisStore(aioredis.Redis.from_url(url), key_prefix="t", lock_ttl_s=5.0, lock_wait_s=0.2)


async def test_stores_append_chunks_beside_records_and_trim_them_on_a_rollback(store: Any) -> None:
    meta = SessionMeta("s1", "hash", "job", "s1", ModelConfig("/m", "qwen3", "p", record_routing=True), {}, 60.0, 0)
    await store.create(meta)
    assert await store.commit("s1", store_commit(0, 0, rows(1, 2))) is CommitOutcome.COMMITTED
    assert await store.commit("s1", store_commit(1, 1, b"")) is CommitOutcome.COMMITTED  # no new row is a chunk too
    assert await store.commit("s1", store_commit(2, 2, rows(3))) is CommitOutcome.COMMITTED
    assert await store.commit("s1", store_commit(3, 2, rows(4))) is CommitOutcome.COMMITTED  # retry of turn 2
    assert await store.load_routing("s1") == [rows(1, 2), b"", rows(4)]
    assert len(await store.load_records("s1")) == 3
    assert await store.commit("s1", store_commit(4, 0, rows(5))) is CommitOutcome.COMMITTED  # back to nothing
    assert await store.load_routing("s1") == [rows(5)]
    assert await store.delete("s1")
    assert await store.load_routing("s1") == []
    await store.close()


# --- the turn flow in-process (memory store, scripted engine) -------------------------------------------------


async def put_job(client: httpx.AsyncClient, op: dict[str, str], model_dir: Any, **extra: Any) -> httpx.Response:
    body = {"model_path": str(model_dir), "model_family": "qwen3", **extra}
    return await client.put("/v1/jobs/job-1/config", json=body, headers=op)


async def session_of_job(client: httpx.AsyncClient, op: dict[str, str]) -> tuple[str, dict[str, str]]:
    created = (await client.post("/v1/sessions", json={"job_id": "job-1"}, headers=op)).json()
    return created["session_id"], {"authorization": f"Bearer {created['token']}"}


async def chat(client: httpx.AsyncClient, sid: str, auth: dict[str, str], messages: list[Any], **kw: Any) -> Any:
    return await client.post(f"/v1/sessions/{sid}/v1/chat/completions", json={"messages": messages, **kw}, headers=auth)


async def all_samples(client: httpx.AsyncClient, sid: str, auth: dict[str, str], **body: Any) -> list[Any]:
    headers = {**auth, "accept": "application/x-protobuf"}
    reply = await client.post(f"/v1/sessions/{sid}/samples", json=body, headers=headers)
    assert reply.status_code == 200, reply.text
    return list(session_pb2.SessionSamples.FromString(reply.content).samples)


async def test_record_routing_is_resolved_per_model_and_refused_for_a_dense_one(
    make_session_app: Any, scripted_engine: Any, operator_token: str, qwen3_model_dir: Any, qwen3_moe_model_dir: Any
) -> None:
    op = {"authorization": f"Bearer {operator_token}"}
    async with make_session_app(scripted_engine.url) as client:
        refused = await put_job(client, op, qwen3_model_dir, record_routing=True)
        assert refused.status_code == 400
        assert refused.json()["error"]["field"] == "record_routing" and "model_type 'qwen3'" in refused.text
        cases = [(qwen3_model_dir, None, False), (qwen3_model_dir, False, False)]
        cases += [(qwen3_moe_model_dir, None, True), (qwen3_moe_model_dir, False, False)]
        for model_dir, asked, resolved in cases:
            extra = {} if asked is None else {"record_routing": asked}
            assert (await put_job(client, op, model_dir, **extra)).json()["record_routing"] is resolved
            assert (await client.get("/v1/jobs/job-1/config", headers=op)).json()["record_routing"] is resolved
        sid, auth = await session_of_job(client, op)  # a MoE job registered with routing off
        first = await chat(client, sid, auth, [{"role": "user", "content": "a"}], return_routed_experts=True)
        assert first.status_code == 200 and "routed_experts" not in first.text
        (sample,) = await all_samples(client, sid, auth)
    assert "return_routed_experts" not in scripted_engine.requests[-1]["body"]  # the client's ask is ignored
    assert not sample.HasField("rollout_routed_experts")


async def test_rows_follow_the_token_buffer_through_turns_and_a_retry(
    make_session_app: Any, scripted_engine: Any, operator_token: str, qwen3_moe_model_dir: Any
) -> None:
    scripted_engine.script = ["One.", "Two, streamed.", "Three.", "Three again."]
    op = {"authorization": f"Bearer {operator_token}"}
    async with make_session_app(scripted_engine.url) as client:
        assert (await put_job(client, op, qwen3_moe_model_dir)).json()["record_routing"] is True
        sid, auth = await session_of_job(client, op)
        h1 = [{"role": "user", "content": "a"}]
        r1 = await chat(client, sid, auth, h1, return_routed_experts=True, routed_experts_start_len=0)
        h2 = [*h1, r1.json()["choices"][0]["message"], {"role": "user", "content": "b"}]
        r2 = await chat(client, sid, auth, h2, stream=True)
        h3 = [*h2, {"role": "assistant", "content": "Two, streamed."}, {"role": "user", "content": "c"}]
        r3 = await chat(client, sid, auth, h3)
        r3_retry = await chat(client, sid, auth, [*h3[:-1], {"role": "user", "content": "c, again"}])
        for reply in (r1, r2, r3, r3_retry):
            assert reply.status_code == 200 and "routed_experts" not in reply.text
        merged = await all_samples(client, sid, auth, mode="merge")
        per_turn = await all_samples(client, sid, auth, mode="per_turn")
        cut = await all_samples(client, sid, auth, mode="merge", max_seq_len=len(merged[0].tokens) - 1)
        metrics = (await client.get("/metrics")).text
    seqlens = [len(r["input_ids"]) + len(r["output_ids"]) for r in scripted_engine.responses]
    starts = [r["body"]["routed_experts_start_len"] for r in scripted_engine.requests]
    assert starts == [0, seqlens[0] - 1, seqlens[1] - 1, seqlens[1] - 1]  # the retry asks again from turn 1's rows
    for sample in [*merged, *per_turn, *cut]:
        assert sample_problem(sample) is None
        tokens = list(sample.tokens)
        assert list(unpack(sample.rollout_routed_experts)) == scripted_engine.routing_ids(tokens, 0, len(tokens) - 1)
    assert len(per_turn) == 3 and len(cut[0].tokens) == len(merged[0].tokens) - 1
    stored = sum(seqlen - 1 - start for seqlen, start in zip(seqlens, starts, strict=True)) * 8  # 4 layers x top-2
    assert f"miles_session_routing_stored_bytes_total {float(stored)}" in metrics


@pytest.mark.parametrize("fault", ["omitted", "one row more", "one row less"])
async def test_an_answer_without_the_rows_asked_for_is_a_counted_502_and_not_recorded(
    make_session_app: Any, scripted_engine: Any, operator_token: str, qwen3_moe_model_dir: Any, fault: str
) -> None:
    scripted_engine.omit_routing = fault == "omitted"
    scripted_engine.routing_rows_delta = {"omitted": 0, "one row more": 1, "one row less": -1}[fault]
    op = {"authorization": f"Bearer {operator_token}"}
    async with make_session_app(scripted_engine.url) as client:
        await put_job(client, op, qwen3_moe_model_dir)
        sid, auth = await session_of_job(client, op)
        reply = await chat(client, sid, auth, [{"role": "user", "content": "a"}])
        view = (await client.get(f"/v1/sessions/{sid}", headers=auth)).json()
        metrics = (await client.get("/metrics")).text
    assert reply.status_code == 502 and reply.json()["error"]["code"] == "upstream_routing_mismatch"
    assert view["num_turns"] == 0 and view["accumulated_token_ids"] == []
    assert "miles_session_routing_row_mismatches_total 1.0" in metrics
    assert 'miles_session_upstream_errors_total{kind="malformed"} 1.0' in metrics
    assert "miles_session_routing_stored_bytes_total 0.0" in metrics
