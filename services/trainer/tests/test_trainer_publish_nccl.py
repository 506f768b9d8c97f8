"""The trainer's `nccl` publisher against two real CPU engines over gloo: SGLang's /init_weights_update_group and
/update_weights_from_distributed, driven by the same code the trainer runs on Kubernetes (make_publisher ->
NcclPublisher -> weight-sync's engine lifecycle and nccl transport).

The trainer side is a real miles.model policy taking AdamW steps in float32 and publishing float32 (the CPU
engine's dtype), so after every version each engine must hold exactly the trainer's weights: its
/weights_checker digest equals the trainer's, and its greedy tokens and logprobs for the same fixed prompts (so a
stale prefix cache would show) equal what miles.model computes in this process in deterministic mode, bit for
bit. A restart of the publisher (a restarted trainer) republishes its checkpoint's version through new update
groups, and the ledger records every version once.
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
import torch

from miles.common.testing import ServiceProcess, free_port, wait_for_http_ready
from miles.common.testing.smoke import console_script
from miles.model import CausalLM, block_logprobs, load_model, sequence_logprobs
from miles.trainer.publish import digest_of, make_publisher
from miles.trainer.publish_ledger import PublishLedger
from miles.trainer.settings import PublishSettings, TrainerSettings

pytestmark = [pytest.mark.integration]
NUM_TOKENS = 4


def start_engine(model_dir: Path, log_dir: Path) -> tuple[ServiceProcess, str]:
    port = free_port()
    argv = [console_script("miles-engine"), "--model-path", str(model_dir), "--port", str(port), "--deterministic"]
    process = ServiceProcess(argv, ready_url=None, log_path=log_dir / f"engine-{port}.log").start()
    return process, f"http://127.0.0.1:{port}"


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, 150000) for _ in range(length)] for length in (7, 12)]


@torch.inference_mode()
def reference_greedy(model: CausalLM, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    for _ in range(NUM_TOKENS):
        hidden = model(torch.tensor(ids), deterministic=True)
        row = block_logprobs(model, hidden[-1:], torch.ones(1), deterministic=True)[0]
        ids.append(int(row.argmax()))
        logprobs.append(float(row[ids[-1]]))
    return ids[len(prompt) :], logprobs


def served_greedy(url: str, prompt: list[int]) -> tuple[list[int], list[float], str]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": NUM_TOKENS, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
    }
    answer = httpx.post(f"{url}/generate", json=body, timeout=120).json()
    meta = answer["meta_info"]
    return answer["output_ids"], [entry[0] for entry in meta["output_token_logprobs"]], meta["weight_version"]


def check_engines(urls: list[str], policy: CausalLM, version: int) -> None:
    tensors = {name: p.detach() for name, p in policy.named_parameters()}
    expected = [reference_greedy(policy, prompt) for prompt in prompts()]
    for url in urls:
        payload = httpx.post(f"{url}/weights_checker", json={"action": "checksum"}, timeout=60).json()["payload"]
        assert (payload["weight_version"], payload["digest"]) == (str(version), digest_of(tensors)), url
        for prompt, (ids, logprobs) in zip(prompts(), expected, strict=True):
            assert served_greedy(url, prompt) == (ids, logprobs, str(version)), url


def settings(tmp_path: Path, model_dir: Path, urls: list[str]) -> TrainerSettings:
    publish = PublishSettings(
        kind="nccl",
        dtype="float32",
        engine_urls=urls,
        pause_mode="retract",
        nccl_master_address="127.0.0.1",
        nccl_master_port=0,
        nccl_backend="gloo",
        engine_timeout_s=120,
    )
    return TrainerSettings(job_id="job-nccl", model_path=model_dir, checkpoint_dir=tmp_path / "ckpt", publish=publish)


async def test_nccl_publisher_makes_two_cpu_engines_serve_exactly_the_trainers_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    engines = [start_engine(tiny_model_dir, tmp_path) for _ in range(2)]
    urls = [url for _, url in engines]
    policy = load_model(tiny_model_dir)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    try:
        for process, url in engines:
            wait_for_http_ready(f"{url}/readyz", 180.0, process.process)
        publisher = make_publisher(settings(tmp_path, tiny_model_dir, urls))
        record = await publisher.resume(0, dict(policy.named_parameters()), step=0)
        assert record.version == 0
        check_engines(urls, policy, 0)
        for version in (1, 2, 3):
            ids = torch.randint(0, policy.config.vocab_size, (16,), generator=generator)
            loss = -sequence_logprobs(policy, ids, start=1).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            await publisher.publish(version, dict(policy.named_parameters()), step=version, step_finished_unix_ms=1)
            check_engines(urls, policy, version)
        assert publisher.take_failures() == 0
        await publisher.close()

        # A restarted trainer at its checkpoint of version 3: same version, new update groups, same weights.
        restarted = make_publisher(settings(tmp_path, tiny_model_dir, urls))
        record = await restarted.resume(3, dict(policy.named_parameters()), step=3)
        assert record.version == 3 and record.restored_from_version is None
        check_engines(urls, policy, 3)
        await restarted.close()
    finally:
        for process, _ in engines:
            process.stop()
    versions: dict[int, set[str]] = {}
    for entry in PublishLedger(tmp_path / "ckpt").records():
        versions.setdefault(entry.version, set()).add(entry.weights_digest)
    assert sorted(versions) == [0, 1, 2, 3] and all(len(found) == 1 for found in versions.values())
