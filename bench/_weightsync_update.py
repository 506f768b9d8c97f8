"""Part (c) of `make bench-weightsync`: how long a weight update stops an engine, out of the whole update.

Real processes on loopback: one `miles-engine` (the tiny Qwen3 model) kept busy by a load generator sending
/generate requests through a real `miles-rollout-router`, and the job's weight-sync origin loading it (defaults:
delta transport, drain pause mode). This process is the trainer: the tiny model in float32 taking real AdamW
steps, each published the way the trainer's `stream` publisher does (bf16, over the origin's data channel, with
the time the step finished). For every version the origin's ENGINE_UPDATED event reports:

- `pause_s`: from the engine's /pause_generation to its resume — the only time it serves nothing (the drain
  before it waits for in-flight requests while the engine still serves them);
- `step_to_serving_s`: from the end of the optimizer step to the engine serving the new version — the whole
  update as a user feels it (publish, verify, store, prepare next to the engine, swap);
- `transfer_s`: preparing the version next to the engine while it served.

`pause_vs_update` = median pause / median step-to-serving (goal <= 0.15). Side by side, the naive order —
quiescing first and preparing inside the pause, as the daemon did before — would pause for transfer + swap:
`naive_pause_vs_update` is that sum over the same total, from the same updates.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from miles.common.testing import ServiceProcess, free_port, wait_for_http_ready
from miles.common.testing.smoke import console_script


def _spawn(name: str, argv: list[str], env: dict[str, str], scratch: Path) -> ServiceProcess:
    return ServiceProcess(argv, ready_url=None, env=env, log_path=scratch / f"{name}.log").start()


def _start(model_dir: Path, scratch: Path) -> tuple[list[ServiceProcess], str, str, str]:
    engine_port, router_port, port, metrics_port = free_port(), free_port(), free_port(), free_port()
    engine_url, router_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{router_port}"
    engine = _spawn(
        "engine",
        [console_script("miles-engine"), "--model-path", str(model_dir), "--port", str(engine_port)],
        {"MILES_ENGINE_LOG_JSON": "false"},
        scratch,
    )
    router_env = {
        "MILES_ROUTER_PORT": str(router_port),
        "MILES_ROUTER_ADMIN_GRPC_PORT": "-1",
        "MILES_ROUTER_ENGINE_URLS": json.dumps([engine_url]),
        "MILES_ROUTER_HEALTH_CHECK_INTERVAL_S": "1",
    }
    router = _spawn("router", [console_script("miles-rollout-router")], router_env, scratch)
    config = {
        "job_id": "bench-update",
        "port": port,
        "metrics_port": metrics_port,
        "engine_urls": [engine_url],
        "router_url": router_url,
        "pool": "default",
        "store_dir": str(scratch / "update-store"),
        "work_dir": str(scratch / "update-work"),
        "log_json": False,
    }
    (scratch / "update-daemon.json").write_text(json.dumps(config))
    daemon = _spawn(
        "update-daemon",
        [console_script("miles-weight-sync")],
        {"MILES_WEIGHTSYNC_CONFIG_FILE": str(scratch / "update-daemon.json")},
        scratch,
    )
    processes = [engine, router, daemon]
    for process, url in ((engine, engine_url), (router, router_url), (daemon, f"http://127.0.0.1:{metrics_port}")):
        wait_for_http_ready(f"{url}/readyz", 180.0, process.process)
    return processes, engine_url, router_url, f"127.0.0.1:{port}"


class _Load(threading.Thread):
    """Keeps `concurrency` requests of `max_tokens` each in flight through the router."""

    def __init__(self, router_url: str, concurrency: int = 2, max_tokens: int = 24) -> None:
        super().__init__(daemon=True)
        self.router_url, self.concurrency, self.max_tokens = router_url, concurrency, max_tokens
        self.stopped = threading.Event()
        self.num_ok = 0

    def _one(self, client: httpx.Client, seed: int) -> None:
        body = {
            "input_ids": [1000 + (seed * 7 + i) % 5000 for i in range(16)],
            "sampling_params": {"max_new_tokens": self.max_tokens, "temperature": 1.0, "ignore_eos": True},
        }
        if client.post(f"{self.router_url}/generate", json=body).status_code == 200:
            self.num_ok += 1

    def run(self) -> None:
        def worker(index: int) -> None:
            with httpx.Client(timeout=120) as client:
                seed = index
                while not self.stopped.is_set():
                    try:
                        self._one(client, seed)
                    except httpx.HTTPError:
                        time.sleep(0.1)
                    seed += self.concurrency

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(self.concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


async def _train_and_publish(address: str, model_dir: Path, num_versions: int, lr: float) -> list[dict[str, Any]]:
    from miles.model import load_model, sequence_logprobs
    from miles.proto.weightsync.v1 import weightsync_pb2 as pb
    from miles.weightsync.client import WeightSyncClient

    model = load_model(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(0)
    updates: list[dict[str, Any]] = []
    async with WeightSyncClient(address) as client:
        await client.publish("bench-update", 0, -1, dict(model.named_parameters()))
        for version in range(1, num_versions + 1):
            ids = torch.randint(0, model.config.vocab_size, (32,), generator=generator)
            loss = -sequence_logprobs(model, ids, start=1).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step_ms = int(time.time() * 1000)
            result = await client.publish(
                "bench-update", version, version - 1, dict(model.named_parameters()), step_finished_unix_ms=step_ms
            )
            async for event in client.watch_versions("bench-update", from_version=version):
                if event.version == version and event.kind == pb.VERSION_EVENT_KIND_ENGINE_UPDATED:
                    updates.append(
                        {
                            "version": version,
                            "pause_s": event.pause_s,
                            "transfer_s": event.transfer_s,
                            "step_to_serving_s": event.step_to_serving_s,
                            "wire_bytes": event.wire_bytes,
                            "publish_path": result.path,
                            "stored_bytes": result.stored_bytes,
                        }
                    )
                    break
                if event.version == version and event.kind == pb.VERSION_EVENT_KIND_ENGINE_UPDATE_FAILED:
                    raise RuntimeError(f"the engine update of version {version} failed: {event.error}")
    return updates


def pause_vs_update(model_dir: Path, scratch: Path, num_versions: int = 6, lr: float = 1e-5) -> dict[str, Any]:
    processes, _, router_url, address = _start(model_dir, scratch)
    load = _Load(router_url)
    try:
        load.start()
        updates = asyncio.run(_train_and_publish(address, model_dir, num_versions, lr))
    finally:
        load.stopped.set()
        load.join(timeout=120)
        for process in reversed(processes):
            process.stop()
    pause = statistics.median(u["pause_s"] for u in updates)
    total = statistics.median(u["step_to_serving_s"] for u in updates)
    naive = statistics.median(u["pause_s"] + u["transfer_s"] for u in updates)
    return {
        "what": "tiny Qwen3 (bf16 ~20 MB), one engine under load through the router, default delta/drain, AdamW lr",
        "lr": lr,
        "updates": updates,
        "requests_served_during": load.num_ok,
        "pause_s_median": pause,
        "step_to_serving_s_median": total,
        "transfer_s_median": statistics.median(u["transfer_s"] for u in updates),
        "pause_vs_update": pause / total,
        "naive_pause_vs_update": naive / total,
    }
