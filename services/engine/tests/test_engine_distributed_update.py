"""SGLang's weight-update group protocol on a real engine process (the tiny model, --deterministic), with this
test process as the trainer (rank 0 of a gloo group built by the shared `init_custom_process_group`).

Pins: each distributed update serves the new version, its /weights_checker digest equals the trainer's own
digest of the tensors it broadcast, and greedy outputs and logprobs equal, bit for bit, what miles.model
computes in-process on the same weights; generation keeps running while an update waits for its tensors; bad
input is a 400 that changes neither weights nor version; groups are created, refused and destroyed as SGLang's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.distributed as dist

from miles.common.testing import free_port
from miles.common.weights import tensor_sha256, weights_digest
from miles.engine.distributed import UpdateGroups
from miles.engine.errors import WeightUpdateError
from miles.engine.protocol import InitWeightsUpdateGroupBody
from miles.model import CausalLM, block_logprobs, init_custom_process_group, load_model, read_safetensors_dir

pytestmark = pytest.mark.integration

GROUP = "weight_update_group"
PROMPTS = ([9707, 11, 1246, 525, 498, 30, 2585, 374], [3838, 374, 279, 6722, 315, 9625, 30])
NUM_TOKENS = 6


def digest_of(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> str:
    """The trainer's digest: weights_digest over each tensor's raw bytes in `dtype`."""
    raw = {
        n: t.detach().to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for n, t in tensors.items()
    }
    return weights_digest({name: tensor_sha256(data) for name, data in raw.items()})


@torch.inference_mode()
def reference_greedy(model: CausalLM, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from full deterministic forwards, in this process."""
    ids = list(prompt)
    logprobs = []
    for _ in range(NUM_TOKENS):
        hidden = model(torch.tensor(ids), deterministic=True)
        row = block_logprobs(model, hidden[-1:], torch.ones(1), deterministic=True)[0]
        token = int(row.argmax())
        ids.append(token)
        logprobs.append(float(row[token]))
    return ids[len(prompt) :], logprobs


@dataclass
class Trainer:
    """Rank 0 of the engine's weight-update group, with the float32 weights the engine should serve."""

    url: str
    model: CausalLM
    group: Any = None

    def join(self, group_name: str = GROUP) -> httpx.Response:
        port = free_port()
        body = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": group_name,
            "backend": "gloo",
        }
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(httpx.post, f"{self.url}/init_weights_update_group", json=body, timeout=120)
            self.group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, group_name, 60.0)
            return reply.result()

    def post_update(self, pool: ThreadPoolExecutor, tensors: dict[str, torch.Tensor], **body: Any) -> Future[Any]:
        """POST /update_weights_from_distributed announcing `tensors`, in the background (then broadcast them)."""
        return pool.submit(self.announce, tensors, **body)

    def announce(self, tensors: dict[str, torch.Tensor], **body: Any) -> httpx.Response:
        announcement = {
            "names": list(tensors),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()],
            "group_name": GROUP,
            **body,
        }
        return httpx.post(f"{self.url}/update_weights_from_distributed", json=announcement, timeout=120)

    def broadcast(self, tensors: dict[str, torch.Tensor]) -> None:
        for tensor in tensors.values():
            dist.broadcast(tensor.contiguous(), src=0, group=self.group)

    def update(self, tensors: dict[str, torch.Tensor], **body: Any) -> httpx.Response:
        with ThreadPoolExecutor(1) as pool:
            reply = self.post_update(pool, tensors, **body)
            self.broadcast(tensors)
            return reply.result()  # type: ignore[no-any-return]

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.model.named_parameters()}


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: Path, engine_factory: Any) -> Iterator[Trainer]:
    with engine_factory(tiny_model_dir, "--deterministic", "--weight-update-group-timeout-s", "60") as engine:
        trainer = Trainer(engine.url, load_model(tiny_model_dir))
        reply = trainer.join()
        assert reply.status_code == 200, reply.text
        assert reply.json() == {"success": True, "message": "Succeeded to initialize custom process group."}
        yield trainer
        if trainer.group is not None:
            dist.destroy_process_group(trainer.group)


