"""--fake-model: the same protocol, scheduler and cache accounting without the transformer — torch is never
imported, so start-up is fast and memory small, and cached_tokens follows the same exact rule."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.integration


def test_fake_engine_speaks_the_protocol_without_torch(tiny_model_dir: Path, engine_factory: Any) -> None:
    flags = ("--fake-model", "--fake-decode-token-cost-s", "0.001", "--fake-eos-probability", "0.0")
    with engine_factory(tiny_model_dir, *flags) as engine:
        maps = Path(f"/proc/{engine.process.pid}/maps").read_text()
        assert "libtorch" not in maps, "the fake model must not load torch"
        status = Path(f"/proc/{engine.process.pid}/status").read_text()
        rss_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
        assert rss_kb < 400_000, f"fake engine uses {rss_kb} kB"
        prompt = list(range(1000, 1050))
        first = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 10, "temperature": 0})
        assert first["meta_info"]["completion_tokens"] == 10 and first["text"]
        turn = prompt + first["output_ids"] + [5, 6, 7]
        second = engine.generate(input_ids=turn, sampling_params={"max_new_tokens": 3}, return_logprob=True)
        assert second["meta_info"]["cached_tokens"] == len(prompt) + 10 - 1
        assert len(second["meta_info"]["output_token_logprobs"]) == 3
        stream = engine.post(
            "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3}, "stream": True}
        )
        assert stream.text.endswith("data: [DONE]\n\n")
        assert engine.client.get("/server_info").json()["fake_model"] is True
        update = engine.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "7"})
        assert update.json()["success"] is True
        again = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 10, "temperature": 0})
        assert again["meta_info"]["weight_version"] == "7"
        assert again["output_ids"] != first["output_ids"], "new weights give new (fake) outputs"
        checker = engine.post("/weights_checker", {"action": "checksum"})
        assert checker.status_code == 400 and checker.json()["success"] is False
        assert "fake model" in checker.json()["message"]
        assert "libtorch" not in Path(f"/proc/{engine.process.pid}/maps").read_text()
        update_over_a_group(engine)
        third = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 10, "temperature": 0})
        assert third["meta_info"]["weight_version"] == "8" and third["output_ids"] != again["output_ids"]


def update_over_a_group(engine: Any) -> None:
    """A distributed update of the fake model: the tensors are really received (torch is loaded only now)."""
    import torch
    import torch.distributed as dist

    from miles.common.testing import free_port
    from miles.model import init_custom_process_group

    port = free_port()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"}
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    announce = {"names": ["any.name"], "dtypes": ["float32"], "shapes": [[2, 3]], "weight_version": "8"}
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(engine.post, "/init_weights_update_group", body)
        group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "weight_update_group", 60.0)
        assert joined.result().json()["success"] is True
        updated = pool.submit(engine.post, "/update_weights_from_distributed", announce)
        dist.broadcast(tensor, src=0, group=group)
        assert updated.result().json()["success"] is True
    assert engine.post("/destroy_weights_update_group", {}).json()["success"] is True
    dist.destroy_process_group(group)


def test_a_client_leaving_a_stream_aborts_its_request(tiny_model_dir: Path, engine_factory: Any) -> None:
    with engine_factory(tiny_model_dir, "--fake-model", "--fake-decode-token-cost-s", "0.01") as engine:
        params = {"max_new_tokens": 5000, "ignore_eos": True}
        body = {"input_ids": [1, 2, 3], "sampling_params": params, "stream": True}
        with (
            httpx.Client(base_url=engine.url, timeout=30) as client,
            client.stream("POST", "/generate", json=body) as response,
        ):
            assert next(response.iter_lines()).startswith("data: ")
        deadline = time.monotonic() + 30
        while _running(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _running(engine) == 0
        metrics = engine.client.get("/metrics").text.splitlines()
        aborted = [line for line in metrics if line.startswith("sglang:num_aborted_requests_total{")]
        assert aborted and float(aborted[0].split()[-1]) == 1.0


def _running(engine: Any) -> int:
    return int(engine.client.get("/v1/loads").json()["loads"][0]["num_running_reqs"])
