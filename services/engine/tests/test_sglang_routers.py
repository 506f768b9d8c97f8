"""The real SGLang router (sglang-router 0.3.2) and its successor SMG (smg 1.13.0) in front of two miles-engine
processes with the tiny model: they register the engines, pass /generate through (streaming and not) and spread
the traffic over both engines, which shows that our engine speaks the protocol the routers expect.

Routed experts (MoE, R3) in front of one engine with the tiny MoE model: smg forwards `return_routed_experts` /
`routed_experts_start_len` and passes `meta_info.routed_experts` back untouched; sglang-router 0.3.2 re-serializes
the body without those two fields (docs/sglang-protocol.md §6), so R3 needs smg (pinned here)."""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.common.testing import ServiceProcess, free_port, wait_for_http_ready
from miles.common.testing.smoke import console_script

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine_urls(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    log_dir = tmp_path_factory.mktemp("router-engines")
    started: list[tuple[ServiceProcess, str]] = []
    try:
        for index in range(2):  # start both, then wait for both: start-up overlaps
            port = free_port()
            argv = [console_script("miles-engine"), "--model-path", str(tiny_model_dir), "--port", str(port)]
            process = ServiceProcess(argv, ready_url=None, log_path=log_dir / f"engine-{index}.log").start()
            started.append((process, f"http://127.0.0.1:{port}"))
        for process, url in started:
            wait_for_http_ready(f"{url}/readyz", 120, process.process)
        yield [url for _, url in started]
    finally:
        for process, _ in started:
            process.stop()


def _router_argv(kind: str, port: int, metrics_port: int, workers: list[str]) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy", "round_robin"]
    metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    if kind == "sglang_router":
        return [sys.executable, "-m", "sglang_router.launch_router", *common, *metrics]
    # python -m smg: the `smg` console script in .venv belongs to sglang-router 0.3.2 (both wheels ship one).
    return [sys.executable, "-m", "smg", "launch", *common, *metrics]


def _requests_served(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("sglang:num_requests_total{"):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("kind", ["sglang_router", "smg"])
def test_real_router_serves_generate_through_both_engines(kind: str, engine_urls: list[str], tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    served_before = [_requests_served(u) for u in engine_urls]
    argv = _router_argv(kind, port, metrics_port, engine_urls)
    with (
        ServiceProcess(argv, ready_url=f"{url}/readiness", log_path=tmp_path / f"{kind}.log"),
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        body = {"input_ids": [9707, 11, 1246, 525, 498, 30], "sampling_params": {"max_new_tokens": 4}}
        for _ in range(4):
            reply = client.post("/generate", json={**body, "return_logprob": True})
            assert reply.status_code == 200, reply.text
            meta = reply.json()["meta_info"]
            assert meta["completion_tokens"] == 4 == len(meta["output_token_logprobs"])
            assert meta["finish_reason"] == {"type": "length", "length": 4}
        for _ in range(4):
            streamed = client.post("/generate", json={**body, "stream": True})
            assert streamed.status_code == 200
            events = [block[len("data: ") :] for block in streamed.text.split("\n\n") if block]
            assert events[-1] == "[DONE]"
            final = json.loads(events[-2])
            assert final["meta_info"]["finish_reason"]["type"] == "length" and len(final["output_ids"]) == 4
    served = [_requests_served(u) - before for u, before in zip(engine_urls, served_before, strict=True)]
    assert sum(served) >= 8
    assert all(count >= 2 for count in served), f"traffic per engine: {served}"


@pytest.fixture(scope="module")
def moe_engine_url(tiny_moe_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [console_script("miles-engine"), "--model-path", str(tiny_moe_model_dir), "--port", str(port)]
    argv += ["--deterministic", "--enable-return-routed-experts"]
    log_path = tmp_path_factory.mktemp("router-moe-engine") / "engine.log"
    with ServiceProcess(argv, ready_url=f"{url}/readyz", log_path=log_path):
        yield url


def _final_chunk(response: httpx.Response) -> dict[str, Any]:
    events = [block[len("data: ") :] for block in response.text.split("\n\n") if block]
    assert events[-1] == "[DONE]"
    assert all("routed_experts" not in json.loads(e)["meta_info"] for e in events[:-2])
    return dict(json.loads(events[-2]))


@pytest.mark.parametrize("kind", ["sglang_router", "smg"])
def test_routed_experts_pass_through_smg_and_not_sglang_router(kind: str, moe_engine_url: str, tmp_path: Path) -> None:
    body = {"input_ids": [9707, 11, 1246, 525, 498, 30], "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    body |= {"return_routed_experts": True, "routed_experts_start_len": 2}
    direct = httpx.post(f"{moe_engine_url}/generate", json=body, timeout=60).json()["meta_info"]["routed_experts"]
    assert len(base64.b64decode(direct)) == (6 + 5 - 1 - 2) * 4 * 2 * 4  # rows x MoE layers x top-k x int32
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    argv = _router_argv(kind, port, metrics_port, [moe_engine_url])
    with (
        ServiceProcess(argv, ready_url=f"{url}/readiness", log_path=tmp_path / f"{kind}.log"),
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        whole = client.post("/generate", json=body)
        streamed = client.post("/generate", json={**body, "stream": True})
        refused = client.post("/generate", json={**body, "routed_experts_start_len": 7})
    assert whole.status_code == streamed.status_code == 200
    if kind == "smg":
        assert whole.json()["meta_info"]["routed_experts"] == direct
        assert _final_chunk(streamed)["meta_info"]["routed_experts"] == direct
        assert refused.status_code == 400
        assert "is higher than the number of input tokens" in refused.json()["error"]["message"]
    else:  # the fields never reach the engine
        assert "routed_experts" not in whole.json()["meta_info"]
        assert "routed_experts" not in _final_chunk(streamed)["meta_info"]
        assert refused.status_code == 200
