"""The checks of `make gpu-check` (scripts/gpu_check.py runs each in a child process: `run_check`).

Every check uses the repo's own code: the tiny models of `miles.engine.tiny_model`, the engine in process
(`build_engine`, as the trainer's R3 tests drive it) or as a real `miles-engine` process (the nccl check, which
needs its HTTP control routes), the trainer's backends through `make_backend`, its step through `assemble` +
`run_step`, its rank model (`distributed.make_runner`, two ranks under torch.distributed.run for TP=2), its
publisher through `make_publisher`. Nothing here re-implements a computation; it only compares.

A result is `{"status": "ok" | "FAIL" | "SKIP", "fields": {...}, "detail"?: str}`, written as JSON where the
parent reads it. Limits: sizes are fixed (GPU and CPU rows of `SIZES`); one engine, on the check's device
(`EngineSettings.device`; `engine_device=` is what the engine itself reports, and a check FAILs when that is not
the check's device).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.common.contracts.routing import RoutingShape
    from miles.trainer.backends.base import TrainBackend
    from miles.trainer.batch import TrainSample

Result = dict[str, Any]


@dataclass(frozen=True)
class Sizes:
    num_prompts: int
    max_new_tokens: int
    num_train_sequences: int
    train_sequence_tokens: int
    num_timed_steps: int


SIZES = {"cuda": Sizes(8, 32, 16, 512, 5), "cpu": Sizes(4, 8, 4, 48, 2)}
NCCL_PUBLISH: dict[str, Any] = {"kind": "nccl", "dtype": "float32", "pause_mode": "retract", "engine_timeout_s": 120}
NCCL_PUBLISH |= {"nccl_master_address": "127.0.0.1", "nccl_master_port": 0}
"""The trainer's publish section of the nccl check: float32 (the engine's dtype, so digests compare), no router."""
CPU_CUDA_TOLERANCE = 1e-3
"""engine_logprobs on CUDA: largest |CUDA engine logprob - CPU trainer logprob| accepted (nats; float32 on both, so
only summation orders differ: ~1e-5 expected on the tiny model). The same-device comparison stays exact."""


@dataclass(frozen=True)
class Context:
    work: Path
    device: str
    """Where the trainer (and, when it can, the engine) computes: cuda or cpu."""
    nccl_backend: str

    @property
    def sizes(self) -> Sizes:
        return SIZES[self.device]


def ok_unless(problems: list[str], fields: dict[str, Any]) -> Result:
    """ok, or FAIL with the problems as `reason`."""
    if not problems:
        return {"status": "ok", "fields": fields}
    return {"status": "FAIL", "fields": fields | {"reason": ",".join(problems)}}


def tiny_model(ctx: Context, *, moe: bool) -> Path:
    """The tiny (MoE) model of miles-make-tiny-model, built once per run (atomically: a killed build leaves none)."""
    from miles.engine.tiny_model import build_tiny_model

    final = ctx.work / ("tiny-qwen3-moe" if moe else "tiny-qwen3")
    if not final.exists():
        partial = build_tiny_model(ctx.work / f".{final.name}-{time.monotonic_ns()}", moe=moe)
        partial.rename(final)
    return final


def prompts(ctx: Context) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, 150000) for _ in range(rng.randrange(6, 24))] for _ in range(ctx.sizes.num_prompts)]


def sampled_bodies(ctx: Context, *, routed: bool) -> list[dict[str, Any]]:
    """One /generate body per prompt at temperature 1 (own seed each), logprobs (and routed experts) returned."""
    params = {"max_new_tokens": ctx.sizes.max_new_tokens, "temperature": 1.0, "ignore_eos": True}
    return [
        {"input_ids": p, "sampling_params": params | {"sampling_seed": i}, "return_logprob": True}
        | ({"return_routed_experts": True} if routed else {})
        for i, p in enumerate(prompts(ctx))
    ]


def generate_in_process(
    ctx: Context, model: Path, bodies: list[dict[str, Any]], *, routed: bool
) -> tuple[list[Any], str]:
    """All bodies at once through one deterministic in-process engine on ctx.device (its scheduler batches them);
    returns the replies and the device the engine reports."""
    from miles.common.telemetry import Metrics
    from miles.engine.main import build_engine
    from miles.engine.protocol import GenerateRequest
    from miles.engine.settings import EngineSettings

    routed_flag = {"enable_return_routed_experts": routed}
    settings = EngineSettings(model_path=model, deterministic=True, device=ctx.device, **routed_flag)
    engine, _ = build_engine(settings, Metrics("engine"))

    async def generate_all() -> list[Any]:
        return list(await asyncio.gather(*(engine.generate(engine.plan(GenerateRequest(**b))) for b in bodies)))

    try:
        return asyncio.run(generate_all()), engine.runner.device
    finally:
        engine.scheduler.stop()


def to_samples(
    bodies: Sequence[dict[str, Any]], replies: Sequence[dict[str, Any]], routing: RoutingShape | None = None
) -> list[TrainSample]:
    """Engine replies as buffer groups (one per prompt, as the session server builds them), then through the
    trainer's own validation (`samples_from_group`: routing checked and unpacked)."""
    from miles.common.contracts.routing import decode_sglang, pack
    from miles.proto.common.v1 import common_pb2
    from miles.trainer.batch import samples_from_group

    samples = []
    for index, (body, reply) in enumerate(zip(bodies, replies, strict=True)):
        group = common_pb2.Group(group_id=f"g{index}")
        prompt, output = list(body["input_ids"]), list(reply["output_ids"])
        sample = group.samples.add(
            sample_id=f"g{index}/0",
            group_id=f"g{index}",
            tokens=prompt + output,
            response_start=len(prompt),
            loss_mask=[1] * len(output),
            rollout_logprobs=[entry[0] for entry in reply["meta_info"]["output_token_logprobs"]],
            status=common_pb2.SAMPLE_STATUS_COMPLETED,
        )
        if routing is not None:
            sample.rollout_routed_experts.CopyFrom(pack(decode_sglang(reply["meta_info"]["routed_experts"]), routing))
        replay = routing is not None
        samples += samples_from_group(
            group, index, vocab_size=151936, max_positions=32768, routing=routing, routing_replay=replay
        )
    return samples


