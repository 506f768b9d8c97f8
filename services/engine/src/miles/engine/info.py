"""The engine's self-description in SGLang's shapes: /model_info, /server_info, /v1/models and /v1/loads.

`version` reads "0.5.23+miles.engine.<ours>": the SGLang release whose protocol this engine follows
(docs/sglang-protocol.md), with a local part saying what it really is.
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


def loads(engine: Engine, settings: EngineSettings) -> dict[str, Any]:
    snapshot = engine.scheduler.snapshot()
    load = {
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
