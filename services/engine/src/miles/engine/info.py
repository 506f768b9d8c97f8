"""The engine's self-description in SGLang's shapes: /model_info, /server_info, /v1/models and /v1/loads.

`version` reads "0.5.23+miles.engine.<ours>": the SGLang release whose protocol this engine follows
(docs/sglang-protocol.md), with a local part saying what it really is.

LoRA (docs/sglang-protocol.md §10): /server_info reports SGLang's LoRA server args plus the adapters loaded now;
/v1/loads reports a `lora` section when `include` names `lora` or `all` (the other optional sections, memory, spec,
disagg and queues, are not reported).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any

from miles.engine.core import Engine
from miles.engine.settings import EngineSettings

ENGINE_VERSION = "0.5.23+miles.engine.0.1.0"


@dataclass
class ServedModel:
    """What /model_info reports; model_path follows successful disk weight updates, as SGLang's does."""

    model_path: str
    tokenizer_path: str
    served_model_name: str
    created_s: int


def model_info(engine: Engine, served: ServedModel) -> dict[str, Any]:
    runner_info = engine.runner.info
    return {
        "model_path": served.model_path,
        "tokenizer_path": served.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.scheduler.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": runner_info.model_type,
        "architectures": list(runner_info.architectures),
    }


def server_info(engine: Engine, settings: EngineSettings, served: ServedModel) -> dict[str, Any]:
    snapshot = engine.scheduler.snapshot()
    return {
        "model_path": served.model_path,
        "tokenizer_path": served.tokenizer_path,
        "served_model_name": served.served_model_name,
        "host": settings.host,
        "port": settings.port,
        "context_length": engine.limits.context_length,
        "max_total_tokens": settings.max_total_tokens,
        "max_total_num_tokens": settings.max_total_tokens,
        "max_req_input_len": engine.limits.context_length - 1,
        "max_running_requests": settings.max_running_requests,
        "max_prefill_tokens": settings.max_prefill_tokens,
        "page_size": 1,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "disaggregation_mode": "null",
        "disable_radix_cache": settings.disable_radix_cache,
        "enable_deterministic_inference": settings.deterministic,
        "enable_return_routed_experts": settings.enable_return_routed_experts,
        "fake_model": settings.fake_model,
        "weight_version": engine.scheduler.weight_version,
        **lora_server_args(engine, settings),
        "device": engine.runner.device,
        "version": ENGINE_VERSION,
        "internal_states": [
            {
                "last_gen_throughput": snapshot.gen_throughput,
                "memory_usage": {"token_capacity": snapshot.max_total_num_tokens},
                "num_running_reqs": snapshot.num_running_reqs,
                "num_waiting_reqs": snapshot.num_waiting_reqs,
            }
        ],
    }


def models(engine: Engine, served: ServedModel) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": served.served_model_name,
                "object": "model",
                "created": served.created_s,
                "owned_by": "sglang",
                "root": served.model_path,
                "max_model_len": engine.limits.context_length,
            }
        ],
    }


def lora_server_args(engine: Engine, settings: EngineSettings) -> dict[str, Any]:
    """SGLang's LoRA server args as given (max_loaded_loras with its default applied), and, a miles addition,
    `loaded_lora_adapters`: lora_name -> lora_path of every adapter loaded now (SGLang's `loaded_adapters`)."""
    return {
        "enable_lora": settings.enable_lora,
        "lora_paths": list(settings.lora_paths),
        "max_loras_per_batch": settings.max_loras_per_batch,
        "max_loaded_loras": settings.effective_max_loaded_loras,
        "max_lora_rank": settings.max_lora_rank,
        "lora_target_modules": settings.lora_target_modules,
        "loaded_lora_adapters": engine.adapters.loaded,
    }


def lora_load(engine: Engine) -> dict[str, Any] | None:
    """/v1/loads' `lora` section: SGLang's slot fields, where a slot is a resident adapter (every adapter is
    resident here, so slots_total is max_loaded_loras; an adapter unloading holds its slot until its requests
    end), plus the loaded adapters and how many are unloading. None (JSON null) without --enable-lora."""
    adapters = engine.adapters
    if not adapters.enabled:
        return None
    loaded = adapters.loaded
    used = len(loaded) + adapters.num_unloading
    total = adapters.max_loaded_loras
    return {
        "slots_used": used,
        "slots_total": total,
        "utilization": used / total if total else 0.0,
        "loaded_adapters": loaded,
        "num_unloading_adapters": adapters.num_unloading,
    }


def loads(engine: Engine, settings: EngineSettings, include: str = "core") -> dict[str, Any]:
    """/v1/loads; `include` is SGLang's comma-separated list of sections (core is always there)."""
    sections = {part.strip() for part in include.split(",")}
    snapshot = engine.scheduler.snapshot()
    load: dict[str, Any] = {
        "dp_rank": 0,
        "num_running_reqs": snapshot.num_running_reqs,
        "num_waiting_reqs": snapshot.num_waiting_reqs,
        "num_waiting_uncached_tokens": snapshot.num_waiting_tokens,
        "num_used_tokens": snapshot.num_used_tokens,
        "num_total_tokens": snapshot.num_used_tokens,
        "max_total_num_tokens": snapshot.max_total_num_tokens,
        "max_running_requests": settings.max_running_requests,
        "token_usage": snapshot.token_usage,
        "gen_throughput": snapshot.gen_throughput,
        "cache_hit_rate": snapshot.cache_hit_rate,
        "utilization": snapshot.num_running_reqs / settings.max_running_requests,
    }
    if sections & {"lora", "all"}:
        load["lora"] = lora_load(engine)
    timestamp = datetime.datetime.now(datetime.UTC).isoformat()
    return {"timestamp": timestamp, "version": ENGINE_VERSION, "loads": [load]}


def legacy_load(engine: Engine) -> list[dict[str, Any]]:
    """/get_load: the deprecated shape older routers poll."""
    snapshot = engine.scheduler.snapshot()
    return [
        {
            "dp_rank": 0,
            "num_reqs": snapshot.num_running_reqs + snapshot.num_waiting_reqs,
            "num_waiting_reqs": snapshot.num_waiting_reqs,
            "num_tokens": snapshot.num_used_tokens,
            "num_pending_tokens": snapshot.num_waiting_tokens,
            "ts_tic": time.time(),
        }
    ]
