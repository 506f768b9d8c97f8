"""Buffer throughput: push + pull + ack of groups of 8 samples x 4K tokens through a real miles-buffer, next to a
raw redis-py pipeline moving the same bytes through the same kind of Redis in the same run.

Both sides run against their own fresh redis-server (AOF on, appendfsync everysec: the production default).
The buffer side: producers push every group concurrently while one trainer-like consumer pulls batches of 8 and
acks them, all through `miles.buffer.client` over gRPC (validation, Lua transitions, leases, metrics included).
The raw side: the same serialized groups, HSET + RPUSH in pipelines of 8, then LPOP 8 + HGET + HDEL in pipelines
(no validation, no leases, no idempotency: the floor the buffer's bookkeeping sits on). For context a third
side moves the same bytes through a bare grpc.aio server in its own process (no protobuf, no Redis): the floor
of Python gRPC transport alone. Best of --rounds each, interleaved.
Prints `buffer_vs_raw_redis=<ratio>` (buffer groups/s over raw groups/s) and `buffer_vs_grpc_floor=<ratio>`,
and writes bench/results/buffer.json.

Run: make bench-buffer   (or: .venv/bin/python bench/buffer.py [--groups N] [--rounds R])
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import tempfile
import time
from pathlib import Path

import redis

from miles.buffer.client import ACCEPTED_OUTCOMES, BufferClient
from miles.common.testing import RedisServer, ServiceProcess, free_port
from miles.common.testing.machine import describe_machine
from miles.common.testing.smoke import console_script
from miles.proto.common.v1 import common_pb2

SAMPLES_PER_GROUP = 8
TOKENS_PER_SAMPLE = 4096
PROMPT_TOKENS = 1024
PULL_BATCH_GROUPS = 8
NUM_PRODUCERS = 4
RESULTS_PATH = Path(__file__).resolve().parent / "results" / "buffer.json"


def build_groups(num_groups: int, seed: int = 0) -> list[common_pb2.Group]:
    """Realistic groups: random Qwen-sized token ids, mask of ones, random logprobs, one weight span."""
    rng = random.Random(seed)
    num_response = TOKENS_PER_SAMPLE - PROMPT_TOKENS
    prompt = [rng.randrange(151_000) for _ in range(PROMPT_TOKENS)]
    groups = []
    for index in range(num_groups):
        group = common_pb2.Group(group_id=f"bench-{index}", prompt_index=index)
        for sample_index in range(SAMPLES_PER_GROUP):
            sample = group.samples.add(
                sample_id=f"bench-{index}/{sample_index}",
                tokens=prompt + [rng.randrange(151_000) for _ in range(num_response)],
                response_start=PROMPT_TOKENS,
                loss_mask=[1] * num_response,
                rollout_logprobs=[-rng.random() * 5 for _ in range(num_response)],
                reward=float(sample_index % 2),
                status=common_pb2.SAMPLE_STATUS_COMPLETED,
            )
            sample.weight_versions.add(start=0, end=num_response, weight_version=0)
        groups.append(group)
    return groups


async def run_buffer(target: str, groups: list[common_pb2.Group], job_id: str) -> float:
    """Seconds from the first push to the last ack."""
    async with BufferClient(target) as admin:
        await admin.configure_job(job_id, capacity_groups=len(groups))

    async def produce(shard: list[common_pb2.Group]) -> None:
        async with BufferClient(target) as client:
            for group in shard:
                response = await client.push_group(job_id, group)
                assert response.outcome in ACCEPTED_OUTCOMES

    async def consume() -> None:
        acked = 0
        async with BufferClient(target) as client:
            while acked < len(groups):
                batch = await client.pull_batch(
                    job_id, num_groups=PULL_BATCH_GROUPS, trainer_version=0, max_staleness=0, lease_s=60, wait_s=5
                )
                response = await client.ack(job_id, [leased.lease_id for leased in batch.groups])
                acked += response.num_acked

    start_s = time.perf_counter()
    shards = [groups[index::NUM_PRODUCERS] for index in range(NUM_PRODUCERS)]
    await asyncio.gather(consume(), *(produce(shard) for shard in shards))
    return time.perf_counter() - start_s


def _serve_grpc_floor(port: int) -> None:
    """A bare grpc.aio server in its own process: Push stores request bytes, Pull returns up to 8 of them."""
    import collections

    import grpc

    async def serve() -> None:
        queue: collections.deque[bytes] = collections.deque()

        async def push(request: bytes, context: object) -> bytes:
            queue.append(request)
            return b""

        async def pull(request: bytes, context: object) -> bytes:
            batch = [queue.popleft() for _ in range(min(PULL_BATCH_GROUPS, len(queue)))]
            return b"".join(batch)

        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 1 << 28)])
        handlers = {
            "Push": grpc.unary_unary_rpc_method_handler(push),
            "Pull": grpc.unary_unary_rpc_method_handler(pull),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Floor", handlers),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


async def run_grpc_floor(target: str, payloads: list[tuple[str, bytes]]) -> float:
    """Seconds to move the same bytes through bare gRPC (no protobuf parsing, no Redis): the transport floor."""
    import grpc

    options = [("grpc.max_receive_message_length", 1 << 28)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        push, pull = channel.unary_unary("/bench.Floor/Push"), channel.unary_unary("/bench.Floor/Pull")
        await push(b"warm-up")
        await pull(b"")
        start_s = time.perf_counter()

        async def produce(shard: list[bytes]) -> None:
            for payload in shard:
                await push(payload)

        async def consume() -> None:
            received = 0
            while received < sum(len(payload) for _, payload in payloads):
                received += len(await pull(b""))

        shards = [[payload for _, payload in payloads[index::NUM_PRODUCERS]] for index in range(NUM_PRODUCERS)]
        await asyncio.gather(consume(), *(produce(shard) for shard in shards))
        return time.perf_counter() - start_s


def run_raw(url: str, payloads: list[tuple[str, bytes]], round_index: int) -> float:
    """Seconds to move the same bytes in and out of Redis with plain pipelines (HSET+RPUSH, LPOP+HGET+HDEL)."""
    client = redis.Redis.from_url(url)
    data_key, queue_key = f"raw:{round_index}:data", f"raw:{round_index}:queue"
    start_s = time.perf_counter()
    for offset in range(0, len(payloads), PULL_BATCH_GROUPS):
        with client.pipeline(transaction=False) as pipe:
            for group_id, payload in payloads[offset : offset + PULL_BATCH_GROUPS]:
                pipe.hset(data_key, group_id, payload)
                pipe.rpush(queue_key, group_id)
            pipe.execute()
    moved = 0
    while moved < len(payloads):
        group_ids = client.lpop(queue_key, PULL_BATCH_GROUPS) or []
        with client.pipeline(transaction=False) as pipe:
            for group_id in group_ids:
                pipe.hget(data_key, group_id)
            fetched = pipe.execute()
        assert all(fetched)
        client.hdel(data_key, *group_ids)
        moved += len(group_ids)
    elapsed_s = time.perf_counter() - start_s
    client.close()
    return elapsed_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=200, help="groups moved per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per side (best is kept)")
    args = parser.parse_args()

    groups = build_groups(args.groups)
    payloads = [(group.group_id, group.SerializeToString()) for group in groups]
    total_bytes = sum(len(payload) for _, payload in payloads)
    with tempfile.TemporaryDirectory(prefix="bench-buffer-") as tmp:
        buffer_redis = RedisServer(Path(tmp) / "redis-buffer", free_port())
        raw_redis = RedisServer(Path(tmp) / "redis-raw", free_port())
        buffer_redis.start()
        raw_redis.start()
        port, metrics_port = free_port(), free_port()
        env = {
            "MILES_BUFFER_REDIS_URL": buffer_redis.url,
            "MILES_BUFFER_PORT": str(port),
            "MILES_BUFFER_METRICS_PORT": str(metrics_port),
            "MILES_BUFFER_LOG_LEVEL": "WARNING",
        }
        service = ServiceProcess(
            [console_script("miles-buffer")],
            ready_url=f"http://127.0.0.1:{metrics_port}/readyz",
            env=env,
            log_path=Path(tmp) / "miles-buffer.log",
        )
        floor_port = free_port()
        floor = multiprocessing.get_context("spawn").Process(target=_serve_grpc_floor, args=(floor_port,), daemon=True)
        try:
            service.start()
            floor.start()
            buffer_times, raw_times, floor_times = [], [], []
            for round_index in range(args.rounds):
                buffer_times.append(asyncio.run(run_buffer(f"127.0.0.1:{port}", groups, f"bench-{round_index}")))
                raw_times.append(run_raw(raw_redis.url, payloads, round_index))
                floor_times.append(asyncio.run(run_grpc_floor(f"127.0.0.1:{floor_port}", payloads)))
        finally:
            floor.terminate()
            service.stop()
            buffer_redis.stop()
            raw_redis.stop()

    def side(seconds: list[float]) -> dict[str, float]:
        best_s = min(seconds)
        return {
            "best_seconds": round(best_s, 4),
            "all_seconds": [round(s, 4) for s in seconds],
            "groups_per_s": round(args.groups / best_s, 2),
            "mb_per_s": round(total_bytes / best_s / 1e6, 2),
        }

    buffer_side, raw_side, floor_side = side(buffer_times), side(raw_times), side(floor_times)
    ratio = buffer_side["groups_per_s"] / raw_side["groups_per_s"]
    floor_ratio = buffer_side["groups_per_s"] / floor_side["groups_per_s"]
    result = {
        "what": "push + pull + ack of groups of 8 samples x 4096 tokens (1024 prompt + 3072 response)",
        "num_groups": args.groups,
        "rounds": args.rounds,
        "group_bytes": round(total_bytes / args.groups),
        "total_mb": round(total_bytes / 1e6, 2),
        "buffer": buffer_side,
        "raw_redis_pipeline": raw_side,
        "grpc_floor": floor_side,
        "buffer_vs_raw_redis": round(ratio, 4),
        "buffer_vs_grpc_floor": round(floor_ratio, 4),
        "redis": "redis-server, appendonly yes, appendfsync everysec (one per side)",
        "machine": describe_machine(),
    }
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"buffer: {buffer_side['groups_per_s']} groups/s, {buffer_side['mb_per_s']} MB/s | "
        f"raw redis-py pipeline: {raw_side['groups_per_s']} groups/s, {raw_side['mb_per_s']} MB/s | "
        f"bare gRPC floor: {floor_side['groups_per_s']} groups/s | "
        f"{args.groups} groups of {result['group_bytes']} bytes"
    )
    print(f"buffer_vs_grpc_floor={floor_ratio:.4f}")
    print(f"buffer_vs_raw_redis={ratio:.4f}")


if __name__ == "__main__":
    main()
