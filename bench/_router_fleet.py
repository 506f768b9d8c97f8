"""The processes `make bench-router` runs (engines, routers) and what it reads from the engines' /metrics.

A helper of bench/router.py (the leading underscore keeps it out of `make bench`).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from miles.common.testing import ServiceProcess, free_port, wait_for_http_ready
from miles.common.testing.smoke import console_script

PREFILL_TOKEN_COST_S = 0.00002
"""Fake engine: seconds per prompt token not served from the cache."""
DECODE_TOKEN_COST_S = 0.0002
"""Fake engine: seconds per generated token (a decode step of 8 requests costs 8 times this)."""


@dataclass(frozen=True)
class RouterConfig:
    name: str
    kind: str
    """miles | smg"""
    policy: str
    new_key_placement: str = ""


# --- processes -------------------------------------------------------------------------------------------------------
def write_fake_model_dir(out: Path) -> Path:
    """config.json + the real Qwen3 tokenizer: all `--fake-model` reads."""
    from miles.engine.tiny_model import TINY_QWEN3_CONFIG, TOKENIZER_FILES, qwen3_tokenizer_dir

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(TINY_QWEN3_CONFIG))
    for name in TOKENIZER_FILES:
        shutil.copyfile(qwen3_tokenizer_dir() / name, out / name)
    return out


def start_engines(
    model_dir: Path, log_dir: Path, kv_budget_tokens: int, num_engines: int
) -> list[tuple[str, ServiceProcess]]:
    engines = []
    for _ in range(num_engines):
        port = free_port()
        argv = [
            console_script("miles-engine"),
            *("--model-path", str(model_dir), "--port", str(port), "--fake-model", "--weight-version", "0"),
            *("--max-total-tokens", str(kv_budget_tokens)),
            *("--fake-prefill-token-cost-s", str(PREFILL_TOKEN_COST_S)),
            *("--fake-decode-token-cost-s", str(DECODE_TOKEN_COST_S)),
        ]
        process = ServiceProcess(argv, ready_url=None, log_path=log_dir / f"engine-{port}.log").start()
        engines.append((f"http://127.0.0.1:{port}", process))
    for url, process in engines:
        wait_for_http_ready(f"{url}/readyz", 120, process.process)
    return engines


def start_router(config: RouterConfig, engine_urls: list[str], log_dir: Path) -> tuple[str, ServiceProcess]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"router-{config.name}.log"
    if config.kind == "miles":
        env = {
            "MILES_ROUTER_PORT": str(port),
            "MILES_ROUTER_ADMIN_GRPC_PORT": "-1",
            "MILES_ROUTER_ENGINE_URLS": json.dumps(engine_urls),
            "MILES_ROUTER_POLICY": config.policy,
            "MILES_ROUTER_LOG_LEVEL": "WARNING",
            "MILES_ROUTER_LOG_JSON": "false",
        }
        if config.new_key_placement:
            env["MILES_ROUTER_NEW_KEY_PLACEMENT"] = config.new_key_placement
        argv = [console_script("miles-rollout-router")]
        return url, ServiceProcess(argv, ready_url=f"{url}/readyz", env=env, log_path=log_path).start()
    argv = [
        *(sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port)),
        *("--worker-urls", *engine_urls, "--policy", config.policy),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())),
        *("--disable-worker-overload-protection", "--log-level", "warn"),
    ]
    process = ServiceProcess(argv, ready_url=None, log_path=log_path).start()
    for _ in range(600):  # smg registers workers asynchronously: wait until all are healthy
        try:
            ready = httpx.get(f"{url}/readiness", timeout=2).json()
            if ready.get("healthy_workers") == len(engine_urls):
                return url, process
        except (httpx.HTTPError, ValueError):
            pass
        if not process.is_running():
            break
        time.sleep(0.1)
    process.stop()
    raise RuntimeError(f"smg did not register every engine:\n{process.log_tail()}")


# --- engine metrics --------------------------------------------------------------------------------------------------
def scrape(urls: Sequence[str]) -> list[dict[str, float]]:
    """Per engine: the sglang/miles samples this bench reads, summed over labels except `le`."""
    wanted = (
        "sglang:num_requests_total",
        "miles_engine_radix_cache_evicted_tokens_total",
        "sglang:queue_time_seconds_bucket",
    )
    snapshots = []
    for url in urls:
        samples: dict[str, float] = {}
        for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name not in wanted:
                continue
            key = name
            if name.endswith("_bucket"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                key = f"{name}|{le}"
            samples[key] = samples.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        snapshots.append(samples)
    return snapshots


def quantile_from_buckets(buckets: dict[float, float], q: float) -> float:
    """histogram_quantile over cumulative bucket counts (linear inside the bucket, as Prometheus does)."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return 0.0
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-12)
        lower_bound, lower_count = bound, count
    return lower_bound


def engine_deltas(before: list[dict[str, float]], after: list[dict[str, float]]) -> tuple[list[int], int, float]:
    """(requests per engine, evicted tokens, p99 queue wait s) between two scrapes."""
    requests = [
        int(a.get("sglang:num_requests_total", 0) - b.get("sglang:num_requests_total", 0))
        for b, a in zip(before, after, strict=True)
    ]
    evicted = sum(
        a.get("miles_engine_radix_cache_evicted_tokens_total", 0)
        - b.get("miles_engine_radix_cache_evicted_tokens_total", 0)
        for b, a in zip(before, after, strict=True)
    )
    buckets: dict[float, float] = {}
    for b, a in zip(before, after, strict=True):
        for key, value in a.items():
            if key.startswith("sglang:queue_time_seconds_bucket|"):
                bound = float(key.split("|", 1)[1])
                buckets[bound] = buckets.get(bound, 0.0) + value - b.get(key, 0.0)
    return requests, int(evicted), quantile_from_buckets(buckets, 0.99) if buckets else 0.0
