"""True on-policy training against the real CPU engine: `miles-engine --deterministic` samples rollouts from the
tiny model, a real `miles-trainer` (torch backend, deterministic, strict_on_policy, sync mode) trains on them,
publishes each new version to the engine with /update_weights_from_disk, and the next rollouts come from the
published weights. Every step reports train_rollout_logprob_abs_diff max == 0 (a nonzero max would fail the
step in strict mode)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from miles.buffer.client import BufferClient
from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.smoke import console_script
from miles.proto.common.v1 import common_pb2
from miles.proto.trainer.v1 import trainer_pb2, trainer_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _rollout_group(client: httpx.Client, group_id: str, rng: random.Random, version: int) -> common_pb2.Group:
    group = common_pb2.Group(group_id=group_id)
    prompt = [rng.randrange(1000, 150000) for _ in range(rng.randrange(4, 8))]
    for index in range(2):
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": rng.randrange(10**6)},
            "return_logprob": True,
        }
        reply = client.post("/generate", json=body).json()
        assert reply["meta_info"]["weight_version"] == str(version)
        output_ids = reply["output_ids"]
        logprobs = [entry[0] for entry in reply["meta_info"]["output_token_logprobs"]]
        sample = group.samples.add(
            sample_id=f"{group_id}/{index}",
            group_id=group_id,
            tokens=prompt + output_ids,
            response_start=len(prompt),
            loss_mask=[1] * len(output_ids),
            rollout_logprobs=logprobs,
            reward=float(index),
            status=common_pb2.SAMPLE_STATUS_COMPLETED,
        )
        sample.weight_versions.add(start=0, end=len(output_ids), weight_version=version)
    return group


def _wait_for_engine_version(engine: httpx.Client, version: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.get("/get_weight_version").json()["weight_version"] != version:
        assert time.monotonic() < deadline, f"the engine never received version {version}"
        time.sleep(0.2)


async def _push(target: str, job_id: str, groups: list[common_pb2.Group]) -> None:
    async with BufferClient(target) as buffer:
        await buffer.configure_job(job_id)
        for group in groups:
            await buffer.push_group(job_id, group)


async def test_recomputed_logprobs_equal_the_deterministic_engines_exactly_across_weight_updates(
    tiny_model_dir: Path,
    buffer_process: Any,
    tmp_path: Path,
    job_id: str,
    make_trainer_env: Any,
    start_trainer: Any,
) -> None:
    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    argv = [
        console_script("miles-engine"),
        "--model-path",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--deterministic",
        "--weight-version",
        "0",
    ]
    rng = random.Random(11)
    with (
        ServiceProcess(argv, ready_url=f"{engine_url}/readyz", log_path=tmp_path / "engine.log"),
        httpx.Client(base_url=engine_url, timeout=300) as engine,
    ):
        await _push(buffer_process.target, job_id, [_rollout_group(engine, f"v0-{i}", rng, 0) for i in range(2)])
        env = make_trainer_env(
            job_id=job_id,
            buffer=buffer_process,
            model_dir=tiny_model_dir,
            checkpoint_dir=tmp_path / "ckpt",
            batch_size_groups=2,
            num_steps=2,
            mode="sync",
            deterministic="true",
            strict_on_policy="true",
            pull_wait_s=0.5,
        )
        env["MILES_TRAINER_TRAIN__OPTIMIZER__LR"] = "1e-3"
        env["MILES_TRAINER_PUBLISH__ENGINE_URLS"] = json.dumps([engine_url])
        trainer = start_trainer(env).start()
        trainer.wait_for(lambda s: s.step == 1)
        _wait_for_engine_version(engine, "1")
        await _push(buffer_process.target, job_id, [_rollout_group(engine, f"v1-{i}", rng, 1) for i in range(2)])
        final = trainer.wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED)
        _wait_for_engine_version(engine, "2")

    assert (final.step, final.weight_version) == (2, 2)
    with grpc.insecure_channel(f"127.0.0.1:{trainer.port}") as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)  # type: ignore[no-untyped-call]
        steps = []
        for event in stub.WatchEvents(trainer_pb2.WatchEventsRequest(), timeout=30):
            if event.kind == "step":
                steps.append(dict(event.metrics))
            if len(steps) == 2:
                break
    for metrics in steps:
        assert metrics["num_loss_tokens"] > 0
        assert metrics["train_rollout_logprob_abs_diff_max"] == 0.0
        assert metrics["train_rollout_logprob_abs_diff"] == 0.0
        assert metrics["is_ratio_min"] == metrics["is_ratio_max"] == 1.0
    print("on-policy steps:", [{k: m[k] for k in ("loss", "train_rollout_logprob_abs_diff_max")} for m in steps])
