"""Conformance of a running miles-engine (the tiny model, a real subprocess) with SGLang's native protocol:
every item of the checklist in docs/sglang-protocol.md §9, by number."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

pytestmark = pytest.mark.integration

EOS_IDS = {151645, 151643}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, engine_factory: Any) -> Iterator[Any]:
    with engine_factory(tiny_model_dir, "--max-total-tokens", "200000") as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


_rng = random.Random(1234)


def fresh_prompt(n: int = 24) -> list[int]:
    """Random regular token ids, so tests never share cached prefixes by accident."""
    return [_rng.randrange(1000, 150000) for _ in range(n)]


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, **extra}


def sse_events(response: httpx.Response) -> list[Any]:
    events = []
    for block in response.text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ---- 1. /generate inputs ---------------------------------------------------------------------------------------
def test_1_generate_accepts_text_and_ids_single_and_batch_post_and_put(engine: Any, tokenizer: Tokenizer) -> None:
    by_text = engine.generate(text="Hello, how are you?", sampling_params=greedy(6))
    ids = tokenizer.encode("Hello, how are you?").ids
    by_ids = engine.client.put("/generate", json={"input_ids": ids, "sampling_params": greedy(6)}).json()
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["meta_info"]["prompt_tokens"] == len(ids)
    batch = engine.generate(input_ids=[ids, fresh_prompt()], sampling_params=greedy(3), rid="batch")
    assert isinstance(batch, list) and len(batch) == 2
    assert [b["meta_info"]["id"] for b in batch] == ["batch_0", "batch_1"]
    assert batch[0]["output_ids"] == by_ids["output_ids"][:3]
    texts = engine.generate(text=["a b c", "d e f"], sampling_params=[greedy(2), greedy(4)])
    assert [t["meta_info"]["completion_tokens"] for t in texts] == [2, 4]


def test_1_sampling_defaults_and_parameters(engine: Any) -> None:
    prompt = fresh_prompt()
    default = engine.generate(input_ids=prompt, sampling_params={"ignore_eos": True})
    assert default["meta_info"]["completion_tokens"] == 128
    assert default["meta_info"]["finish_reason"] == {"type": "length", "length": 128}
    seeded = [
        engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8, "sampling_seed": 7, "top_k": -1})
        for _ in range(2)
    ]
    assert seeded[0]["output_ids"] == seeded[1]["output_ids"]
    top1 = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8, "temperature": 1.0, "top_k": 1})
    assert top1["output_ids"] == engine.generate(input_ids=prompt, sampling_params=greedy(8))["output_ids"]
    for params in ({"top_p": 0.5}, {"min_p": 0.2}, {"top_k": 5, "top_p": 0.9, "temperature": 0.7}):
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4, **params})
        assert out["meta_info"]["completion_tokens"] == 4
    samples = engine.generate(
        input_ids=prompt, sampling_params={"max_new_tokens": 5, "n": 3}, return_routed_experts=True
    )
    assert len(samples) == 3 and all(s["meta_info"]["cached_tokens"] == len(prompt) - 1 for s in samples)


def test_1_logprob_options(engine: Any, tokenizer: Tokenizer) -> None:
    prompt = fresh_prompt(10)
    out = engine.generate(
        input_ids=prompt,
        sampling_params=greedy(4),
        return_logprob=True,
        logprob_start_len=3,
        top_logprobs_num=2,
        return_text_in_logprobs=True,
        token_ids_logprob=[5, 6],
    )
    meta = out["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt[3:]
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    outputs = meta["output_token_logprobs"]
    assert len(outputs) == meta["output_token_logprobs_length"] == meta["completion_tokens"] == 4
    assert all(len(e) == 3 and e[0] < 0 for e in outputs)
    assert [e[1] for e in outputs] == out["output_ids"]
    assert outputs[0][2] == tokenizer.decode([out["output_ids"][0]], skip_special_tokens=False)
    for entry, top in zip(outputs, meta["output_top_logprobs"], strict=True):
        assert len(top) == 2 and top[0][1] == entry[1] and top[0][0] == entry[0] >= top[1][0]
    assert all([e[1] for e in row] == [5, 6] for row in meta["output_token_ids_logprobs"])
    plain = engine.generate(input_ids=prompt, sampling_params=greedy(2), return_logprob=True)
    assert plain["meta_info"]["input_token_logprobs"] == []
    assert plain["meta_info"]["output_token_logprobs"][0][2] is None


# ---- 2. response shape, finish reasons, stop handling ----------------------------------------------------------
def test_2_response_shape(engine: Any) -> None:
    out = engine.generate(input_ids=fresh_prompt(), sampling_params=greedy(3), rid="shape-1")
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version"):
        assert key in meta
    assert meta["id"] == "shape-1" and isinstance(meta["e2e_latency"], float)
    assert meta["weight_version"] == "default"


def _first_new_token_index(ids: list[int], start: int) -> int:
    return next(k for k in range(start, len(ids)) if ids[k] not in ids[:k] and ids[k] not in EOS_IDS)


def test_2_stop_token_ids_are_in_output_ids_and_trimmed_from_text(engine: Any, tokenizer: Tokenizer) -> None:
    prompt = fresh_prompt()
    reference = engine.generate(input_ids=prompt, sampling_params=greedy(16, ignore_eos=True))["output_ids"]
    k = _first_new_token_index(reference, 3)
    stopped = engine.generate(input_ids=prompt, sampling_params=greedy(16, stop_token_ids=[reference[k]]))
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": reference[k]}
    assert stopped["output_ids"] == reference[: k + 1]
    assert stopped["meta_info"]["completion_tokens"] == k + 1
    assert stopped["text"] == tokenizer.decode(reference[:k])
    kept = engine.generate(
        input_ids=prompt, sampling_params=greedy(16, stop_token_ids=[reference[k]], no_stop_trim=True)
    )
    assert kept["text"] == tokenizer.decode(reference[: k + 1])
    ignored = engine.generate(
        input_ids=prompt, sampling_params=greedy(16, stop_token_ids=[reference[k]], ignore_eos=True)
    )
    assert ignored["output_ids"] == reference


def test_2_stop_strings_cut_the_text(engine: Any, tokenizer: Tokenizer) -> None:
    prompt = fresh_prompt()
    reference = engine.generate(input_ids=prompt, sampling_params=greedy(16, ignore_eos=True))["output_ids"]
    for k in range(2, 16):
        before, after = tokenizer.decode(reference[:k]), tokenizer.decode(reference[: k + 1])
        stop = after[len(before) :].strip()
        if after.startswith(before) and stop and stop not in before and after.find(stop) >= len(before):
            break
    else:
        pytest.fail("no usable stop string in the reference output")
    out = engine.generate(input_ids=prompt, sampling_params=greedy(16, stop=[stop, "never-matches"]))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == reference[: k + 1]
    assert out["text"] == after[: after.find(stop)]
    kept = engine.generate(input_ids=prompt, sampling_params=greedy(16, stop=stop, no_stop_trim=True))
    assert kept["text"] == after[: after.find(stop) + len(stop)]


# ---- 3. streaming ----------------------------------------------------------------------------------------------
def test_3_streaming_chunks_are_cumulative_and_end_with_done(engine: Any) -> None:
    prompt = fresh_prompt()
    whole = engine.generate(input_ids=prompt, sampling_params=greedy(6), return_logprob=True)
    response = engine.client.post(
        "/generate", json={"input_ids": prompt, "sampling_params": greedy(6), "stream": True, "return_logprob": True}
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(set(lengths)) and lengths[-1] == 6 and len(chunks) >= 3  # chunks whose text ends
    assert all(c["output_ids"] == whole["output_ids"][: len(c["output_ids"])] for c in chunks)  # mid-UTF-8 wait
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert "e2e_latency" in chunks[-1]["meta_info"] and "e2e_latency" not in chunks[0]["meta_info"]
    assert all(len(c["meta_info"]["output_token_logprobs"]) == len(c["output_ids"]) for c in chunks)
    batch = sse_events(
        engine.client.post(
            "/generate", json={"input_ids": [prompt, fresh_prompt()], "sampling_params": greedy(2), "stream": True}
        )
    )
    assert sorted(c["index"] for c in batch[:-1]) == [0, 0, 1, 1]


async def test_3_abort_arrives_as_the_final_stream_chunk(engine: Any) -> None:
    async with httpx.AsyncClient(base_url=engine.url, timeout=60) as client:
        body = {"input_ids": fresh_prompt(), "sampling_params": greedy(3000, ignore_eos=True), "stream": True}
        body["rid"] = "stream-abort"
        async with client.stream("POST", "/generate", json=body) as response:
            lines = response.aiter_lines()
            first = await anext(lines)
            assert first.startswith("data: ")
            await client.post("/abort_request", json={"rid": "stream-abort"})
            rest = [line async for line in lines if line]
    final = json.loads(rest[-2][len("data: ") :])
    assert rest[-1] == "data: [DONE]"
    assert final["meta_info"]["finish_reason"]["type"] == "abort"


# ---- 4. control endpoints --------------------------------------------------------------------------------------
def test_4_info_endpoints(engine: Any, tiny_model_dir: Path) -> None:
    assert engine.client.get("/health").status_code == 200
    assert engine.client.get("/health_generate").status_code == 200
    for path in ("/model_info", "/get_model_info"):
        info = engine.client.get(path).json()
        assert info["weight_version"] == "default" and info["is_generation"] is True
        assert info["model_path"] == str(tiny_model_dir) and info["architectures"] == ["Qwen3ForCausalLM"]
    for path in ("/server_info", "/get_server_info"):
        server = engine.client.get(path).json()
        assert server["dp_size"] == 1 and server["model_path"] == str(tiny_model_dir)
        assert server["served_model_name"] == str(tiny_model_dir) and server["version"].startswith("0.5.23")
    assert engine.client.get("/get_weight_version").json() == {"weight_version": "default"}
    models = engine.client.get("/v1/models").json()
    assert models["data"][0]["id"] == str(tiny_model_dir)
    loads = engine.client.get("/v1/loads").json()["loads"][0]
    assert {"num_running_reqs", "num_waiting_reqs", "num_used_tokens", "token_usage"} <= set(loads)
    assert engine.client.post("/release_memory_occupation", json={}).json() is None
    assert engine.client.post("/resume_memory_occupation", json={}).json() is None


async def test_4_flush_cache_only_when_idle_and_abort_by_prefix_or_all(engine: Any) -> None:
    async with httpx.AsyncClient(base_url=engine.url, timeout=60) as client:
        long = {"sampling_params": greedy(3000, ignore_eos=True)}
        tasks = [
            asyncio.create_task(client.post("/generate", json={**long, "input_ids": fresh_prompt(), "rid": rid}))
            for rid in ("job-a-1", "job-a-2", "job-b-1")
        ]
        await asyncio.sleep(1.0)
        assert (await client.post("/flush_cache")).status_code == 400
        await client.post("/abort_request", json={"rid": "job-a"})
        aborted = await asyncio.gather(tasks[0], tasks[1])
        assert [r.json()["meta_info"]["finish_reason"]["type"] for r in aborted] == ["abort", "abort"]
        assert not tasks[2].done()
        await client.post("/abort_request", json={"abort_all": True})
        last = (await tasks[2]).json()
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert last["meta_info"]["completion_tokens"] == len(last["output_ids"]) > 0
        response = await client.get("/flush_cache")
        assert response.status_code == 200 and response.text.startswith("Cache flushed.")


async def wait_until_running(client: httpx.AsyncClient, timeout_s: float = 30.0) -> None:
    """Until the engine reports a request in its running batch (admitted and prefilled or decoding)."""
    deadline = time.monotonic() + timeout_s
    while (await client.get("/v1/loads")).json()["loads"][0]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "the request never started running"
        await asyncio.sleep(0.01)


# Long enough that the request is still decoding when the pause lands (~2 HTTP round trips after it was seen
# running): ~1 s of decoding on the tiny model, against milliseconds.
PAUSED_REQUEST_TOKENS = 200


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_4_pause_and_continue_in_each_mode(engine: Any, mode: str) -> None:
    prompt = fresh_prompt()
    params = greedy(PAUSED_REQUEST_TOKENS, ignore_eos=True)
    reference = engine.generate(input_ids=prompt, sampling_params=params)
    async with httpx.AsyncClient(base_url=engine.url, timeout=120) as client:
        in_flight = asyncio.create_task(client.post("/generate", json={"input_ids": prompt, "sampling_params": params}))
        await wait_until_running(client)
        paused = await client.post("/pause_generation", json={"mode": mode})
        try:
            assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
            held = asyncio.create_task(
                client.post("/generate", json={"input_ids": fresh_prompt(), "sampling_params": greedy(2)})
            )
            assert (await client.get("/health_generate")).status_code == 503
            assert (await client.get("/health")).status_code == 200
            await asyncio.sleep(0.3)
            assert not held.done()
        finally:
            resumed = await client.post("/continue_generation", json={})
        assert resumed.json() == {"message": "Generation continued successfully.", "status": "ok"}
        result = (await in_flight).json()
        assert (await held).json()["meta_info"]["completion_tokens"] == 2
    if mode == "abort":
        assert result["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(result["output_ids"]) < PAUSED_REQUEST_TOKENS
        assert result["output_ids"] == reference["output_ids"][: len(result["output_ids"])]
    else:
        assert result["output_ids"] == reference["output_ids"]


def test_4_update_weight_version_relabels(engine: Any) -> None:
    reply = engine.post("/update_weight_version", {"new_version": "relabelled"}).json()
    assert reply == {"success": True, "message": "Weight version updated to relabelled", "new_version": "relabelled"}
    try:
        out = engine.generate(input_ids=fresh_prompt(), sampling_params=greedy(2))
        assert out["meta_info"]["weight_version"] == "relabelled"
        assert engine.client.get("/model_info").json()["weight_version"] == "relabelled"
    finally:
        engine.post("/update_weight_version", {"new_version": "default"})


# ---- 5. prefix cache -------------------------------------------------------------------------------------------
def test_5_exact_cached_tokens_over_multi_turn_prefixes(engine: Any) -> None:
    prompt = fresh_prompt(40)
    first = engine.generate(input_ids=prompt, sampling_params=greedy(12, ignore_eos=True))
    assert first["meta_info"]["cached_tokens"] == 0
    turn = prompt + first["output_ids"]
    for round_index in range(3):
        turn = turn + fresh_prompt(7)
        reply = engine.generate(input_ids=turn, sampling_params=greedy(9, ignore_eos=True))
        assert reply["meta_info"]["cached_tokens"] == len(turn) - 7 - 1, round_index
        assert reply["meta_info"]["prompt_tokens"] == len(turn)
        turn = turn + reply["output_ids"]
    capped = engine.generate(input_ids=turn, sampling_params=greedy(1), return_logprob=True, logprob_start_len=20)
    assert capped["meta_info"]["cached_tokens"] == 20
    assert engine.generate(input_ids=turn, sampling_params=greedy(1))["meta_info"]["cached_tokens"] == len(turn) - 1


# ---- 6. metrics ------------------------------------------------------------------------------------------------
def test_6_metrics_use_sglang_names(engine: Any, tiny_model_dir: Path) -> None:
    engine.generate(input_ids=fresh_prompt(), sampling_params=greedy(2))
    text = engine.client.get("/metrics").text
    label = f'model_name="{tiny_model_dir}"'
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:num_used_tokens",
        "sglang:cache_hit_rate",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:num_requests_total",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:inter_token_latency_seconds_bucket",
        "sglang:e2e_request_latency_seconds_bucket",
    ):
        assert any(line.startswith(name + "{") and label in line for line in text.splitlines()), name
    assert "sglang:cached_tokens_total{" in text and "miles_engine_forward_duration_seconds" in text


# ---- 7. errors -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": [1, 2, 999999]}, "outside the vocabulary"),
        ({"input_ids": []}, "input_ids cannot be empty"),
        ({"text": ""}, "input_ids cannot be empty"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be at least 0"),
        ({"input_ids": [5] * 40000}, "longer than the model's context length"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"json_schema": "{}"}}, "not supported"),
        ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len"),
        ({"sampling_params": {}}, "Either text, input_ids"),
    ],
)
def test_7_bad_input_is_400_with_sglang_error_shape_and_engine_keeps_serving(
    engine: Any, body: dict[str, Any], message: str
) -> None:
    response = engine.post("/generate", body)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]
    assert engine.generate(input_ids=fresh_prompt(), sampling_params=greedy(1))["meta_info"]["completion_tokens"] == 1


def test_7_schema_errors_are_openai_style_400(engine: Any) -> None:
    response = engine.post("/generate", {"input_ids": "not a list"})
    assert response.status_code == 400
    body = response.json()
    assert body["object"] == "error" and body["code"] == 400 and body["type"] == "Bad Request"
    assert engine.client.post("/generate", content=b"{not json").status_code == 400
    duplicate = engine.post("/generate", {"input_ids": [[1, 2], [3, 4]], "rid": ["same", "same"]})
    assert duplicate.status_code == 400 and "Duplicate request ID" in duplicate.json()["error"]["message"]
