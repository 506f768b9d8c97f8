"""make bench-router: how much of a multi-turn agent workload's prefix cache each routing policy keeps, side by side.

Replays the recorded workload of bench/data/router_workload.json (200 episodes of 10-40 turns, GRPO groups of 4
sharing their first prompt, growing contexts, some long tool outputs; see bench/_router_workload.py) against 4
real `miles-engine --fake-model` processes (real protocol, scheduler and radix cache with a KV token budget, LRU
eviction and exact cached_tokens; a cheap deterministic sampler instead of the transformer), once per router
configuration, all in one run:
- miles-rollout-router with each policy: session_affinity (new_key_placement prefix and least_load; hash with
  --only), cache_aware, least_load, round_robin;
- the real SGLang router, smg 1.13.0 (`python -m smg launch`): cache_aware, and consistent_hashing keyed by the
  X-SMG-Routing-Key header (every request carries the episode id in it).
Each configuration gets the same engines with emptied caches and the same 32 episodes in flight. Every turn's
prompt is the previous prompt + the sampled output ids + the tool output (token in, token out), sent as
`input_ids` to /generate.

Reported per configuration: prefix hit rate = cached / prompt tokens (the engines' own counts), the trace's
theoretical maximum (every turn finds its previous context cached), hit_ratio_of_max, throughput, p99 queue
wait (time a request waited in an engine's queue for KV room, from the engines' histograms), p99 latency, and the
tokens the engines evicted. The KV budget per engine is sized so that the sessions' live contexts fit when each
session stays on one engine (about 8 per engine) but not when every engine has to hold every session: a policy that
scatters a session's turns really evicts.

Limits: smg runs with --disable-worker-overload-protection, because miles-engine reports KV token_usage with its
evictable prefix cache counted as used (SGLang counts only locked and running tokens), which would make smg's
default 0.8 usage veto fire on every engine with a full cache and route by load alone.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import ssl
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ helpers (not a package)
import _router_workload as workload_module
from _router_fleet import (
    DECODE_TOKEN_COST_S,
    PREFILL_TOKEN_COST_S,
    RouterConfig,
    engine_deltas,
    scrape,
    start_engines,
    start_router,
    write_fake_model_dir,
)
from _router_workload import Episode, Workload, tool_tokens

from miles.common.testing.machine import describe_machine

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "router.json"
NUM_ENGINES = 4
EPISODES_IN_FLIGHT = 32
KV_BUDGET_TOKENS = 32_000
"""Per engine (miles-engine --max-total-tokens): room for the live contexts of the ~8 sessions one engine serves
when sessions stay put (mean context 2,070 tokens, longest request 9,150) plus running reservations, but not for
the stale copies of all 32 sessions that a scattering policy leaves on every engine."""


CONFIGS = (
    RouterConfig("session_affinity(new_key_placement=prefix)", "miles", "session_affinity", "prefix"),
    RouterConfig("session_affinity(new_key_placement=least_load)", "miles", "session_affinity", "least_load"),
    RouterConfig("cache_aware", "miles", "cache_aware"),
    RouterConfig("least_load", "miles", "least_load"),
    RouterConfig("round_robin", "miles", "round_robin"),
    RouterConfig("smg_cache_aware", "smg", "cache_aware"),
    RouterConfig("smg_consistent_hashing", "smg", "consistent_hashing"),
)
EXTRA_CONFIGS = (  # not in the default run (time): --only 'session_affinity(new_key_placement=hash)'
    RouterConfig("session_affinity(new_key_placement=hash)", "miles", "session_affinity", "hash"),
)


@dataclass
class RunResult:
    name: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    hit_ratio_of_max: float
    wall_s: float
    requests_per_s: float
    prompt_tokens_per_s: float
    p99_queue_wait_s: float
    p99_latency_s: float
    median_latency_s: float
    evicted_tokens: int
    requests_per_engine: list[int]


# --- the replay ------------------------------------------------------------------------------------------------------
@dataclass
class Tally:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    latencies_s: list[float] | None = None


def episode_inputs(workload: Workload, episode: Episode) -> list[list[int]]:
    """Token ids appended before each turn (the first prompt, then each tool output); built once per run."""
    return [workload.first_prompt(episode.group)] + [tool_tokens(episode, i) for i in range(1, len(episode.turns))]


async def run_episode(client: httpx.AsyncClient, episode: Episode, inputs: list[list[int]], tally: Tally) -> None:
    # The JSON text of input_ids grows by each turn's new ids instead of being re-encoded: the client stays cheap.
    ids_text = ""
    headers = {"X-SMG-Routing-Key": episode.episode_id, "Content-Type": "application/json"}
    for index, turn in enumerate(episode.turns):
        ids_text = _extend(ids_text, inputs[index])
        sampling = {
            "max_new_tokens": turn.max_new_tokens,
            "temperature": 1.0,
            "sampling_seed": episode.seed,
            "ignore_eos": True,
        }
        body = '{"input_ids": [' + ids_text + '], "sampling_params": ' + json.dumps(sampling) + "}"
        started_s = time.perf_counter()
        response = await client.post("/generate", content=body.encode(), headers=headers)
        if response.status_code != 200:
            raise RuntimeError(f"{episode.episode_id} turn {index}: HTTP {response.status_code} {response.text[:300]}")
        answer = response.json()
        assert tally.latencies_s is not None
        tally.latencies_s.append(time.perf_counter() - started_s)
        meta = answer["meta_info"]
        tally.requests += 1
        tally.prompt_tokens += meta["prompt_tokens"]
        tally.cached_tokens += meta["cached_tokens"]
        ids_text = _extend(ids_text, answer["output_ids"])


def _extend(ids_text: str, token_ids: list[int]) -> str:
    if not token_ids:
        return ids_text
    more = ",".join(map(str, token_ids))
    return f"{ids_text},{more}" if ids_text else more


async def replay(router_url: str, episodes: list[tuple[Episode, list[list[int]]]]) -> tuple[Tally, float]:
    queue: asyncio.Queue[tuple[Episode, list[list[int]]]] = asyncio.Queue()
    for item in episodes:
        queue.put_nowait(item)
    tally = Tally(latencies_s=[])
    # One connection per worker, like one agent per process; one shared httpx pool would scan all of its
    # connections on every request (httpcore 1.0) and cost the client more CPU than the router.
    limits = httpx.Limits(max_connections=1, keepalive_expiry=2.0)
    tls = ssl.create_default_context()  # unused (plain HTTP), but httpx builds one per client unless given

    async def worker() -> None:
        async with httpx.AsyncClient(
            base_url=router_url, timeout=600, limits=limits, trust_env=False, verify=tls
        ) as client:
            while not queue.empty():
                episode, inputs = queue.get_nowait()
                await run_episode(client, episode, inputs, tally)

    started_s = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(EPISODES_IN_FLIGHT)))
    return tally, time.perf_counter() - started_s


def flush_caches(engine_urls: list[str]) -> None:
    for url in engine_urls:
        response = httpx.post(f"{url}/flush_cache", params={"timeout": 60}, timeout=90)
        if response.status_code != 200:
            raise RuntimeError(f"{url} did not flush its cache: {response.text}")


def run_config(
    config: RouterConfig,
    engine_urls: list[str],
    episodes: list[tuple[Episode, list[list[int]]]],
    log_dir: Path,
    max_rate: float,
) -> RunResult:
    flush_caches(engine_urls)
    before = scrape(engine_urls)
    router_url, router = start_router(config, engine_urls, log_dir)
    try:
        tally, wall_s = asyncio.run(replay(router_url, episodes))
    finally:
        router.stop()
    requests, evicted, p99_queue_s = engine_deltas(before, scrape(engine_urls))
    latencies = sorted(tally.latencies_s or [0.0])
    hit_rate = tally.cached_tokens / tally.prompt_tokens
    return RunResult(
        name=config.name,
        requests=tally.requests,
        prompt_tokens=tally.prompt_tokens,
        cached_tokens=tally.cached_tokens,
        hit_rate=hit_rate,
        hit_ratio_of_max=hit_rate / max_rate,
        wall_s=wall_s,
        requests_per_s=tally.requests / wall_s,
        prompt_tokens_per_s=tally.prompt_tokens / wall_s,
        p99_queue_wait_s=p99_queue_s,
        p99_latency_s=latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        median_latency_s=statistics.median(latencies),
        evicted_tokens=evicted,
        requests_per_engine=requests,
    )


# --- report ----------------------------------------------------------------------------------------------------------
def line(result: RunResult) -> str:
    return (
        f"{result.name:<48} hit_rate={result.hit_rate:.4f} hit_ratio_of_max={result.hit_ratio_of_max:.4f} "
        f"req/s={result.requests_per_s:6.1f} p99_queue_wait_s={result.p99_queue_wait_s:.3f} "
        f"p99_latency_s={result.p99_latency_s:.3f} evicted_tokens={result.evicted_tokens} "
        f"per_engine={result.requests_per_engine} max_over_min={load_max_over_min(result):.2f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated configuration names (default: all)")
    parser.add_argument("--kv-budget-tokens", type=int, default=KV_BUDGET_TOKENS)
    args = parser.parse_args(argv)
    wanted = args.only.split(",") if args.only else None
    configs = [c for c in (*CONFIGS, *EXTRA_CONFIGS) if (c.name in wanted if wanted else c in CONFIGS)]
    workload = workload_module.load()
    max_cached, total_prompt = workload_module.max_cached_tokens(workload)
    max_rate = max_cached / total_prompt
    num_turns = sum(len(e.turns) for e in workload.episodes)
    print(
        f"workload: {len(workload.episodes)} episodes, {num_turns} turns, {total_prompt} prompt tokens; "
        f"theoretical max hit rate {max_rate:.4f}"
    )
    print(
        f"engines: {NUM_ENGINES} x miles-engine --fake-model, KV budget {args.kv_budget_tokens} tokens per engine "
        f"(--max-total-tokens), {EPISODES_IN_FLIGHT} episodes in flight"
    )
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = write_fake_model_dir(Path(scratch) / "model")
        log_dir = Path(scratch) / "logs"
        engines = start_engines(model_dir, log_dir, args.kv_budget_tokens, NUM_ENGINES)
        try:
            engine_urls = [url for url, _ in engines]
            episodes = [(episode, episode_inputs(workload, episode)) for episode in workload.episodes]
            for config in configs:
                result = run_config(config, engine_urls, episodes, log_dir, max_rate)
                if result.prompt_tokens != total_prompt:
                    raise RuntimeError(f"{config.name}: {result.prompt_tokens} prompt tokens, trace has {total_prompt}")
                results.append(result)
                print(line(result), flush=True)
        finally:
            for _, process in engines:
                process.stop()
    if args.only or args.kv_budget_tokens != KV_BUDGET_TOKENS:
        print(f"partial or non-default run: {RESULTS.relative_to(REPO)} left as it was")
    else:
        write_results(results, args.kv_budget_tokens, max_rate, total_prompt, max_cached, num_turns)
        print(f"written to {RESULTS.relative_to(REPO)}")
    print_summary(results)


DEFAULT_CONFIG = CONFIGS[0].name
"""What the router does with default settings (policy session_affinity, new_key_placement prefix)."""
HIT_RATIO_GOAL = 0.995
LOAD_MAX_OVER_MIN_GOAL = 1.5
MEDIAN_LATENCY_OVER_SMG_GOAL = 2.0


def load_max_over_min(result: RunResult) -> float:
    """Requests of the busiest engine over the idlest one's (inf when one got none)."""
    return (
        max(result.requests_per_engine) / min(result.requests_per_engine)
        if min(result.requests_per_engine)
        else float("inf")
    )