def checksum(url: str, dtype: str | None = None) -> dict[str, Any]:
    reply = httpx.post(f"{url}/weights_checker", json={"action": "checksum", "dtype": dtype}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["success"] is True
    return reply.json()["payload"]  # type: ignore[no-any-return]


def greedy(url: str, prompt: list[int], num_tokens: int = NUM_TOKENS) -> dict[str, Any]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": num_tokens, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    reply = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


def served_logprobs(answer: dict[str, Any]) -> list[float]:
    return [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]


def wait_until_running(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/v1/loads").json()["loads"][0]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.01)


def test_checksum_of_the_loaded_weights_matches_the_checkpoint(trainer: Trainer, tiny_model_dir: Path) -> None:
    held = checksum(trainer.url)
    assert held["dtype"] == "float32" and held["exact"] is True
    assert held["num_tensors"] == len(trainer.weights()) and "lm_head.weight" not in trainer.weights()
    assert held["digest"] == digest_of(trainer.weights(), torch.float32)
    as_published = checksum(trainer.url, "bfloat16")
    assert as_published["exact"] is True, "float32 weights holding bfloat16 values convert losslessly"
    assert as_published["digest"] == digest_of(read_safetensors_dir(tiny_model_dir), torch.bfloat16)
    assert as_published["weight_version"] == held["weight_version"] == "default"
    assert httpx.get(f"{trainer.url}/weights_checker", timeout=60).json()["payload"] == held


def test_two_versions_by_broadcast_serve_bit_exact_outputs(trainer: Trainer) -> None:
    generator = torch.Generator().manual_seed(7)
    previous = {tuple(prompt): served_logprobs(greedy(trainer.url, prompt)) for prompt in PROMPTS}
    for version in ("1", "2"):
        with torch.no_grad():
            for param in trainer.model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.01)
        tensors = trainer.weights()
        with ThreadPoolExecutor(4) as pool:
            reply = trainer.post_update(pool, tensors, weight_version=version, flush_cache=True)
            time.sleep(0.3)  # the update now waits for its first broadcast; generation must go on meanwhile
            during = greedy(trainer.url, PROMPTS[0], 2)
            assert not reply.done(), reply.result().text
            in_flight = pool.submit(greedy, trainer.url, PROMPTS[1], 40)  # ~1.5 s of deterministic decoding
            wait_until_running(trainer.url)
            trainer.broadcast(tensors)
            answer = reply.result()
            assert in_flight.result()["meta_info"]["weight_version"] != version
        assert during["meta_info"]["weight_version"] != version
        assert answer.status_code == 200, answer.text
        assert answer.json() == {
            "success": True,
            "message": f"Succeeded to update parameter online. Weight version updated to {version}.",
        }
        assert httpx.get(f"{trainer.url}/model_info").json()["weight_version"] == version
        held = checksum(trainer.url)
        assert (held["weight_version"], held["exact"]) == (version, True)
        assert held["digest"] == digest_of(tensors, torch.float32)
        rounded = checksum(trainer.url, "bfloat16")
        assert rounded["digest"] == digest_of(tensors, torch.bfloat16) and rounded["exact"] is False
        for prompt in PROMPTS:
            served = greedy(trainer.url, prompt)
            assert served["meta_info"]["weight_version"] == version
            logprobs = served_logprobs(served)
            assert (served["output_ids"], logprobs) == reference_greedy(trainer.model, prompt)
            assert logprobs != previous.get(tuple(prompt)), "the new weights give new logprobs"
            previous[tuple(prompt)] = logprobs
    metrics = httpx.get(f"{trainer.url}/metrics").text.splitlines()
    assert 'miles_engine_weight_updates_total{outcome="ok",source="distributed"} 2.0' in metrics


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"group_name": "no-such-group"}, "does not exist"),
        ({"dtypes": ["float32", "float32"]}, "same length"),
        ({"dtypes": ["int8"]}, "dtype 'int8'"),
        ({"shapes": [[-1, 64]]}, "negative"),
        ({"shapes": [[1 << 40]]}, "bytes"),
        ({"names": ["model.norm.weight"] * 2, "dtypes": ["float32"] * 2, "shapes": [[64]] * 2}, "twice"),
        ({"load_format": "flattened_bucket"}, "load_format"),
    ],
)
def test_bad_announcements_are_refused_before_receiving(trainer: Trainer, change: dict[str, Any], message: str) -> None:
    before = checksum(trainer.url)
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": GROUP}
    reply = httpx.post(
        f"{trainer.url}/update_weights_from_distributed", json={**body, **change, "weight_version": "x"}, timeout=60
    )
    assert reply.status_code == 400
    assert reply.json()["success"] is False and message in reply.json()["message"]
    assert checksum(trainer.url) == before


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"model.layers.99.nope": torch.zeros(2)}, "unknown tensor name"),
        ({"model.norm.weight": torch.zeros(3)}, "shape"),
    ],
)
def test_tensors_the_model_lacks_are_received_then_refused(
    trainer: Trainer, bad: dict[str, torch.Tensor], message: str
) -> None:
    before = checksum(trainer.url)
    tensors = {"model.layers.0.input_layernorm.weight": torch.full((64,), 2.0), **bad}
    reply = trainer.update(tensors, weight_version="never")
    assert reply.status_code == 400
    assert reply.json()["success"] is False and message in reply.json()["message"]
    assert checksum(trainer.url) == before, "nothing was applied"
    unchanged = {"model.norm.weight": trainer.weights()["model.norm.weight"]}
    assert trainer.update(unchanged).json()["success"] is True, "the group is still in step"
    assert checksum(trainer.url) == before


