"""make bench-weightsync: how small are lossless deltas, and how fast is the stream transport?

(a) Delta ratio = stored delta bytes / full bytes, in the engine dtype (bfloat16), with weight-sync's own encoder
    (`miles.weightsync.weights.encode_version`: per tensor the smallest of sparse-XOR, plane-split XOR and full,
    zstd level 1 — exactly what the daemon stores):
    - the tiny Qwen3 model (~10M parameters) taking real AdamW steps (float32 master weights, next-token loss on
      random token sequences) at lr 1e-6 and 1e-5; the median over the measured steps is reported;
    - a synthetic 1B-parameter bf16 set (a Llama-like layout: vocab 128,256 x hidden 2,048, 16 layers, MLP 5,632;
      N(0, 0.02) weights, norms 1) updated by AdamW-like steps (torch AdamW arithmetic, betas 0.9/0.999,
      weight decay 0.01, random N(0, 1e-3) gradients, 3 steps, the last one measured). To keep memory and time
      sane on a 2-core 24 GB box it is processed tensor by tensor, and tensors above 16M elements in row blocks of
      at most 16M elements, each block generated, stepped, encoded and dropped before the next (peak ~0.4 GB).
(b) Stream throughput over loopback: a real miles-weight-sync daemon (its own process) holds a published version;
    this process fetches it the way the stream transport does — OpenDataChannel over gRPC, then `--streams` raw
    TCP connections that the daemon fills with `sendall` from the stored bytes and this side `recv_into`s into
    the tensors' buffers — next to a raw TCP socket served by another process moving the same number of bytes
    into a preallocated buffer, interleaved (per round: stream, raw, ..., raw, stream), best of each.
    `stream_vs_raw_tcp` compares the transport alone (the negotiation RPC, connecting, and every tensor received
    into preallocated buffers, as the raw side receives into its preallocated buffer; `stream_one_connection_*`
    the same over a single connection; `stream_vs_raw_tcp_paired_median` the median over the back-to-back
    stream/raw pairs, steadier than best-of when other work loads the box);
    `stream_verified_vs_raw_tcp` times the daemon client's full path (`DaemonClient.fetch_full`: fresh buffers
    per tensor + sha256 of every tensor) against the same raw socket. For context: the former gRPC data path
    (FetchWeights, hand-encoded chunks, the fallback when no data channel can be set up) into a preallocated
    buffer (`grpc_stream_vs_raw_tcp`), and a bare grpc.aio server in its own process (cached messages, no
    interceptors) to a client that discards them: the floor of Python gRPC itself (`grpc_floor_vs_raw_tcp`).

Prints `delta_ratio lr=1e-6 <x>` and `stream_vs_raw_tcp <y>` (goals: <= 0.012 and >= 0.8) and writes
bench/results/weightsync.json.

Run: make bench-weightsync   (or: .venv/bin/python bench/weightsync.py [--skip-1b] [--stream-only] [--stream-mb N]
[--rounds R] [--streams S]; --stream-only runs (b) alone and replaces only the "stream" part of the results file)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from miles.common.testing import ServiceProcess, free_port, wait_for_http_ready
from miles.common.testing.smoke import console_script
from miles.weightsync.delta import encode_delta
from miles.weightsync.manifest import TensorSpec
from miles.weightsync.memory import tune_malloc_for_streaming
from miles.weightsync.weights import WeightSet, encode_version, sha256_hex

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "weightsync.json"
BLOCK_ELEMENTS = 16 << 20


# --- (a) delta ratios --------------------------------------------------------------------------------------------
def _model_dir(scratch: Path) -> Path:
    made = REPO / ".miles" / "models" / "tiny-qwen3"
    if (made / "config.json").is_file():
        return made
    from miles.engine.tiny_model import build_tiny_model

    return build_tiny_model(scratch / "tiny-qwen3")


def _bf16_weights(model: torch.nn.Module, version: int) -> WeightSet:
    specs, data = [], {}
    for name, param in model.named_parameters():
        raw = param.detach().to(torch.bfloat16).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        specs.append(TensorSpec(name, "bfloat16", tuple(param.shape), sha256_hex(raw)))
        data[name] = raw
    return WeightSet(version, tuple(specs), data)


def tiny_model_deltas(model_dir: Path, lr: float, num_steps: int) -> dict[str, Any]:
    """Real AdamW steps of the tiny model; the stored delta of each step against the previous version."""
    from miles.model import load_model, sequence_logprobs

    model = load_model(model_dir)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(0)
    previous = _bf16_weights(model, 0)
    ratios, changed = [], []
    for step in range(1, num_steps + 1):
        ids = torch.randint(0, model.config.vocab_size, (64,), generator=generator)
        loss = -sequence_logprobs(model, ids, start=1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        current = _bf16_weights(model, step)
        stored, _ = encode_version(current.specs, current.data, previous, snapshot=False, level=1)
        ratios.append(sum(t.stored_bytes for t in stored) / current.full_bytes)
        changed.append(sum(t.num_changed for t in stored) / sum(s.num_elements for s in current.specs))
        previous = current
    return {
        "lr": lr,
        "num_parameters": sum(s.num_elements for s in previous.specs),
        "full_bytes": previous.full_bytes,
        "delta_ratio_per_step": ratios,
        "changed_elements_per_step": changed,
        "delta_ratio_median": statistics.median(ratios),
    }


def _synthetic_layout() -> list[tuple[str, tuple[int, int]]]:
    hidden, kv, mlp, vocab = 2048, 512, 5632, 128256
    layout: list[tuple[str, tuple[int, int]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for layer in range(16):
        prefix = f"model.layers.{layer}"
        layout += [
            (f"{prefix}.self_attn.q_proj.weight", (hidden, hidden)),
            (f"{prefix}.self_attn.k_proj.weight", (kv, hidden)),
            (f"{prefix}.self_attn.v_proj.weight", (kv, hidden)),
            (f"{prefix}.self_attn.o_proj.weight", (hidden, hidden)),
            (f"{prefix}.mlp.gate_proj.weight", (mlp, hidden)),
            (f"{prefix}.mlp.up_proj.weight", (mlp, hidden)),
            (f"{prefix}.mlp.down_proj.weight", (hidden, mlp)),
            (f"{prefix}.input_layernorm.weight", (1, hidden)),
            (f"{prefix}.post_attention_layernorm.weight", (1, hidden)),
        ]
    return [*layout, ("model.norm.weight", (1, hidden))]


def _adamw_block(rows: int, cols: int, is_norm: bool, lr: float, seed: int, num_steps: int) -> tuple[bytes, bytes]:
    """bf16 bytes of one block before and after the last of num_steps AdamW steps (torch's AdamW arithmetic)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.ones(rows, cols) if is_norm else torch.randn(rows, cols, generator=generator).mul_(0.02)
    exp_avg, exp_avg_sq = torch.zeros_like(weight), torch.zeros_like(weight)
    beta1, beta2, eps, weight_decay = 0.9, 0.999, 1e-8, 0.01
    before = b""
    for step in range(1, num_steps + 1):
        if step == num_steps:
            before = weight.to(torch.bfloat16).reshape(-1).view(torch.uint8).numpy().tobytes()
        grad = torch.randn(rows, cols, generator=generator).mul_(1e-3)
        weight.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(eps)
        weight.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
        del grad, denom
    after = weight.to(torch.bfloat16).reshape(-1).view(torch.uint8).numpy().tobytes()
    return before, after


def synthetic_1b_delta(lr: float, num_steps: int = 3) -> dict[str, Any]:
    full_bytes = stored_bytes = num_elements = num_changed = 0
    start_s = time.perf_counter()
    for index, (name, (rows, cols)) in enumerate(_synthetic_layout()):
        block_rows = max(1, BLOCK_ELEMENTS // cols)
        for block, row in enumerate(range(0, rows, block_rows)):
            height = min(block_rows, rows - row)
            before, after = _adamw_block(height, cols, "norm" in name, lr, index * 1000 + block, num_steps)
            encoded = encode_delta(before, after, 2, level=1)
            full_bytes += len(after)
            stored_bytes += len(encoded.blob)
            num_elements += height * cols
            num_changed += encoded.num_changed
    return {
        "lr": lr,
        "num_parameters": num_elements,
        "full_bytes": full_bytes,
        "stored_bytes": stored_bytes,
        "delta_ratio": stored_bytes / full_bytes,
        "changed_elements": num_changed / num_elements,
        "adamw_steps": num_steps,
        "seconds": time.perf_counter() - start_s,
    }


# --- (b) stream vs raw TCP ---------------------------------------------------------------------------------------
def _raw_sender(port: int, total_bytes: int, ready: Any, rounds: int) -> None:
    payload = os.urandom(total_bytes)
    listener = socket.create_server(("127.0.0.1", port))
    ready.set()
    for _ in range(rounds):
        connection, _ = listener.accept()
        with connection:
            connection.sendall(payload)
    listener.close()


def _raw_receive(port: int, total_bytes: int) -> float:
    buffer = bytearray(total_bytes)
    view = memoryview(buffer)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        start_s = time.perf_counter()
        received = 0
        while received < total_bytes:
            num = sock.recv_into(view[received:], min(total_bytes - received, 4 << 20))
            if num == 0:
                raise ConnectionError("raw sender closed early")
            received += num
        return time.perf_counter() - start_s


async def _stream_transport_only(address: str, job_id: str, version: int, streams: int, total: int) -> float:
    """FetchWeights with the daemon's decoding, chunks placed into one buffer (no assembly, no hashing)."""
    from miles.common.grpc_client import create_channel
    from miles.proto.weightsync.v1 import weightsync_pb2 as pb
    from miles.weightsync.daemon_client import FETCH_WEIGHTS_METHOD, SERVICE_NAME
    from miles.weightsync.wire import decode_chunk

    buffer = bytearray(total)
    view = memoryview(buffer)
    channel = create_channel(address, service_names=[SERVICE_NAME])
    call = channel.unary_stream(
        FETCH_WEIGHTS_METHOD, request_serializer=pb.FetchWeightsRequest.SerializeToString, response_deserializer=None
    )
    await channel.channel_ready()
    tensor_base: list[int] = []

    async def one(shard: int) -> None:
        request = pb.FetchWeightsRequest(job_id=job_id, version=version, num_shards=streams, shard_index=shard)
        async for raw in call(request):
            chunk = decode_chunk(raw)
            if chunk is None:  # header or commit
                message = pb.PublishWeightsChunk.FromString(raw)
                if message.WhichOneof("payload") == "header" and not tensor_base:
                    sizes = [2 * int(torch.tensor(list(t.shape)).prod()) for t in message.header.tensors]
                    tensor_base.extend(sum(sizes[:i]) for i in range(len(sizes)))
                continue
            index, offset, data = chunk
            start = tensor_base[index] + offset
            view[start : start + len(data)] = data

    start_s = time.perf_counter()
    await asyncio.gather(*(one(shard) for shard in range(streams)))
    elapsed = time.perf_counter() - start_s
    await channel.close()
    return elapsed


async def _data_channel_only(address: str, job_id: str, version: int, streams: int, total: int) -> float:
    """The stream transport's data path without verification: OpenDataChannel, then every tensor recv_into'd
    straight into its slice of one preallocated buffer (as the raw side does)."""
    from miles.proto.weightsync.v1 import weightsync_pb2 as proto
    from miles.weightsync.daemon_client import DaemonClient, address_host
    from miles.weightsync.receive import DataChannelReceiver
    from miles.weightsync.wire import spec_from_pb

    buffer = bytearray(total)
    view = memoryview(buffer)
    client = DaemonClient(address)
    await client.stub.GetVersion(proto.GetVersionRequest(job_id=job_id))  # connect the channel before timing
    start_s = time.perf_counter()
    offer = await client.stub.OpenDataChannel(
        proto.OpenDataChannelRequest(job_id=job_id, version=version, num_connections=streams)
    )
    specs = [spec_from_pb(spec) for spec in offer.header.tensors]
    receiver = DataChannelReceiver(
        offer.host or address_host(address), offer.port, offer.token, specs, offer.num_connections, 60.0
    )
    buffers, filled = [], 0
    for spec in specs:
        buffers.append(view[filled : filled + spec.num_bytes])
        filled += spec.num_bytes

    def run() -> None:
        receiver.connect()
        receiver.receive(buffers)

    await asyncio.to_thread(run)
    elapsed = time.perf_counter() - start_s
    await client.close()
    return elapsed


def _floor_server(port: int, total_bytes: int, chunk_bytes: int, ready: Any) -> None:
    """A bare grpc.aio server (no interceptors, no weight-sync code) streaming cached, pre-encoded messages."""
    import grpc

    from miles.weightsync.wire import encode_chunk

    tune_malloc_for_streaming()
    payload = os.urandom(chunk_bytes)
    messages = [encode_chunk(0, i * chunk_bytes, payload) for i in range(total_bytes // chunk_bytes)]

    async def fetch(request: Any, context: Any) -> Any:
        for message in messages:
            yield message

    async def serve() -> None:
        options = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]
        server = grpc.aio.server(options=options)
        handler = grpc.unary_stream_rpc_method_handler(fetch, request_deserializer=None, response_serializer=None)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Floor", {"Fetch": handler}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(serve())


async def _floor_receive(port: int) -> float:
    """Receive every message of the bare server and discard it: what Python gRPC itself can move."""
    import grpc

    options = [("grpc.max_receive_message_length", 256 << 20)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        await channel.channel_ready()
        call = channel.unary_stream("/floor.Floor/Fetch", request_serializer=None, response_deserializer=None)
        start_s = time.perf_counter()
        async for _ in call(b""):
            pass
        return time.perf_counter() - start_s


async def _publish_synthetic(address: str, job_id: str, total_bytes: int) -> int:
    from miles.weightsync.client import WeightSyncClient

    tensor_bytes = 64 << 20
    generator = torch.Generator().manual_seed(1)
    tensors = {
        f"w{i}": torch.randint(-(2**15), 2**15, (tensor_bytes // 2,), dtype=torch.int16, generator=generator).view(
            torch.bfloat16
        )
        for i in range(max(1, total_bytes // tensor_bytes))
    }
    async with WeightSyncClient(address) as client:
        result = await client.publish(job_id, 0, -1, tensors, dtype=None)
    return result.full_bytes


def stream_vs_raw(total_mb: int, rounds: int, streams: int, scratch: Path) -> dict[str, Any]:
    tune_malloc_for_streaming()
    port, metrics_port = free_port(), free_port()
    config = {
        "job_id": "bench",
        "port": port,
        "metrics_port": metrics_port,
        "store_dir": str(scratch / "store"),
        "work_dir": str(scratch / "work"),
        "auto_update": False,
        "pause_mode": "abort",
        "log_json": False,
    }
    (scratch / "daemon.json").write_text(json.dumps(config))
    daemon = ServiceProcess(
        [console_script("miles-weight-sync")],
        ready_url=None,
        log_path=scratch / "daemon.log",
        env={"MILES_WEIGHTSYNC_CONFIG_FILE": str(scratch / "daemon.json")},
    ).start()
    try:
        wait_for_http_ready(f"http://127.0.0.1:{metrics_port}/readyz", 120.0, daemon.process)
        address = f"127.0.0.1:{port}"
        total = asyncio.run(_publish_synthetic(address, "bench", total_mb << 20))
        raw_port = free_port()
        ready = multiprocessing.Event()
        sender = multiprocessing.Process(target=_raw_sender, args=(raw_port, total, ready, 2 * rounds))
        sender.start()
        ready.wait()
        floor_port = free_port()
        floor_ready = multiprocessing.Event()
        floor = multiprocessing.Process(target=_floor_server, args=(floor_port, total, 1 << 20, floor_ready))
        floor.start()
        floor_ready.wait()
        stream_s, one_s, verified_s, grpc_s, raw_s, floor_s = [], [], [], [], [], []
        for _ in range(rounds):
            stream_s.append(asyncio.run(_data_channel_only(address, "bench", 0, streams, total)))
            raw_s.append(_raw_receive(raw_port, total))
            one_s.append(asyncio.run(_data_channel_only(address, "bench", 0, 1, total)))
            floor_s.append(asyncio.run(_floor_receive(floor_port)))
            grpc_s.append(asyncio.run(_stream_transport_only(address, "bench", 0, streams, total)))
            verified_s.append(asyncio.run(_verified_fetch(address, streams)))
            raw_s.append(_raw_receive(raw_port, total))
            stream_s.append(asyncio.run(_data_channel_only(address, "bench", 0, streams, total)))
        sender.join(timeout=60)
        floor.terminate()
        floor.join(timeout=30)
    finally:
        daemon.stop()
    best_raw, best_stream, best_verified, best_floor = min(raw_s), min(stream_s), min(verified_s), min(floor_s)
    best_grpc = min(grpc_s)
    return {
        "path": "data channel (OpenDataChannel + raw TCP)",
        "total_bytes": total,
        "rounds": rounds,
        "fetch_streams": streams,
        "stream_s": stream_s,
        "stream_one_connection_s": one_s,
        "stream_verified_s": verified_s,
        "grpc_stream_s": grpc_s,
        "raw_tcp_s": raw_s,
        "grpc_floor_s": floor_s,
        "grpc_floor_gbps": total / best_floor / 1e9,
        "grpc_floor_vs_raw_tcp": best_raw / best_floor,
        "grpc_stream_gbps": total / best_grpc / 1e9,
        "grpc_stream_vs_raw_tcp": best_raw / best_grpc,
        "stream_gbps": total / best_stream / 1e9,
        "stream_verified_gbps": total / best_verified / 1e9,
        "raw_tcp_gbps": total / best_raw / 1e9,
        "stream_vs_raw_tcp": best_raw / best_stream,
        "stream_vs_raw_tcp_paired_median": statistics.median(r / t for r, t in zip(raw_s, stream_s, strict=True)),
        "stream_one_connection_vs_raw_tcp": best_raw / min(one_s),
        "stream_verified_vs_raw_tcp": best_raw / best_verified,
    }


async def _verified_fetch(address: str, streams: int) -> float:
    from miles.weightsync.daemon_client import DaemonClient

    client = DaemonClient(address)
    start_s = time.perf_counter()
    _, path = await client.fetch_full("bench", 0, num_connections=streams, chunk_bytes=1 << 20, data_timeout_s=60.0)
    elapsed = time.perf_counter() - start_s
    await client.close()
    if path != "data_channel":
        raise RuntimeError(f"the verified fetch took the {path} path, not the data channel")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny-steps", type=int, default=5)
    parser.add_argument("--skip-1b", action="store_true", help="skip the synthetic 1B-parameter set")
    parser.add_argument("--stream-only", action="store_true", help="only (b); keep the rest of the results file")
    parser.add_argument("--stream-mb", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    previous = json.loads(RESULTS.read_text()) if args.stream_only and RESULTS.is_file() else {}
    with tempfile.TemporaryDirectory(prefix="bench-weightsync-") as tmp:
        scratch = Path(tmp)
        tiny: dict[float, dict[str, Any]] = {}
        synthetic = previous.get("synthetic_1b")
        if not args.stream_only:
            model_dir = _model_dir(scratch)
            tiny = {lr: tiny_model_deltas(model_dir, lr, args.tiny_steps) for lr in (1e-6, 1e-5)}
            for lr, result in tiny.items():
                print(f"delta_ratio lr={lr:.0e} {result['delta_ratio_median']:.5f}".replace("e-0", "e-"))
            synthetic = None if args.skip_1b else synthetic_1b_delta(1e-6)
            if synthetic is not None:
                print(f"delta_ratio synthetic_1b lr=1e-6 {synthetic['delta_ratio']:.5f}")
        stream = stream_vs_raw(args.stream_mb, args.rounds, args.streams, scratch)
        print(f"stream_vs_raw_tcp {stream['stream_vs_raw_tcp']:.3f}")
        print(f"stream_vs_raw_tcp_paired_median {stream['stream_vs_raw_tcp_paired_median']:.3f}")
        print(f"stream_one_connection_vs_raw_tcp {stream['stream_one_connection_vs_raw_tcp']:.3f}")
        print(f"stream_verified_vs_raw_tcp {stream['stream_verified_vs_raw_tcp']:.3f}")
        print(f"grpc_stream_vs_raw_tcp {stream['grpc_stream_vs_raw_tcp']:.3f}")
        print(f"grpc_floor_vs_raw_tcp {stream['grpc_floor_vs_raw_tcp']:.3f}")
    result = {
        "benchmark": "weight-sync: lossless bf16 delta size, stream transport vs raw TCP over loopback",
        "tiny_model": [tiny[lr] for lr in sorted(tiny)] if tiny else previous.get("tiny_model"),
        "synthetic_1b": synthetic,
        "stream": stream,
        "goals": {"delta_ratio_lr_1e-6_max": 0.012, "stream_vs_raw_tcp_min": 0.8},
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()},
    }
    if args.stream_only:
        result["delta_measured_in_an_earlier_run"] = True
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
