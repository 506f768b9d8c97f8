"""Benchmark of the sandbox-gateway (local bubblewrap backend): exec latency with and without a warm pool.

Two real `miles-sandbox-gateway` processes run side by side, one with the warm pool off and one with it on.
For each it measures, over gRPC:
- Create alone, and time to first result: Create + the first Exec of `true` in the new sandbox (what an agent
  waits for when it starts an episode; the warm pool hides the sandbox's start-up),
- steady exec latency: `true` in an existing sandbox, one after another,
- 100 concurrent execs of `echo` spread over 10 sandboxes: latency of each and how many succeeded.
Prints p50/p99 and the cold/warm ratio; writes bench/results/sandbox.json.

Run: make bench-sandbox (needs bubblewrap, like the tests).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.machine import describe_machine
from miles.common.testing.smoke import console_script
from miles.proto.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc

NUM_FIRST_EXECS = 30
NUM_STEADY_EXECS = 100
NUM_CONCURRENT_EXECS = 100
NUM_CONCURRENT_SANDBOXES = 10
WARM_POOL_SIZE = 8
RESULTS = Path(__file__).parent / "results" / "sandbox.json"


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def summary_ms(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(percentile(values, 0.5) * 1000, 2),
        "p99_ms": round(percentile(values, 0.99) * 1000, 2),
        "mean_ms": round(statistics.fmean(values) * 1000, 2),
        "n": len(values),
    }


def start_gateway(work_dir: Path, warm_pool_size: int) -> tuple[ServiceProcess, str]:
    port, http_port = free_port(), free_port()
    env = {
        "MILES_SANDBOX_PORT": str(port),
        "MILES_SANDBOX_METRICS_PORT": str(http_port),
        "MILES_SANDBOX_WARM_POOL_SIZE": str(warm_pool_size),
        "MILES_SANDBOX_STATE_DIR": str(work_dir / "state"),
        "MILES_SANDBOX_LOG_LEVEL": "WARNING",
    }
    process = ServiceProcess(
        [console_script("miles-sandbox-gateway")],
        ready_url=f"http://127.0.0.1:{http_port}/readyz",
        env=env,
        log_path=work_dir / "gateway.log",
    ).start()
    return process, f"127.0.0.1:{port}"


async def exec_once(stub: sandbox_pb2_grpc.SandboxServiceStub, sandbox_id: str, argv: list[str]) -> int:
    request = sandbox_pb2.ExecRequest(sandbox_id=sandbox_id, timeout_s=60)
    request.argv.args.extend(argv)
    exit_code = -1
    async for event in stub.Exec(request, timeout=120):
        if event.HasField("result"):
            exit_code = event.result.exit_code
    return exit_code


async def time_to_first_result(stub: sandbox_pb2_grpc.SandboxServiceStub) -> tuple[list[float], list[float], int]:
    create_latencies, latencies, num_warm = [], [], 0
    for _ in range(NUM_FIRST_EXECS):
        start_s = time.perf_counter()
        created = await stub.Create(sandbox_pb2.CreateRequest(job_id="bench"))
        create_latencies.append(time.perf_counter() - start_s)
        assert await exec_once(stub, created.sandbox_id, ["true"]) == 0
        latencies.append(time.perf_counter() - start_s)
        num_warm += created.warm
        await stub.Destroy(sandbox_pb2.DestroyRequest(sandbox_id=created.sandbox_id))
        await asyncio.sleep(0.05)  # an agent thinks between episodes; the pool refills meanwhile
    return create_latencies, latencies, num_warm


async def steady_execs(stub: sandbox_pb2_grpc.SandboxServiceStub) -> list[float]:
    sandbox_id = (await stub.Create(sandbox_pb2.CreateRequest(job_id="bench"))).sandbox_id
    latencies = []
    for _ in range(NUM_STEADY_EXECS):
        start_s = time.perf_counter()
        assert await exec_once(stub, sandbox_id, ["true"]) == 0
        latencies.append(time.perf_counter() - start_s)
    await stub.Destroy(sandbox_pb2.DestroyRequest(sandbox_id=sandbox_id))
    return latencies


async def concurrent_execs(stub: sandbox_pb2_grpc.SandboxServiceStub) -> tuple[list[float], int, float]:
    sandboxes = [
        (await stub.Create(sandbox_pb2.CreateRequest(job_id="bench"))).sandbox_id
        for _ in range(NUM_CONCURRENT_SANDBOXES)
    ]

    async def one(index: int) -> tuple[float, bool]:
        start_s = time.perf_counter()
        ok = await exec_once(stub, sandboxes[index % len(sandboxes)], ["echo", str(index)]) == 0
        return time.perf_counter() - start_s, ok

    start_s = time.perf_counter()
    results = await asyncio.gather(*(one(index) for index in range(NUM_CONCURRENT_EXECS)))
    total_s = time.perf_counter() - start_s
    for sandbox_id in sandboxes:
        await stub.Destroy(sandbox_pb2.DestroyRequest(sandbox_id=sandbox_id))
    return [latency for latency, _ in results], sum(ok for _, ok in results), total_s


async def measure(target: str) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)  # type: ignore[no-untyped-call]
        await asyncio.sleep(1.0)  # let the pool (if any) fill after start-up
        create, first, num_warm = await time_to_first_result(stub)
        steady = await steady_execs(stub)
        concurrent, num_ok, total_s = await concurrent_execs(stub)
    return {
        "create": summary_ms(create),
        "create_plus_first_exec": {**summary_ms(first), "served_warm": num_warm},
        "steady_exec": summary_ms(steady),
        "concurrent_execs": {
            **summary_ms(concurrent),
            "succeeded": num_ok,
            "of": NUM_CONCURRENT_EXECS,
            "wall_s": round(total_s, 3),
        },
    }


def report_line(name: str, entry: dict[str, Any]) -> str:
    create, first = entry["create"], entry["create_plus_first_exec"]
    steady, concurrent = entry["steady_exec"], entry["concurrent_execs"]
    return (
        f"{name:13s} Create p50 {create['p50_ms']:6.1f} ms"
        f" | Create+first exec p50 {first['p50_ms']:6.1f} ms p99 {first['p99_ms']:6.1f} ms"
        f" ({first['served_warm']}/{first['n']} warm)"
        f" | steady exec p50 {steady['p50_ms']:5.1f} ms p99 {steady['p99_ms']:5.1f} ms"
        f" | {concurrent['of']} concurrent: {concurrent['succeeded']} ok,"
        f" p50 {concurrent['p50_ms']:6.1f} ms p99 {concurrent['p99_ms']:6.1f} ms"
    )


def main() -> int:
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="miles-bench-sandbox-") as tmp:
        for name, pool_size in (("no_warm_pool", 0), ("warm_pool", WARM_POOL_SIZE)):
            work_dir = Path(tmp) / name
            work_dir.mkdir()
            process, target = start_gateway(work_dir, pool_size)
            try:
                runs[name] = {"warm_pool_size": pool_size, **asyncio.run(measure(target))}
            finally:
                process.stop()
    cold, warm = runs["no_warm_pool"], runs["warm_pool"]
    results: dict[str, Any] = {
        **runs,
        "machine": describe_machine(),
        "create_cold_over_warm_p50_ratio": round(cold["create"]["p50_ms"] / warm["create"]["p50_ms"], 1),
        "first_result_cold_over_warm_p50_ratio": round(
            cold["create_plus_first_exec"]["p50_ms"] / warm["create_plus_first_exec"]["p50_ms"], 2
        ),
    }
    for name, entry in runs.items():
        print(report_line(name, entry))
    print(f"cold / warm Create (p50): {results['create_cold_over_warm_p50_ratio']}x")
    print(f"cold / warm Create + first exec (p50): {results['first_result_cold_over_warm_p50_ratio']}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    all_ok = all(entry["concurrent_execs"]["succeeded"] == NUM_CONCURRENT_EXECS for entry in runs.values())
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
