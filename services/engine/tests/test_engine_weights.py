"""Weight updates by version on a running engine with the tiny model: from disk (a checkpoint directory) and from
tensors (safetensors bytes in JSON), full and partial. The reported weight_version changes, outputs change with
the weights, requests in flight finish on the weights they started with, bad updates change nothing."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save

pytestmark = pytest.mark.integration

PROMPT = [9707, 11, 1246, 525, 498, 30, 2585, 374]
OTHER = [3838, 374, 279, 6722, 315, 9625, 30]


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.engine.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3-seed1", seed=1)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, engine_factory: Any) -> Iterator[Any]:
    with engine_factory(tiny_model_dir) as running:
        yield running


def greedy(engine: Any, prompt: list[int], max_new_tokens: int = 12) -> Any:
    return engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0})


def b64_safetensors(tensors: dict[str, torch.Tensor]) -> str:
    return base64.b64encode(save(tensors)).decode()


async def test_disk_update_waits_for_in_flight_requests_and_changes_outputs(
    engine: Any, tiny_model_dir: Path, second_model_dir: Path
) -> None:
    before = greedy(engine, PROMPT)
    long_reference = greedy(engine, OTHER, 150)
    engine.client.get("/flush_cache")
    async with httpx.AsyncClient(base_url=engine.url, timeout=300) as client:
        body = {"input_ids": OTHER, "sampling_params": {"max_new_tokens": 150, "temperature": 0}}
        in_flight = asyncio.create_task(client.post("/generate", json=body))
        await asyncio.sleep(0.5)
        update = await client.post(
            "/update_weights_from_disk", json={"model_path": str(second_model_dir), "weight_version": "1"}
        )
        assert in_flight.done(), "the update must wait for requests in flight"
        old = (await in_flight).json()
    assert update.status_code == 200
    assert update.json() == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to 1.",
        "num_paused_requests": 0,
    }
    assert old["meta_info"]["weight_version"] == "default"
    assert old["output_ids"] == long_reference["output_ids"], "an in-flight request saw the new weights"
    after = greedy(engine, PROMPT)
    assert after["meta_info"]["weight_version"] == "1"
    assert after["output_ids"] != before["output_ids"]
    assert after["meta_info"]["cached_tokens"] == 0, "the update flushed the prefix cache"
    info = engine.client.get("/model_info").json()
    assert info["weight_version"] == "1" and info["model_path"] == str(second_model_dir)

    original = (tiny_model_dir / "model.safetensors").read_bytes()
    reply = engine.post(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [base64.b64encode(original).decode()], "weight_version": "2"},
    )
    assert reply.status_code == 200 and reply.json()["success"] is True
    restored = greedy(engine, PROMPT)
    assert restored["meta_info"]["weight_version"] == "2"
    assert restored["output_ids"] == before["output_ids"], "the original weights give the original outputs"


def test_partial_tensor_update_in_chunks(engine: Any) -> None:
    engine.post("/update_weight_version", {"new_version": "base"})
    base = greedy(engine, PROMPT)
    norm = torch.full((64,), 3.0)
    layer_norm = torch.full((64,), 0.5)
    chunks = [
        b64_safetensors({"model.norm.weight": norm}),
        b64_safetensors({"model.layers.0.input_layernorm.weight": layer_norm}),
    ]
    reply = engine.post("/update_weights_from_tensor", {"serialized_named_tensors": chunks, "weight_version": "3"})
    assert reply.json() == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to 3.",
    }
    changed = greedy(engine, PROMPT)
    assert changed["meta_info"]["weight_version"] == "3"
    assert changed["output_ids"] != base["output_ids"]


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!!"]}, "base64"),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [base64.b64encode(b"junk").decode()]},
            "safetensors",
        ),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["UNKNOWN"]}, "unknown tensor name"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["SHAPE"]}, "shape"),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": ["UNKNOWN"], "load_format": "pickle"},
            "load_format",
        ),
        ("/update_weights_from_disk", {"model_path": "/nonexistent/dir"}, "not a directory"),
    ],
)
def test_bad_updates_are_refused_and_change_nothing(engine: Any, path: str, body: dict[str, Any], message: str) -> None:
    payloads = {
        "UNKNOWN": b64_safetensors({"model.layers.99.nope": torch.zeros(2)}),
        "SHAPE": b64_safetensors({"model.norm.weight": torch.zeros(3)}),
    }
    body = {**body, "weight_version": "never"}
    if "serialized_named_tensors" in body:
        body["serialized_named_tensors"] = [payloads.get(x, x) for x in body["serialized_named_tensors"]]
    version = engine.client.get("/model_info").json()["weight_version"]
    before = greedy(engine, PROMPT)
    reply = engine.post(path, body)
    assert reply.status_code == 400
    assert reply.json()["success"] is False and message in reply.json()["message"]
    after = greedy(engine, PROMPT)
    assert after["meta_info"]["weight_version"] == version != "never"
    assert after["output_ids"] == before["output_ids"]


async def test_update_under_pause_applies_at_once_and_abort_all_aborts(engine: Any, tiny_model_dir: Path) -> None:
    async with httpx.AsyncClient(base_url=engine.url, timeout=300) as client:
        body = {"input_ids": OTHER, "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}}
        resident = asyncio.create_task(client.post("/generate", json=body))
        await asyncio.sleep(0.5)
        await client.post("/pause_generation", json={"mode": "in_place"})
        try:
            update = await client.post(
                "/update_weights_from_disk",
                json={"model_path": str(tiny_model_dir), "weight_version": "paused-update", "flush_cache": False},
            )
            assert update.json()["num_paused_requests"] == 1
            assert not resident.done()
        finally:
            await client.post("/continue_generation", json={})
        await asyncio.sleep(0.3)
        aborting = await client.post(
            "/update_weights_from_disk",
            json={"model_path": str(tiny_model_dir), "weight_version": "after-abort", "abort_all_requests": True},
        )
        assert aborting.json()["success"] is True
        result = (await resident).json()
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert result["meta_info"]["weight_version"] == "paused-update"
    assert greedy(engine, PROMPT, 2)["meta_info"]["weight_version"] == "after-abort"


def test_min_weight_version_is_a_retryable_409_until_the_engine_serves_it(engine: Any) -> None:
    """docs/architecture.md §4.4: an engine that is behind answers 409 (body field or header), never stale tokens."""
    engine.post("/update_weight_version", {"new_version": "4"})
    request = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    behind = httpx.post(f"{engine.url}/generate", json={**request, "min_weight_version": 5}, timeout=60)
    behind_by_header = httpx.post(
        f"{engine.url}/generate", json=request, headers={"X-Miles-Min-Weight-Version": "5"}, timeout=60
    )
    served = httpx.post(f"{engine.url}/generate", json={**request, "min_weight_version": 4}, timeout=60)
    assert behind.status_code == 409
    assert behind.headers["retry-after"] == "1"
    assert "weight version 4" in behind.json()["error"]["message"]
    assert behind_by_header.status_code == 409
    assert served.status_code == 200
    assert served.json()["meta_info"]["weight_version"] == "4"
    engine.post("/update_weight_version", {"new_version": "5"})
    assert (
        httpx.post(f"{engine.url}/generate", json={**request, "min_weight_version": 5}, timeout=60).status_code == 200
    )


def test_staged_update_is_held_until_applied_and_a_stale_stage_is_refused(engine: Any) -> None:
    """/stage_weights_from_tensor decodes and validates while the engine serves the old weights; only
    /apply_staged_weights swaps them in (with the version); a bad batch or an unknown stage changes nothing."""
    engine.post("/update_weight_version", {"new_version": "s0"})
    before = greedy(engine, OTHER)
    chunks = [b64_safetensors({"model.norm.weight": torch.full((64,), 2.5)})]
    chunks.append(b64_safetensors({"model.layers.1.input_layernorm.weight": torch.full((64,), 0.25)}))
    for chunk in chunks:
        staged = engine.post("/stage_weights_from_tensor", {"serialized_named_tensors": [chunk], "stage_id": "v7-a"})
        assert staged.json()["success"] is True, staged.text
    held = greedy(engine, OTHER)
    assert held["output_ids"] == before["output_ids"] and held["meta_info"]["weight_version"] == "s0"
    unknown = b64_safetensors({"model.layers.99.nope": torch.zeros(2)})
    bad = engine.post("/stage_weights_from_tensor", {"serialized_named_tensors": [unknown], "stage_id": "v7-a"})
    assert bad.status_code == 400 and bad.json()["success"] is False
    stale = engine.post("/apply_staged_weights", {"stage_id": "v6-old", "weight_version": "6"})
    assert stale.status_code == 400 and "nothing is staged" in stale.json()["message"]
    assert greedy(engine, OTHER)["meta_info"]["weight_version"] == "s0"
    applied = engine.post("/apply_staged_weights", {"stage_id": "v7-a", "weight_version": "7"})
    assert applied.json() == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to 7.",
    }
    after = greedy(engine, OTHER)
    assert after["meta_info"]["weight_version"] == "7" and after["output_ids"] != before["output_ids"]
    again = engine.post("/apply_staged_weights", {"stage_id": "v7-a", "weight_version": "7"})
    assert again.status_code == 400  # a stage is applied once