def print_summary(results: list[RunResult]) -> None:
    """The goal check of the default settings and, last, `best_policy=<p> hit_ratio_of_max=<x> smg_cache_aware=<y>`.

    Latency: the bench has no direct-to-engine baseline (a session's engine decides its cache and so its latency),
    so the router's own cost is compared as end-to-end median latency against smg's best policy, not as added
    latency."""
    by_name = {r.name: r for r in results}
    ours = [r for r in results if not r.name.startswith("smg_")]
    smg = [r for r in results if r.name.startswith("smg_")]
    default = by_name.get(DEFAULT_CONFIG)
    if default is not None and smg:
        smg_best = max(smg, key=lambda r: r.hit_ratio_of_max)
        balance = load_max_over_min(default)
        latency_ratio = default.median_latency_s / smg_best.median_latency_s
        checks = {
            f"hit_ratio_of_max >= {HIT_RATIO_GOAL} and >= smg's best ({smg_best.hit_ratio_of_max:.4f})": (
                default.hit_ratio_of_max >= max(HIT_RATIO_GOAL, smg_best.hit_ratio_of_max)
            ),
            f"max/min engine load {balance:.2f} <= {LOAD_MAX_OVER_MIN_GOAL}": balance <= LOAD_MAX_OVER_MIN_GOAL,
            f"median latency {latency_ratio:.2f}x smg's best <= {MEDIAN_LATENCY_OVER_SMG_GOAL}": (
                latency_ratio <= MEDIAN_LATENCY_OVER_SMG_GOAL
            ),
        }
        for text, met in checks.items():
            print(
                f"goal default ({default.name}, {default.hit_ratio_of_max:.4f}): {text}: {'met' if met else 'NOT met'}"
            )
    if ours:
        best = max(ours, key=lambda r: r.hit_ratio_of_max)
        smg_cache_aware = by_name.get("smg_cache_aware")
        smg_text = f"{smg_cache_aware.hit_ratio_of_max:.4f}" if smg_cache_aware else "n/a"
        print(f"best_policy={best.name} hit_ratio_of_max={best.hit_ratio_of_max:.4f} smg_cache_aware={smg_text}")


def write_results(
    results: list[RunResult], kv_budget: int, max_rate: float, total_prompt: int, max_cached: int, num_turns: int
) -> None:
    payload: dict[str, Any] = {
        "benchmark": "rollout-router: prefix-cache hit rate of a multi-turn agent workload per routing policy",
        "workload": {
            "file": "bench/data/router_workload.json",
            "turns": num_turns,
            "prompt_tokens": total_prompt,
            "max_cached_tokens": max_cached,
            "max_hit_rate": max_rate,
        },
        "engines": NUM_ENGINES,
        "kv_budget_tokens_per_engine": kv_budget,
        "episodes_in_flight": EPISODES_IN_FLIGHT,
        "prefill_token_cost_s": PREFILL_TOKEN_COST_S,
        "decode_token_cost_s": DECODE_TOKEN_COST_S,
        "results": [asdict(r) | {"load_max_over_min": round(load_max_over_min(r), 3)} for r in results],
        "smg_version": importlib.metadata.version("smg"),
        "machine": describe_machine(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
