"""Acceptance (seam): two LoRA jobs share one engine pool; each turn is served with its own job's adapter at its own
version, and neither job's versions reach the other's samples.

Real processes: two `miles-engine`s (tiny Qwen3 model, `--enable-lora`, deterministic) behind the rollout router
(one pool), the session server on Redis. Each job's trainer side is the real `publish.kind: adapter` publisher
(miles.trainer.publish_adapters.AdapterPublisher, built from TrainerSettings as the controller writes them),
publishing PEFT adapter versions made by peft itself. Job A publishes versions 0..2, job B versions 0..1, with
turns of both jobs between the publishes. Checked:
- each turn records exactly the version its job had live (A's samples never carry B's numbers and vice versa);
- the logprobs each turn got through the session server equal the engine's own answer for the same tokens with
  the adapter that version names, and differ from the other job's adapter and from the base model: the request
  was served by its own job's adapter at that version;
- on every engine only the job's newest `adapters_loaded` versions stay loaded, and the other job's are untouched;
  a job's publisher closing (its trainer ends) unloads its versions and only its own;
- an engine that lost the live version gets it back from the publisher's reconcile.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from miles.trainer.publish_adapters import AdapterPublisher
from miles.trainer.publish_ledger import PublishLedger
from miles.trainer.settings import TrainerSettings

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

TARGETS = ["q_proj", "v_proj"]
LORA = {"rank": 4, "alpha": 8, "target_modules": TARGETS, "dropout": 0.0}
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def stack_options(make_stack_options: Any) -> Any:
    return make_stack_options(
        engine="tiny", num_engines=2, sandbox=False, deterministic=True, engine_args=("--enable-lora",)
    )


def adapter_tensors(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """A version's tensors as the trainer publishes them (PEFT names), random and non-zero, made by peft."""
    import peft
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(init_lora_weights=False, r=4, lora_alpha=8, target_modules=TARGETS)
    state = peft.get_peft_model_state_dict(peft.get_peft_model(base, config))
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def publisher(stack: Any, job_id: str, root: Path) -> AdapterPublisher:
    settings = TrainerSettings.model_validate(
        {
            "job_id": job_id,
            "model_path": str(stack.model_dir),
            "checkpoint_dir": str(root / job_id),
            "train": {"lora": LORA},
            "publish": {
                "kind": "adapter",
                "dtype": "float32",
                "router_url": stack.router_url,
                "pool": "default",
                "session_url": stack.session_url,
                # The scenario reconciles by hand; a background round would race its unload-then-check.
                "adapter_reconcile_interval_s": 3600,
            },
            "session_operator_token": stack.operator_token,
        }
    )
    return AdapterPublisher(settings, PublishLedger(root / job_id))


def register_lora_job(stack: Any, job_id: str) -> None:
    body = {
        "model_path": str(stack.model_dir),
        "model_family": "qwen3",
        "engine_pool": "default",
        "chat_template_kwargs": {"enable_thinking": False},
        "sampling_defaults": GREEDY,
        "lora_adapter": True,
    }
    headers = {"authorization": f"Bearer {stack.operator_token}"}
    response = httpx.put(f"{stack.session_url}/v1/jobs/{job_id}/config", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text


async def one_turn(client: httpx.AsyncClient, operator: dict[str, str], job_id: str, text: str) -> dict[str, Any]:
    """A one-turn session of the job; its per-turn sample."""
    created = await client.post("/v1/sessions", json={"job_id": job_id}, headers=operator)
    assert created.status_code == 201, created.text
    sid, auth = created.json()["session_id"], {"authorization": f"Bearer {created.json()['token']}"}
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 6, "temperature": 0.0}
    reply = await client.post(f"/v1/sessions/{sid}/v1/chat/completions", json=body, headers=auth)
    assert reply.status_code == 200, reply.text
    samples = await client.post(f"/v1/sessions/{sid}/samples", json={"mode": "per_turn"}, headers=auth)
    assert samples.status_code == 200, samples.text
    (sample,) = samples.json()["samples"]
    return dict(sample)


