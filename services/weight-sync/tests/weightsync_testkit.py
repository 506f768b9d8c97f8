"""Helpers of the weight-sync tests (imported by name: conftest.py puts this folder on sys.path): a trainer-like
client that takes real AdamW steps of the tiny model, and starting real engine / router / weight-sync processes."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from miles.common.testing import ServiceProcess, free_port, wait_for_http_ready
from miles.common.testing.smoke import console_script

TOKEN_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
)


class TinyTrainer:
    """A trainer stand-in: the tiny model in float32 (master weights), AdamW, real steps on a next-token loss
    over random token sequences; publishes its bfloat16 copy (the engine dtype)."""

    def __init__(self, model_dir: Path, *, lr: float, seed: int = 0, seq_len: int = 16) -> None:
        from miles.model import load_model

        self.model_dir = model_dir
        self.model = load_model(model_dir)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.generator = torch.Generator().manual_seed(seed)
        self.seq_len = seq_len
        self.version = 0

    def step(self) -> int:
        from miles.model import sequence_logprobs

        ids = torch.randint(0, self.model.config.vocab_size, (self.seq_len,), generator=self.generator)
        loss = -sequence_logprobs(self.model, ids, start=1).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.version += 1
        return self.version

    def bf16_state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().to(torch.bfloat16).contiguous() for name, p in self.model.named_parameters()}

    def write_checkpoint(self, out_dir: Path) -> Path:
        """The full HF checkpoint of the current version (what a reference engine loads from disk)."""
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        for name in TOKEN_FILES:
            shutil.copyfile(self.model_dir / name, out_dir / name)
        save_file(self.bf16_state(), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return out_dir


@dataclass
class Proc:
    process: ServiceProcess
    url: str  # HTTP base URL (engine, router) or metrics URL (daemon)
    address: str = ""  # gRPC host:port (daemon)


def start_engine(model_dir: Path, log_dir: Path, *flags: str) -> Proc:
    port = free_port()
    argv = [console_script("miles-engine"), "--model-path", str(model_dir), "--port", str(port), *flags]
    process = ServiceProcess(argv, ready_url=None, log_path=log_dir / f"engine-{port}.log").start()
    return Proc(process, f"http://127.0.0.1:{port}")


def start_router(engine_urls: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Proc:
    """A miles-rollout-router process over `engine_urls` (default pool), `env` added to its environment."""
    port = free_port()
    env = {
        **(env or {}),
        "MILES_ROUTER_PORT": str(port),
        "MILES_ROUTER_ADMIN_GRPC_PORT": "-1",
        "MILES_ROUTER_ENGINE_URLS": json.dumps(engine_urls),
        "MILES_ROUTER_POLICY": "least_load",
        "MILES_ROUTER_HEALTH_CHECK_INTERVAL_S": "1",
    }
    process = ServiceProcess(
        [console_script("miles-rollout-router")], ready_url=None, log_path=log_dir / "router.log", env=env
    ).start()
    return Proc(process, f"http://127.0.0.1:{port}")


def start_daemon(
    config: dict[str, Any], log_dir: Path, name: str, port: int | None = None, env: dict[str, str] | None = None
) -> Proc:
    """A miles-weight-sync process with `config` in its config file and `env` (e.g. tokens) in its environment."""
    port, metrics_port = port or free_port(), free_port()
    config_path = log_dir / f"{name}.json"
    config_path.write_text(json.dumps({**config, "port": port, "metrics_port": metrics_port, "log_json": False}))
    env = {**(env or {}), "MILES_WEIGHTSYNC_CONFIG_FILE": str(config_path)}
    process = ServiceProcess(
        [console_script("miles-weight-sync")], ready_url=None, log_path=log_dir / f"{name}.log", env=env
    ).start()
    return Proc(process, f"http://127.0.0.1:{metrics_port}", f"127.0.0.1:{port}")


def wait_ready(procs: list[Proc], path: str) -> None:
    for proc in procs:
        try:
            wait_for_http_ready(f"{proc.url}{path}", 180.0, proc.process.process)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}\n--- {proc.process.log_path} ---\n{proc.process.log_tail()}") from None


def stop_all(procs: list[Proc]) -> None:
    for proc in procs:
        proc.process.stop()


def greedy(engine_url: str, prompt_ids: list[int], num_tokens: int = 4) -> dict[str, Any]:
    """Greedy output ids and logprobs of one engine for a fixed prompt (compared bit for bit)."""
    body = {
        "input_ids": prompt_ids,
        "sampling_params": {"max_new_tokens": num_tokens, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
    }
    response = httpx.post(f"{engine_url}/generate", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    answer = response.json()
    return {
        "output_ids": answer["output_ids"],
        "logprobs": [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]],
        "weight_version": answer["meta_info"]["weight_version"],
    }


def engine_version(engine_url: str) -> str:
    return str(httpx.get(f"{engine_url}/model_info", timeout=30.0).json()["weight_version"])