def trainer_settings(ctx: Context, model: Path, *, backend: str = "torch", tp: int = 1, **fields: Any) -> Any:
    """TrainerSettings for this device; `fields`: TrainConfig fields, and `publish` (PublishSettings)."""
    from miles.common.jobspec.trainer import OptimizerConfig, TrainConfig
    from miles.trainer.settings import MegatronSettings, PublishSettings, TrainerSettings

    publish = fields.pop("publish", None) or PublishSettings(kind="none")
    train = TrainConfig(optimizer=OptimizerConfig(lr=1e-3), **fields)
    return TrainerSettings(
        job_id="gpu-check",
        model_path=model,
        checkpoint_dir=ctx.work / "ckpt",
        backend=backend,
        device=ctx.device,
        megatron=MegatronSettings(tp_size=tp),
        train=train,
        publish=publish,
    )


def make_trainer(ctx: Context, model: Path, **fields: Any) -> TrainBackend:
    from miles.trainer.backends.base import make_backend

    return make_backend(trainer_settings(ctx, model, **fields))


def recompute(backend: TrainBackend, samples: list[TrainSample]) -> tuple[float, float | None]:
    """Max |trainer logprob - engine logprob| over every response token, and the mean routing agreement (MoE)."""
    import torch

    with torch.no_grad():
        out = backend.forward(samples, temperature=1.0, entropy_grad=False)
    engine = torch.tensor([lp for s in samples for lp in s.rollout_logprobs], dtype=torch.float64)
    diff = float((out.logprobs.double() - engine).abs().max())
    agreement = None if out.routing_agreement is None else float(out.routing_agreement.mean())
    return diff, agreement


def exact_problems(ctx: Context, diff: float, engine_device: str) -> list[str]:
    """Logprobs not bit-equal to the trainer's on the same device, or an engine computing elsewhere."""
    problems = [] if diff == 0.0 else ["logprobs_differ"]
    return problems + ([] if engine_device.split(":")[0] == ctx.device else [f"engine_not_on_{ctx.device}"])