def test_group_lifecycle_refusals_and_destroy(trainer: Trainer) -> None:
    def init(**change: Any) -> httpx.Response:
        body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
        return httpx.post(f"{trainer.url}/init_weights_update_group", json={**body, **change}, timeout=60)

    refusals = [
        (init(group_name=GROUP, backend="gloo"), "already exists"),
        (init(group_name="other", backend="nccl"), "use backend 'gloo'"),
        (init(group_name="other", backend="mpi"), "not supported"),
        (init(group_name="other", backend="gloo", rank_offset=0), "rank_offset"),
    ]
    for reply, message in refusals:
        assert reply.status_code == 400 and reply.json()["success"] is False
        assert message in reply.json()["message"], reply.json()
    norm = {"model.norm.weight": trainer.weights()["model.norm.weight"]}
    with ThreadPoolExecutor(1) as pool:
        pending = trainer.post_update(pool, norm)
        time.sleep(0.3)  # the first update now waits for its broadcast
        busy = trainer.announce(norm)
        destroy_busy = httpx.post(f"{trainer.url}/destroy_weights_update_group", json={"group_name": GROUP})
        trainer.broadcast(norm)
        assert pending.result().json()["success"] is True
    assert busy.status_code == 400 and "busy" in busy.json()["message"]
    assert destroy_busy.status_code == 400 and "busy" in destroy_busy.json()["message"]
    destroyed = httpx.post(f"{trainer.url}/destroy_weights_update_group", json={"group_name": GROUP})
    assert destroyed.json() == {"success": True, "message": "Succeeded to destroy custom process group."}
    again = httpx.post(f"{trainer.url}/destroy_weights_update_group", json={"group_name": GROUP})
    assert again.status_code == 400 and again.json()["success"] is False
    dist.destroy_process_group(trainer.group)
    trainer.group = None
    assert trainer.join().json()["success"] is True, "a destroyed group's name can be used again"


def test_openapi_documents_the_group_routes_and_their_400(trainer: Trainer) -> None:
    paths = httpx.get(f"{trainer.url}/openapi.json").json()["paths"]
    for path in ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group"):
        assert set(paths[path]["post"]["responses"]) >= {"200", "400"}
    assert set(paths["/weights_checker"]) == {"get", "post"}
    assert "400" in paths["/weights_checker"]["post"]["responses"]


async def test_joining_a_group_nobody_hosts_fails_after_the_timeout() -> None:
    groups = UpdateGroups(timeout_s=1.0)
    body = InitWeightsUpdateGroupBody(
        master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2, backend="gloo"
    )
    started = time.monotonic()
    for _ in range(2):  # the failed join frees the name again
        with pytest.raises(WeightUpdateError, match="Failed to initialize custom process group"):
            await groups.init(body)
    assert time.monotonic() - started < 30
