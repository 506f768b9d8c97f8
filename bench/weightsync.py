"""make bench-weightsync: how small are lossless deltas, how little does an update stop an engine, and how fast
is the stream transport?

(a) Delta ratio = stored delta bytes / full bytes, in the engine dtype, with weight-sync's own encoder
    (`miles.weightsync.weights.encode_version` / `delta.encode_delta`: per tensor the smallest of bucketed
    order-preserving differences, sparse-XOR, plane-split XOR and full, zstd level 1 — exactly what the daemon
    stores):
    - the tiny Qwen3 model (~10M parameters) taking real AdamW steps (float32 master weights, next-token loss on
      random token sequences) at lr 1e-6 and 1e-5; the median over the measured steps is reported;
    - a synthetic 1B-parameter bf16 set (a Llama-like layout: vocab 128,256 x hidden 2,048, 16 layers, MLP 5,632;
      N(0, 0.02) weights, norms 1) updated by AdamW-like steps (torch AdamW arithmetic, betas 0.9/0.999,
      weight decay 0.01, random N(0, 1e-3) gradients, 3 steps, the last one measured) at lr 1e-6 (the goal) and
      1e-5. To keep memory and time sane on a 2-core 24 GB box it is processed tensor by tensor, and tensors
      above 16M elements in row blocks of at most 16M elements, each block generated, stepped, encoded, decoded,
      compared and dropped before the next (peak ~0.4 GB). Encode and decode throughput are MB/s of raw tensor
      bytes (encode_delta / decode time only, one core);
    - distributions the encoder was not tuned on, on the first 2 layers of the same layout (90M parameters, no
      embedding): bf16 N(0, 0.05) weights, and float16 / float32 N(0, 0.02) weights, at lr 1e-6.
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

(c) Engine pause within a whole update (bench/_weightsync_update.py): a trainer in this process publishing real
    AdamW steps of the tiny model to an origin that loads one busy engine (real processes, router, defaults);
    `pause_vs_update` = median engine pause / median time from the optimizer step to the engine serving the
    version, and `naive_pause_vs_update` what the pause would be if the version were prepared inside it.

(d) LoRA adapter size vs the full model (arithmetic on the model's shapes, nothing allocated): what a rank-8 and
    a rank-64 adapter on all 7 projections (q k v o gate up down: rank x (in + out) per projection) weighs next
    to the whole model (embedding, lm_head unless tied, projections, norms), both in bf16, for the tiny Qwen3
    model (its config.json; the count is checked against its safetensors) and for a synthetic ~1B Qwen3 shape
    (Qwen3-1.7B's layers - hidden 2,048, 16 heads of 128, 8 KV heads, MLP 6,144, vocab 151,936, tied - 14 of its
    28 layers: 1.02B parameters). What a LoRA job's checkpoint holds (its adapter, float32: twice the bf16 bytes);
    a job on a shared engine pool sends its engines this adapter (a job with its own engines still sends merged
    full weights).

Prints `delta_ratio lr=1e-6 <x>` (tiny model), `delta_ratio synthetic_1b lr=1e-6 <y>` (goal: <= 0.012), the other
delta workloads with their encode / decode MB/s, `pause_vs_update <p>` (goal: <= 0.15) and `stream_vs_raw_tcp <z>`
(goal: >= 0.8), `lora_adapter_vs_full <model> rank=<r> <ratio>`; writes bench/results/weightsync.json.

Run: make bench-weightsync   (or: .venv/bin/python bench/weightsync.py [--skip-1b]
[--stream-only | --delta-only | --update-only | --lora-only] [--stream-mb N] [--rounds R] [--streams S]
[--update-versions V]; an --*-only run measures that part alone and keeps the others from the results file)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _weightsync_update import pause_vs_update

from miles.common.testing import ServiceProcess, free_port, wait_for_http_ready
from miles.common.testing.machine import describe_machine
from miles.common.testing.smoke import console_script
from miles.weightsync.delta import decode, encode_delta
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


def _synthetic_layout(num_layers: int = 16, with_embedding: bool = True) -> list[tuple[str, tuple[int, int]]]:
    hidden, kv, mlp, vocab = 2048, 512, 5632, 128256
    layout: list[tuple[str, tuple[int, int]]] = (
        [("model.embed_tokens.weight", (vocab, hidden))] if with_embedding else []
    )
    for layer in range(num_layers):
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


def _adamw_block(
    rows: int, cols: int, is_norm: bool, lr: float, seed: int, num_steps: int, std: float, dtype: torch.dtype
) -> tuple[bytes, bytes]:
    """Bytes (in `dtype`) of one block before and after the last of num_steps AdamW steps (torch's arithmetic)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.ones(rows, cols) if is_norm else torch.randn(rows, cols, generator=generator).mul_(std)
    exp_avg, exp_avg_sq = torch.zeros_like(weight), torch.zeros_like(weight)
    beta1, beta2, eps, weight_decay = 0.9, 0.999, 1e-8, 0.01
    before = b""
    for step in range(1, num_steps + 1):
        if step == num_steps:
            before = weight.to(dtype).reshape(-1).view(torch.uint8).numpy().tobytes()
        grad = torch.randn(rows, cols, generator=generator).mul_(1e-3)
        weight.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(eps)
        weight.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
        del grad, denom
    after = weight.to(dtype).reshape(-1).view(torch.uint8).numpy().tobytes()
    return before, after


def synthetic_delta(
    lr: float, *, std: float = 0.02, dtype: torch.dtype = torch.bfloat16, num_layers: int = 16, embedding: bool = True
) -> dict[str, Any]:
    """The synthetic set's last AdamW-like step, block by block: stored / full bytes, which encodings won, and
    encode / decode throughput (every block is decoded and compared with what was encoded)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    full_bytes = stored_bytes = num_elements = num_changed = 0
    encode_s = decode_s = 0.0
    encodings: dict[str, int] = {}
    start_s = time.perf_counter()
    for index, (name, (rows, cols)) in enumerate(_synthetic_layout(num_layers, embedding)):
        block_rows = max(1, BLOCK_ELEMENTS // cols)
        for block, row in enumerate(range(0, rows, block_rows)):
            height = min(block_rows, rows - row)
            seed = index * 1000 + block
            before, after = _adamw_block(height, cols, "norm" in name, lr, seed, 3, std, dtype)
            tick_s = time.perf_counter()
            encoded = encode_delta(before, after, itemsize, level=1)
            encoded_s = time.perf_counter()
            restored = decode(encoded.encoding, encoded.blob, num_bytes=len(after), itemsize=itemsize, base=before)
            decode_s += time.perf_counter() - encoded_s
            encode_s += encoded_s - tick_s
            if restored != after:
                raise RuntimeError(f"{name} block {block} did not decode to what was encoded")
            full_bytes += len(after)
            stored_bytes += len(encoded.blob)
            num_elements += height * cols
            num_changed += encoded.num_changed
            encodings[encoded.encoding] = encodings.get(encoded.encoding, 0) + 1
    return {
        "lr": lr,
        "weights": f"N(0, {std}) {str(dtype).removeprefix('torch.')}, norms 1",
        "layers": num_layers,
        "embedding": embedding,
        "num_parameters": num_elements,
        "full_bytes": full_bytes,
        "stored_bytes": stored_bytes,
        "delta_ratio": stored_bytes / full_bytes,
        "changed_elements": num_changed / num_elements,
        "adamw_steps": 3,
        "encodings_chosen": encodings,
        "encode_mb_per_s": full_bytes / encode_s / 1e6,
        "decode_mb_per_s": full_bytes / decode_s / 1e6,
        "seconds": time.perf_counter() - start_s,
    }


def delta_ratios(model_dir: Path, tiny_steps: int, skip_synthetic: bool) -> dict[str, Any]:
    """Part (a): every delta workload, printed as it finishes."""
    tiny = {lr: tiny_model_deltas(model_dir, lr, tiny_steps) for lr in (1e-6, 1e-5)}
    for lr, result in tiny.items():
        print(f"delta_ratio lr={lr:.0e} {result['delta_ratio_median']:.5f}".replace("e-0", "e-"))
    synthetic: dict[str, Any] = {}
    if not skip_synthetic:
        synthetic["synthetic_1b"] = synthetic_delta(1e-6)
        synthetic["synthetic_1b_lr_1e-5"] = synthetic_delta(1e-5)
        synthetic["synthetic_other"] = [
            synthetic_delta(1e-6, std=0.05, num_layers=2, embedding=False),
            synthetic_delta(1e-6, dtype=torch.float16, num_layers=2, embedding=False),
            synthetic_delta(1e-6, dtype=torch.float32, num_layers=2, embedding=False),
        ]
    for key, runs in synthetic.items():
        for run in runs if isinstance(runs, list) else [runs]:
            label = f"{key.removesuffix('_lr_1e-5')} lr={run['lr']:.0e}".replace("e-0", "e-")
            weights = f" [{run['weights']}]" if key == "synthetic_other" else ""
            print(
                f"delta_ratio {label}{weights} {run['delta_ratio']:.5f} "
                f"(encode {run['encode_mb_per_s']:.0f} MB/s, decode {run['decode_mb_per_s']:.0f} MB/s)"
            )
    return {"tiny_model": [tiny[lr] for lr in sorted(tiny)], **synthetic}


# --- (d) LoRA adapter size vs the full model ---------------------------------------------------------------------
LORA_RANKS = (8, 64)
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SYNTHETIC_QWEN3_1B = {
    "hidden_size": 2048,
    "num_hidden_layers": 14,
    "intermediate_size": 6144,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
"""Qwen3-1.7B's shapes with 14 of its 28 layers: ~1B parameters."""
BF16_BYTES = 2


def _projection_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of each of a Qwen3 decoder layer's 7 projections."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    head_dim = int(config.get("head_dim") or hidden // int(config["num_attention_heads"]))
    q, kv = int(config["num_attention_heads"]) * head_dim, int(config["num_key_value_heads"]) * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def qwen3_num_parameters(config: dict[str, Any]) -> int:
    """Every parameter of a dense Qwen3 causal LM: embedding, lm_head unless tied, per layer the 7 projections,
    2 RMSNorms and the q/k norms (head_dim each), and the final norm."""
    hidden, vocab, layers = int(config["hidden_size"]), int(config["vocab_size"]), int(config["num_hidden_layers"])
    head_dim = int(config.get("head_dim") or hidden // int(config["num_attention_heads"]))
    per_layer = sum(i * o for i, o in _projection_shapes(config).values()) + 2 * hidden + 2 * head_dim
    lm_head = 0 if config.get("tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + lm_head + layers * per_layer + hidden


def lora_num_parameters(config: dict[str, Any], rank: int) -> int:
    """A rank-`rank` adapter on all 7 projections of every layer: A (rank x in) + B (out x rank) each."""
    per_layer = sum(rank * (i + o) for name, (i, o) in _projection_shapes(config).items() if name in LORA_PROJECTIONS)
    return int(config["num_hidden_layers"]) * per_layer


def _safetensors_num_parameters(path: Path) -> int:
    """Elements of every tensor of a safetensors file, from its header alone."""
    with path.open("rb") as file:
        header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
    return sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


def lora_adapter_sizes(model_dir: Path) -> dict[str, Any]:
    """Part (d): bf16 adapter bytes / bf16 full-model bytes, per model and rank, printed as computed."""
    tiny_config = json.loads((model_dir / "config.json").read_text())
    tiny_count = qwen3_num_parameters(tiny_config)
    weights = model_dir / "model.safetensors"
    if weights.is_file():  # the arithmetic is the model's own count
        stored = _safetensors_num_parameters(weights)
        if stored != tiny_count:
            raise RuntimeError(f"{weights}: {stored} parameters, the config's shapes give {tiny_count}")
    models = {"tiny_qwen3": tiny_config, "synthetic_qwen3_1b": SYNTHETIC_QWEN3_1B}
    result: dict[str, Any] = {
        "dtype": "bfloat16",
        "projections": list(LORA_PROJECTIONS),
        "checkpoint_dtype": "float32 (a LoRA job's adapter/ holds 2x the bf16 adapter bytes)",
    }
    for label, config in models.items():
        full = qwen3_num_parameters(config)
        entry: dict[str, Any] = {
            "shape": {key: config[key] for key in SYNTHETIC_QWEN3_1B},
            "num_parameters": full,
            "full_bytes": full * BF16_BYTES,
        }
        for rank in LORA_RANKS:
            adapter = lora_num_parameters(config, rank)
            entry[f"rank_{rank}"] = {
                "adapter_parameters": adapter,
                "adapter_bytes": adapter * BF16_BYTES,
                "adapter_vs_full": adapter / full,
            }
            print(
                f"lora_adapter_vs_full {label} rank={rank} {adapter / full:.5f} ({adapter * BF16_BYTES:,} bytes "
                f"of {full * BF16_BYTES:,})"
            )
        result[label] = entry
    return result


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


_DELTA_KEYS = ("tiny_model", "synthetic_1b", "synthetic_1b_lr_1e-5", "synthetic_other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny-steps", type=int, default=5)
    parser.add_argument("--skip-1b", action="store_true", help="skip the synthetic sets")
    parser.add_argument("--stream-only", action="store_true", help="only (b); keep the rest of the results file")
    parser.add_argument("--delta-only", action="store_true", help="only (a); keep the file's stream results")
    parser.add_argument("--update-only", action="store_true", help="only (c); keep the rest of the results file")
    parser.add_argument("--lora-only", action="store_true", help="only (d); keep the rest of the results file")
    parser.add_argument("--update-versions", type=int, default=6)
    parser.add_argument("--stream-mb", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=4)
    args = parser.parse_args()
    if sum((args.stream_only, args.delta_only, args.update_only, args.lora_only)) > 1:
        parser.error("--stream-only, --delta-only, --update-only and --lora-only exclude each other")
    flags = {"stream": args.stream_only, "delta": args.delta_only, "update": args.update_only, "lora": args.lora_only}
    only = next((part for part, chosen in flags.items() if chosen), "")
    torch.manual_seed(0)
    previous = json.loads(RESULTS.read_text()) if only and RESULTS.is_file() else {}
    with tempfile.TemporaryDirectory(prefix="bench-weightsync-") as tmp:
        scratch = Path(tmp)
        deltas = {key: previous.get(key) for key in _DELTA_KEYS}
        if only in ("", "delta"):
            deltas = dict.fromkeys(_DELTA_KEYS) | delta_ratios(_model_dir(scratch), args.tiny_steps, args.skip_1b)
        update = previous.get("update")
        if only in ("", "update"):
            update = pause_vs_update(_model_dir(scratch), scratch, num_versions=args.update_versions)
            print(f"pause_vs_update {update['pause_vs_update']:.3f}")
            print(f"naive_pause_vs_update {update['naive_pause_vs_update']:.3f}")
        lora = previous.get("lora_adapter")
        if only in ("", "lora"):
            lora = lora_adapter_sizes(_model_dir(scratch))
        stream = previous.get("stream")
        if only in ("", "stream"):
            stream = stream_vs_raw(args.stream_mb, args.rounds, args.streams, scratch)
            print(f"stream_vs_raw_tcp {stream['stream_vs_raw_tcp']:.3f}")
            print(f"stream_vs_raw_tcp_paired_median {stream['stream_vs_raw_tcp_paired_median']:.3f}")
            print(f"stream_one_connection_vs_raw_tcp {stream['stream_one_connection_vs_raw_tcp']:.3f}")
            print(f"stream_verified_vs_raw_tcp {stream['stream_verified_vs_raw_tcp']:.3f}")
            print(f"grpc_stream_vs_raw_tcp {stream['grpc_stream_vs_raw_tcp']:.3f}")
            print(f"grpc_floor_vs_raw_tcp {stream['grpc_floor_vs_raw_tcp']:.3f}")
    result = {
        "benchmark": "weight-sync: lossless delta size (bf16 and others), engine pause within a whole update, "
        "stream transport vs raw TCP over loopback, LoRA adapter size vs the full model",
        **deltas,
        "update": update,
        "stream": stream,
        "lora_adapter": lora,
        "goals": {"delta_ratio_lr_1e-6_max": 0.012, "pause_vs_update_max": 0.15, "stream_vs_raw_tcp_min": 0.8},
        "machine": describe_machine(),
    }
    if only:
        result["only_this_part_measured_in_this_run"] = only
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