def check_engine_logprobs(ctx: Context) -> Result:
    """Exact against the trainer on the same device; on CUDA also within CPU_CUDA_TOLERANCE of a CPU trainer."""
    model = tiny_model(ctx, moe=False)
    bodies = sampled_bodies(ctx, routed=False)
    started = time.perf_counter()
    replies, device = generate_in_process(ctx, model, bodies, routed=False)
    generate_s = time.perf_counter() - started
    samples = to_samples(bodies, replies)
    diff, _ = recompute(make_trainer(ctx, model, deterministic=True), samples)
    num_tokens = sum(len(s.rollout_logprobs) for s in samples)
    fields = {"sequences": len(samples), "tokens": num_tokens, "max_abs_diff": diff, "generate_s": generate_s}
    problems = exact_problems(ctx, diff, device)
    if ctx.device != "cpu":
        cpu_ctx = dataclasses.replace(ctx, device="cpu")
        cpu_diff, _ = recompute(make_trainer(cpu_ctx, model, deterministic=True), samples)
        fields["cpu_trainer_max_abs_diff"] = cpu_diff
        problems += [] if cpu_diff <= CPU_CUDA_TOLERANCE else ["cpu_trainer_beyond_tolerance"]
    return ok_unless(problems, fields | {"engine_device": device, "device": ctx.device})


