"""Entry point of miles-engine: read settings (flags or MILES_ENGINE_* variables), build the engine, serve.

    miles-engine --model-path DIR [--port 30000] [--deterministic] [--fake-model] ...

Every settings field is also a flag (`max_total_tokens` -> `--max-total-tokens`); flags win over the
environment. torch is imported only when a real model is loaded, so `--help` and `--fake-model` start fast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from typing import Any

from fastapi import FastAPI

from miles.common.errors import ConfigError
from miles.common.http import create_http_app
from miles.common.logs import configure_logging
from miles.common.serve import serve_async
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics, setup_tracing
from miles.engine.adapters import Adapters, LoraError, parse_lora_path_spec
from miles.engine.core import Engine
from miles.engine.distributed import UpdateGroups
from miles.engine.http_api import add_routes
from miles.engine.info import ServedModel
from miles.engine.metrics import EngineMetrics
from miles.engine.openapi_docs import complete_openapi
from miles.engine.planning import Limits
from miles.engine.radix_cache import RadixCache
from miles.engine.runner import Runner, make_runner
from miles.engine.scheduler import Scheduler
from miles.engine.settings import EngineSettings
from miles.engine.tokenizer import TextTokenizer

SERVICE = "engine"

log = logging.getLogger(__name__)


def parse_flags(argv: list[str] | None) -> dict[str, Any]:
    """Settings overrides from command-line flags (only the flags given)."""
    parser = argparse.ArgumentParser(prog="miles-engine", description=__doc__.split("\n\n")[0])
    for name, field in EngineSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = (field.description or "").replace("%", "%%")
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif "list[" in str(field.annotation):  # SGLang's nargs="*" flags (--lora-paths A=x B=y)
            parser.add_argument(flag, dest=name, nargs="+", default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=name, default=None, help=help_text)
    return {key: value for key, value in vars(parser.parse_args(argv)).items() if value is not None}


def build_engine(settings: EngineSettings, metrics: Metrics) -> tuple[Engine, ServedModel]:
    """Tokenizer, model runner (warmed up), prefix cache and the running scheduler."""
    tokenizer = TextTokenizer(settings.resolved_tokenizer_path)
    runner = make_runner(settings, tokenizer.num_regular_tokens)
    info = runner.info
    if settings.enable_return_routed_experts and info.num_moe_layers == 0:
        # Fail loudly rather than answer every request without the routing it asked for (SGLang fails at start
        # too: its capturer reads the config's num_experts_per_tok, which a dense model lacks).
        raise ConfigError(
            f"enable_return_routed_experts needs a MoE model, but {settings.model_path} ({info.model_type}) has no "
            "MoE layers",
            field="enable_return_routed_experts",
        )
    runner.warmup()
    served_name = settings.resolved_served_model_name
    engine_metrics = EngineMetrics(metrics, served_name)
    scheduler = Scheduler(
        runner,
        RadixCache(enabled=not settings.disable_radix_cache),
        tokenizer,
        eos_token_ids=_eos_token_ids(settings, info.eos_token_ids, tokenizer.eos_token_id),
        max_total_tokens=settings.max_total_tokens,
        max_running_requests=settings.max_running_requests,
        max_prefill_tokens=settings.max_prefill_tokens,
        weight_version=settings.weight_version,
        metrics=engine_metrics,
        max_loras_per_batch=settings.max_loras_per_batch,
        mixed_chunk=settings.enable_mixed_chunk,
    )
    scheduler.start()
    adapters = _adapters(settings, runner, scheduler, engine_metrics)
    limits = Limits(
        vocab_size=info.vocab_size,
        context_length=settings.context_length or info.max_position_embeddings,
        max_total_tokens=settings.max_total_tokens,
        max_sequences_per_request=settings.max_running_requests,
        return_routed_experts=settings.enable_return_routed_experts,
    )
    served = ServedModel(
        model_path=str(settings.model_path),
        tokenizer_path=str(settings.resolved_tokenizer_path),
        served_model_name=served_name,
        created_s=int(time.time()),
    )
    update_groups = UpdateGroups(settings.weight_update_group_timeout_s, runner.device)
    return Engine(scheduler, runner, tokenizer, limits, update_groups, adapters), served


def _adapters(settings: EngineSettings, runner: Runner, scheduler: Scheduler, metrics: EngineMetrics) -> Adapters:
    """The LoRA registry, with --lora-paths loaded (a ConfigError when one is refused)."""
    adapters = Adapters(
        runner,
        scheduler,
        settings.lora_limits,
        enabled=settings.enable_lora,
        max_loaded_loras=settings.effective_max_loaded_loras,
        metrics=metrics,
    )
    for spec in settings.lora_paths:
        name, path = parse_lora_path_spec(spec)
        try:
            adapters.load_at_start(name, path)
        except LoraError as exc:
            scheduler.stop()
            raise ConfigError(exc.message, field="lora_paths") from exc
    return adapters


def _eos_token_ids(settings: EngineSettings, config_ids: tuple[int, ...], tokenizer_eos: int | None) -> frozenset[int]:
    """End-of-sequence ids: config.json's, generation_config.json's and the tokenizer's (SGLang merges them)."""
    ids = set(config_ids)
    generation_config = settings.model_path / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    return frozenset(int(i) for i in ids)


def create_app(settings: EngineSettings, engine: Engine, served: ServedModel, metrics: Metrics) -> FastAPI:
    """The engine's HTTP app: probes and metrics (miles.common), SGLang's routes, keys as settings say."""

    async def scheduler_alive() -> None:
        if not engine.scheduler.alive:
            raise RuntimeError("scheduler thread stopped")

    app = create_http_app(
        service=SERVICE,
        metrics=metrics,
        readiness_checks={"scheduler": scheduler_alive},
        openapi_hooks=[complete_openapi(engine.limits)],
    )
    add_routes(app, engine, settings, served)
    return app


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(EngineSettings, **parse_flags(argv))
    configure_logging(SERVICE, settings.log_level, json_lines=settings.log_json)
    setup_tracing(SERVICE)
    if not (settings.api_key.get_secret_value() or settings.admin_api_key.get_secret_value()):
        log.warning("no api_key or admin_api_key: every route is open to local callers (loopback development mode)")
    metrics = Metrics(SERVICE)
    try:
        engine, served = build_engine(settings, metrics)
    except ConfigError as exc:
        log.error("cannot start", extra={"error": exc.message, "field": exc.field})
        raise SystemExit(f"miles-engine: {exc.message}") from None

    async def stop_scheduler() -> None:
        await asyncio.to_thread(engine.scheduler.stop)

    asyncio.run(
        serve_async(
            http_app=create_app(settings, engine, served, metrics),
            http_host=settings.host,
            http_port=settings.port,
            grace_s=settings.shutdown_grace_s,
            on_shutdown=[stop_scheduler],
        )
    )
