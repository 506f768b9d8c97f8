"""Entry point of miles-trainer: load settings, build the backend and the loop, serve the control API.

Rank 0 (or the only process) serves gRPC (every TrainerService call needs settings.auth_token when it is set) +
metrics and runs the loop; under torchrun the other ranks build the same backend and follow rank 0's operations.
Without a job id the process serves its API idle (no torch import). The process exits 1 when the loop fails (the
orchestrator restarts it; it resumes from its last checkpoint), 0 after SIGTERM (with a checkpoint first when
checkpoint_on_sigterm is set).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import TYPE_CHECKING, Any

from miles.common.auth import BearerAuth
from miles.common.errors import ConfigError
from miles.common.grpc_server import build_grpc_server
from miles.common.logs import configure_logging
from miles.common.serve import serve_async
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics, setup_tracing
from miles.proto.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from miles.trainer.events import EventLog
from miles.trainer.grpc_api import SERVICE_NAME, TrainerServicer
from miles.trainer.http_api import SERVICE, build_http_app
from miles.trainer.settings import TrainerSettings

if TYPE_CHECKING:
    from miles.trainer.backends.base import TrainBackend
    from miles.trainer.core import Trainer
    from miles.trainer.distributed import RankRunner


log = logging.getLogger(__name__)


async def serve(settings: TrainerSettings, metrics: Metrics, trainer: Trainer | None, events: EventLog) -> int:
    """Serve the control API (and run the loop when there is one) until SIGTERM or a loop failure."""
    if not settings.auth_token.get_secret_value():
        log.warning("no auth_token: the control API is open to local callers (loopback development mode)")
    servicer = TrainerServicer(trainer, events, settings.job_id)
    grpc_server = build_grpc_server(
        servicers=[(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, servicer)],
        service_names=[SERVICE_NAME],
        metrics=metrics,
        host=settings.host,
        port=settings.port,
        auth=BearerAuth([settings.auth_token.get_secret_value()], what="the trainer's control API"),
    )

    app = build_http_app(metrics, trainer)
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    def start_loop(http_port: int | None, grpc_port: int | None) -> None:
        if trainer is not None:
            task = asyncio.create_task(trainer.run())
            task.add_done_callback(lambda done: stop.set() if not done.cancelled() and done.exception() else None)
            tasks.append(task)

    async def stop_loop() -> None:
        if trainer is not None and not trainer.done.is_set():
            await trainer.request_stop(checkpoint=settings.checkpoint_on_sigterm)

    await serve_async(
        http_app=app,
        http_host=settings.host,
        http_port=settings.metrics_port,
        grpc_server=grpc_server,
        grace_s=settings.shutdown_grace_s,
        on_started=start_loop,
        on_shutdown=[stop_loop],
        stop_event=stop,
    )
    failed = trainer is not None and trainer.state == trainer_pb2.TRAINER_STATE_FAILED
    return 1 if failed else 0


async def run_rank0(settings: TrainerSettings, runner: RankRunner, backend: TrainBackend) -> int:
    from miles.buffer.client import BufferClient
    from miles.trainer.checkpoint import CheckpointStore
    from miles.trainer.consumption import Consumer
    from miles.trainer.core import Trainer
    from miles.trainer.metrics import TrainerMetrics
    from miles.trainer.publish import make_publisher

    assert settings.checkpoint_dir is not None
    metrics = Metrics(SERVICE)
    events = EventLog(settings.events_kept)
    publisher = make_publisher(settings, metrics)
    store = CheckpointStore(
        settings.checkpoint_dir,
        keep_last=settings.train.keep_last_checkpoints,
        source_model_dir=settings.model_path,
        adapter_config=_adapter_config(settings),
    )
    async with BufferClient(settings.buffer_address) as client:
        consumer = Consumer(client, settings.job_id, settings.resolved_consumer_id, settings.train.lease_s)
        trainer = Trainer(
            settings,
            runner=runner,
            consumer=consumer,
            publisher=publisher,
            store=store,
            metrics=TrainerMetrics(metrics),
            events=events,
            shape=backend.shape,
        )
        try:
            return await serve(settings, metrics, trainer, events)
        finally:
            await publisher.close()
            await trainer.stop_workers()
            trainer.close()


def _adapter_config(settings: TrainerSettings) -> dict[str, Any] | None:
    """LoRA jobs: the PEFT adapter_config.json their checkpoints carry (None: full-weight checkpoints)."""
    if settings.train.lora is None:
        return None
    from miles.trainer.backends.torch_lora import adapter_config_dict

    return adapter_config_dict(settings.train.lora, settings.model_path)


def run_job(settings: TrainerSettings) -> int:
    """Build the backend on every rank; rank 0 runs the loop, the others follow it."""
    import torch

    from miles.trainer.backends.base import make_backend
    from miles.trainer.distributed import join_ranks, make_runner, serve_worker

    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    watchdog = None
    if settings.world_size > 1:  # a peer that dies ends every rank (exit 75; rank_health.py)
        watchdog = join_ranks(
            rank=settings.rank,
            world_size=settings.world_size,
            master_addr=settings.master_addr,
            master_port=settings.master_port,
            backend=settings.dist_backend,
            collective_timeout_s=settings.collective_timeout_s,
            peer_timeout_s=settings.peer_timeout_s,
        )
    clean = False
    try:
        backend = make_backend(settings)
        runner = make_runner(backend, settings.train, rank=settings.rank, world_size=settings.world_size)
        runner.watchdog = watchdog
        if settings.rank > 0:
            serve_worker(runner)
            clean = True
            return 0
        code = asyncio.run(run_rank0(settings, runner, backend))
        clean = True
        return code
    finally:
        if watchdog is not None:
            watchdog.stop(clean=clean)
        if settings.world_size > 1:
            torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="miles-trainer", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    settings = load_settings(TrainerSettings)
    configure_logging(
        f"{SERVICE}-{settings.rank}" if settings.world_size > 1 else SERVICE,
        settings.log_level,
        json_lines=settings.log_json,
    )
    setup_tracing(SERVICE)
    if not settings.job_id:
        sys.exit(asyncio.run(serve(settings, Metrics(SERVICE), None, EventLog(settings.events_kept))))
    try:
        code = run_job(settings)
    except ConfigError as exc:  # a recipe the model cannot run (e.g. routing_replay true with a dense model)
        log.error("cannot start", extra={"error": exc.message, "field": exc.field})
        raise SystemExit(f"miles-trainer: {exc.message}") from None
    sys.exit(code)