def train_groups(num_sequences: int, num_tokens: int) -> list[list[TrainSample]]:
    """Groups of 2 random sequences (rewards 0 and 1: every group has signal), the last 3/4 of each trained."""
    from miles.trainer.batch import TrainSample

    rng, start, groups = random.Random(5), num_tokens // 4, []
    for g in range(num_sequences // 2):
        group = []
        for i in range(2):
            tokens, n = [rng.randrange(1000, 150000) for _ in range(num_tokens)], num_tokens - start
            group.append(
                TrainSample(f"g{g}", f"g{g}/{i}", g, tokens, start, [1] * n, [-10.0] * n, float(i), True, 0, 0)
            )
        groups.append(group)
    return groups


def train_plan(ctx: Context, config: Any, num_data_ranks: int = 1, *, small: bool = False) -> tuple[Any, int]:
    """The step plan of `train_groups` (the trainer's own `assemble`) and its number of tokens; `small`: 4 x 64
    tokens whatever the device (a deterministic step, whose attention runs query by query)."""
    from miles.trainer.assemble import assemble

    sizes = ctx.sizes
    groups = train_groups(4, 64) if small else train_groups(sizes.num_train_sequences, sizes.train_sequence_tokens)
    plan = assemble(groups, [0] * len(groups), config, trainer_version=0, world_size=num_data_ranks).plan
    return plan, sum(len(s.tokens) for g in groups for s in g)


def timed(ctx: Context, step: Callable[[], Any], num_tokens: int) -> dict[str, Any]:
    """One warm-up trainer step, then `num_timed_steps` timed ones on the same batch: tokens per second."""
    import torch

    step()
    seconds, result = [], None
    for _ in range(ctx.sizes.num_timed_steps):
        started = time.perf_counter()
        result = step()
        if ctx.device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    step_s = statistics.median(seconds)
    fields = {"tokens_per_s": round(num_tokens / step_s, 1), "step_s": step_s, "tokens_per_step": num_tokens}
    return fields | {"steps": len(seconds), "loss_last": result.stats.get("loss") if result else None}


def check_train(ctx: Context, backend_name: str) -> Result:
    from miles.trainer.backends.base import make_backend
    from miles.trainer.step import run_step

    settings = trainer_settings(ctx, tiny_model(ctx, moe=False), backend=backend_name)
    backend = make_backend(settings)
    plan, num_tokens = train_plan(ctx, settings.train)
    fields = timed(ctx, lambda: run_step(backend, plan, settings.train), num_tokens)
    return ok_unless([], fields | {"backend": backend_name, "tp": 1, "device": ctx.device})


def check_megatron_tp2(ctx: Context) -> Result:
    """TP=2 over two ranks started by torch.distributed.run (the trainer's launcher): gloo on the CPU, else NCCL
    with one GPU per rank (needs two); rank 0 writes what it measured."""
    import torch

    from miles.common.ports import free_port

    num_gpus = torch.cuda.device_count()
    if ctx.device == "cuda" and num_gpus < 2:
        return {"status": "SKIP", "fields": {"reason": "needs_2_gpus", "gpus": num_gpus}}
    tiny_model(ctx, moe=False)
    script = Path(__file__).resolve().parent / "gpu_check.py"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    argv += ["--master_port", str(free_port()), str(script), "--child", "train_megatron_tp2", "--rank-worker"]
    argv += ["--work", str(ctx.work), "--nccl-backend", ctx.nccl_backend] + ["--cpu"] * (ctx.device == "cpu")
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    result_path = ctx.work / "train_megatron_tp2.rank0.json"
    if done.returncode != 0 or not result_path.exists():
        return {"status": "FAIL", "fields": {"reason": f"ranks_exit_{done.returncode}"}, "detail": done.stderr[-3000:]}
    return ok_unless([], json.loads(result_path.read_text()))


def megatron_tp2_rank(ctx: Context) -> None:
    """One rank of `check_megatron_tp2`: the trainer's rank model (distributed.py) over the Megatron backend."""
    import os

    from miles.trainer.backends.base import make_backend
    from miles.trainer.distributed import CoordinatorRunner, init_process_group, make_runner, serve_worker

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # init_process_group binds this rank to GPU LOCAL_RANK (distributed.bind_local_gpu), as in the trainer
    init_process_group(rank=rank, world_size=world_size, master_addr=address, master_port=port, backend="auto")
    settings = trainer_settings(ctx, tiny_model(ctx, moe=False), backend="megatron", tp=2)
    runner = make_runner(make_backend(settings), settings.train, rank=rank, world_size=world_size)
    if not isinstance(runner, CoordinatorRunner):
        serve_worker(runner)
        return
    plan, num_tokens = train_plan(ctx, settings.train, runner.data.size)
    fields = timed(ctx, lambda: runner.train_step(plan), num_tokens)
    runner.stop_workers()
    fields |= {"backend": "megatron", "tp": 2, "ranks": world_size, "device": ctx.device}
    (ctx.work / "train_megatron_tp2.rank0.json").write_text(json.dumps(fields))


@contextmanager
def engine_process(ctx: Context, model: Path, extra_env: dict[str, str]) -> Iterator[str]:
    """A real miles-engine (deterministic, version 0) on a free port, started from this python and src dirs."""
    from miles.common.testing import ServiceProcess, free_port

    port = free_port()
    argv = [sys.executable, "-c", "from miles.engine.main import main; main()", "--model-path", str(model)]
    argv += ["--port", str(port), "--deterministic", "--weight-version", "0"]
    argv += ["--device", ctx.device]
    ready_url, log_path = f"http://127.0.0.1:{port}/readyz", ctx.work / "engine.log"
    process = ServiceProcess(argv, ready_url=ready_url, log_path=log_path, env=extra_env).start(ready_timeout_s=120)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.stop()


def nccl_setup(ctx: Context) -> tuple[str, dict[str, str]]:
    """The update group's backend and the engine's environment: NCCL needs a GPU per rank, so with two GPUs the
    engine takes the second one; with one, auto means gloo."""
    import os

    import torch

    num_gpus = torch.cuda.device_count() if ctx.device == "cuda" else 0
    backend = ctx.nccl_backend if ctx.nccl_backend != "auto" else ("nccl" if num_gpus >= 2 else "gloo")
    if backend != "nccl" or num_gpus < 2:
        return backend, {}
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d] or ["0", "1"]
    return backend, {"CUDA_VISIBLE_DEVICES": visible[1]}


