"""make bench-router_soak: 16 agents talk through the router for 5 minutes with human-like pauses; none may lose a turn.

The failure this guards against: agents pause between turns (a tool runs, a sandbox executes), so the router's
pooled connections to the engines sit idle for seconds; an engine (uvicorn, like SGLang) closes idle keep-alive
connections after 5 s, and a router that reuses one just as it closes loses the request (`httpx.ReadError`): on
main before the keep-alive work, 20 requests in 13 replays of an agent workload. Each agent here runs multi-turn
episodes against 2 `miles-engine --fake-model` processes through the router (`/generate`, token in, token out),
pausing 0-8 s between turns (uniform: many pauses land right at the engines' 5 s idle timeout) and starting a new
episode after each. Every non-200 answer or transport error counts as a lost request.

Side by side in the same run (`--peer`, on by default): the SGLang router smg 1.13.0 (`python -m smg launch`)
under the same agents for the same duration. Pass: the miles router lost 0 requests. Results:
bench/results/router_soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from miles.common.testing.machine import describe_machine

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ helpers (not a package)
from _router_fleet import RouterConfig, start_engines, start_router, write_fake_model_dir

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "router_soak.json"
NUM_AGENTS = 16
NUM_ENGINES = 2
PAUSE_S = (0.0, 8.0)
TURNS_PER_EPISODE = (3, 12)


@dataclass
class SoakResult:
    name: str
    duration_s: float
    requests: int = 0
    lost: int = 0
    episodes: int = 0
    errors: dict[str, int] = field(default_factory=dict)


async def agent(router_url: str, index: int, deadline_s: float, result: SoakResult) -> None:
    rng = random.Random(index)
    async with httpx.AsyncClient(base_url=router_url, timeout=120, trust_env=False) as client:
        while time.monotonic() < deadline_s:
            episode_id = f"soak-{index}-{result.episodes}"
            ids = [rng.randrange(100, 5000) for _ in range(rng.randrange(50, 300))]
            for _ in range(rng.randrange(*TURNS_PER_EPISODE)):
                if time.monotonic() >= deadline_s:
                    return
                body = {
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": rng.randrange(4, 24), "ignore_eos": True},
                }
                headers = {"X-SMG-Routing-Key": episode_id, "X-Miles-Session-Id": episode_id}
                result.requests += 1
                try:
                    response = await client.post("/generate", json=body, headers=headers)
                    if response.status_code != 200:
                        _lost(result, f"HTTP {response.status_code}")
                    else:
                        ids = ids + response.json()["output_ids"] + [rng.randrange(100, 5000) for _ in range(20)]
                except httpx.HTTPError as exc:
                    _lost(result, type(exc).__name__)
                await asyncio.sleep(rng.uniform(*PAUSE_S))
            result.episodes += 1


def _lost(result: SoakResult, why: str) -> None:
    result.lost += 1
    result.errors[why] = result.errors.get(why, 0) + 1


async def soak(name: str, router_url: str, duration_s: float) -> SoakResult:
    result = SoakResult(name, duration_s)
    deadline_s = time.monotonic() + duration_s
    await asyncio.gather(*(agent(router_url, index, deadline_s, result) for index in range(NUM_AGENTS)))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--no-peer", action="store_true", help="skip the SGLang router (smg) run")
    args = parser.parse_args(argv)
    configs = [RouterConfig("miles-rollout-router", "miles", "session_affinity", "least_load")]
    if not args.no_peer:
        configs.append(RouterConfig("smg", "smg", "consistent_hashing"))
    results: list[SoakResult] = []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = write_fake_model_dir(Path(scratch) / "model")
        log_dir = Path(scratch) / "logs"
        engines = start_engines(model_dir, log_dir, 200_000, NUM_ENGINES)
        try:
            for config in configs:
                router_url, router = start_router(config, [url for url, _ in engines], log_dir)
                try:
                    result = asyncio.run(soak(config.name, router_url, args.duration_s))
                finally:
                    router.stop()
                results.append(result)
                print(f"{result.name}: {result.requests} requests, {result.lost} lost {result.errors}", flush=True)
        finally:
            for _, process in engines:
                process.stop()
    miles = results[0]
    verdict = "PASS" if miles.lost == 0 and miles.requests > 0 else "FAIL"
    payload = {
        "agents": NUM_AGENTS,
        "engines": NUM_ENGINES,
        "pause_s": PAUSE_S,
        "results": [asdict(r) for r in results],
        "verdict": verdict,
        "machine": describe_machine(),
    }
    if args.duration_s == 300.0:
        RESULTS.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"router soak: {verdict}")
    sys.exit(0 if verdict == "PASS" else 1)


if __name__ == "__main__":
    main()