def engine_logprobs(engine_url: str, sample: dict[str, Any], lora_path: str | None) -> list[float]:
    """The engine's own logprobs of the sample's response tokens (teacher-forced) under `lora_path`."""
    tokens, start = sample["tokens"], int(sample.get("response_start", 0))
    body = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": start - 1,
        "lora_path": lora_path,
    }
    response = httpx.post(f"{engine_url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    entries = response.json()["meta_info"]["input_token_logprobs"]
    assert [entry[1] for entry in entries[1:]] == tokens[start:], (body, response.json()["meta_info"])
    return as_float32([entry[0] for entry in entries[1:]])


def as_float32(values: list[float]) -> list[float]:
    """Samples carry float32 logprobs (common.proto); the engine's JSON carries their float64 value."""
    return [float(v) for v in torch.tensor(values, dtype=torch.float32)]


def loaded_adapters(engine_url: str) -> set[str]:
    info = httpx.get(f"{engine_url}/server_info", timeout=30).json()
    return set(info["loaded_lora_adapters"])


def check_turn(stack: Any, job_id: str, live: dict[str, int], sample: dict[str, Any]) -> None:
    """The turn recorded its job's live version and was served by exactly that adapter (checked while it is
    still loaded: versions before the previous one are retired at the next publish)."""
    spans = {int(span.get("weight_version", 0)) for span in sample["weight_versions"]}
    assert spans == {live[job_id]}, (job_id, live, sample["weight_versions"])
    other = next(job for job in live if job != job_id)
    served = as_float32(sample["rollout_logprobs"])
    assert served and set(sample["loss_mask"]) == {1}, sample  # one turn: every response token was sampled
    for engine_url in stack.engine_urls:
        assert engine_logprobs(engine_url, sample, f"{job_id}@{live[job_id]}") == served, (job_id, live, engine_url)
        assert engine_logprobs(engine_url, sample, None) != served, "the base model gives other numbers"
        assert engine_logprobs(engine_url, sample, f"{other}@{live[other]}") != served, "so does the other job"


def test_two_lora_jobs_on_one_pool_are_each_served_their_own_adapter_version(stack: Any, tmp_path: Path) -> None:
    num_versions = {"lora-a": 3, "lora-b": 2}
    for job_id in num_versions:
        register_lora_job(stack, job_id)
    tensors = {
        job_id: [adapter_tensors(stack.model_dir, seed=100 * index + v) for v in range(count)]
        for index, (job_id, count) in enumerate(num_versions.items())
    }
    operator = {"authorization": f"Bearer {stack.operator_token}"}
    live: dict[str, int] = {}
    num_turns = 0

    async def scenario() -> None:
        nonlocal num_turns
        publishers = {job_id: publisher(stack, job_id, tmp_path) for job_id in num_versions}
        try:
            async with httpx.AsyncClient(base_url=stack.session_url, timeout=300) as client:
                for version in range(max(num_versions.values())):
                    for job_id, pub in publishers.items():
                        if version >= num_versions[job_id]:
                            continue
                        if version == 0:
                            await pub.resume(0, tensors[job_id][0], step=0)
                        else:
                            await pub.publish(version, tensors[job_id][version], step=version, step_finished_unix_ms=0)
                        live[job_id] = version
                    for job_id in publishers:
                        sample = await one_turn(client, operator, job_id, f"Count to {version + 3} for {job_id}.")
                        check_turn(stack, job_id, live, sample)
                        num_turns += 1
                # An engine that lost the live version (as a restarted one has) gets it back at the next reconcile.
                unload = {"lora_name": "lora-a@2"}
                response = await client.post(f"{stack.engine_urls[0]}/unload_lora_adapter", json=unload)
                assert response.status_code == 200, response.text
                assert "lora-a@2" not in loaded_adapters(stack.engine_urls[0])
                assert await publishers["lora-a"].reconcile() == 0
                for engine_url in stack.engine_urls:  # each job keeps its newest two versions; the other's stay
                    assert loaded_adapters(engine_url) == {"lora-a@1", "lora-a@2", "lora-b@0", "lora-b@1"}
                await publishers.pop("lora-a").close()  # job A ends: its versions go, B's stay
                for engine_url in stack.engine_urls:
                    assert loaded_adapters(engine_url) == {"lora-b@0", "lora-b@1"}
        finally:
            for pub in publishers.values():
                await pub.close()

    asyncio.run(scenario())
    assert num_turns == 2 * max(num_versions.values())
    for engine_url in stack.engine_urls:  # both jobs ended: every slot is free again
        assert loaded_adapters(engine_url) == set()