async def publish_trained_version(ctx: Context, settings: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The trainer side of `check_nccl_weights`: version 0 (the initial weights) and version 1 (after one trainer
    step) through the trainer's publisher. Returns the backend, version 1's tensors and what the publish took."""
    from miles.trainer.backends.base import make_backend
    from miles.trainer.publish import make_publisher
    from miles.trainer.step import run_step

    backend, publisher = make_backend(settings), make_publisher(settings)
    started = time.perf_counter()
    await publisher.resume(0, backend.hf_state_dict(), step=0)  # what the trainer publishes (core.py)
    plan, _ = train_plan(ctx, settings.train, small=True)
    run_step(backend, plan, settings.train)
    named = backend.hf_state_dict()
    record = await publisher.publish(1, named, step=1, step_finished_unix_ms=int(time.time() * 1000))
    await publisher.close()
    return backend, named, {"versions": 2, "bytes": record.num_bytes, "publish_s": time.perf_counter() - started}


async def check_nccl_weights(ctx: Context) -> Result:
    import httpx
    import torch

    from miles.trainer.publish import convert_for_publish, digest_of
    from miles.trainer.settings import PublishSettings

    model = tiny_model(ctx, moe=False)
    group_backend, engine_env = nccl_setup(ctx)
    with engine_process(ctx, model, engine_env) as url:
        publish = PublishSettings(**NCCL_PUBLISH, engine_urls=[url], nccl_backend=group_backend)
        settings = trainer_settings(ctx, model, deterministic=True, publish=publish)
        backend, named, fields = await publish_trained_version(ctx, settings)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            bodies = sampled_bodies(ctx, routed=False)
            replies = [(await client.post("/generate", json=b)).json() for b in bodies]
            checksum = (await client.post("/weights_checker", json={"action": "checksum"})).json()["payload"]
            engine_device = (await client.get("/get_server_info")).json()["device"]
    diff, _ = recompute(backend, to_samples(bodies, replies))
    digest_equal = checksum["digest"] == digest_of(convert_for_publish(named, torch.float32))
    versions = {r["meta_info"]["weight_version"] for r in replies} | {checksum["weight_version"]}
    problems = exact_problems(ctx, diff, engine_device) + ([] if digest_equal else ["digest_differs"])
    problems += [] if versions == {"1"} else ["engine_version_not_1"]
    fields |= {"backend": group_backend, "digest_equal": digest_equal, "max_abs_diff": diff}
    fields |= {"engine_device": engine_device, "engine_gpu": engine_env.get("CUDA_VISIBLE_DEVICES", "-")}
    return ok_unless(problems, fields)


def check_moe_replay(ctx: Context) -> Result:
    from miles.common.contracts.routing import routing_shape_from_hf_config

    model = tiny_model(ctx, moe=True)
    routing = routing_shape_from_hf_config(json.loads((model / "config.json").read_text()))
    bodies = sampled_bodies(ctx, routed=True)
    replies, device = generate_in_process(ctx, model, bodies, routed=True)
    samples = to_samples(bodies, replies, routing)
    diff, agreement = recompute(make_trainer(ctx, model, deterministic=True, routing_replay=True), samples)
    fields = {"sequences": len(samples), "max_abs_diff": diff, "routing_agreement": agreement}
    return ok_unless(exact_problems(ctx, diff, device), fields | {"engine_device": device, "device": ctx.device})


CHECK_FUNCTIONS: dict[str, Callable[[Context], Any]] = {
    "engine_logprobs": check_engine_logprobs,
    "train_torch": lambda ctx: check_train(ctx, "torch"),
    "train_megatron": lambda ctx: check_train(ctx, "megatron"),
    "train_megatron_tp2": check_megatron_tp2,
    "nccl_weights": lambda ctx: asyncio.run(check_nccl_weights(ctx)),
    "moe_replay": check_moe_replay,
}


def run_check(name: str, work: Path, *, cpu: bool, nccl_backend: str, rank_worker: bool = False) -> int:
    """Run one check and write its result to `<work>/<name>.json` (a crash is a FAIL with the traceback);
    `rank_worker`: be one rank of a multi-rank check instead."""
    ctx = Context(work=work, device="cpu" if cpu else "cuda", nccl_backend=nccl_backend)
    if rank_worker:
        megatron_tp2_rank(ctx)
        return 0
    try:
        result: Result = CHECK_FUNCTIONS[name](ctx)
    except Exception as exc:
        result = {"status": "FAIL", "fields": {"reason": type(exc).__name__}, "detail": traceback.format_exc()}
    (work / f"{name}.json").write_text(json.dumps(result))
    return 0
