"""Rollout Routing Replay (R3) as the controller sees it: what it can read of a job's model (MoE or dense, from the
Hugging Face `config.json` at `spec.model.path`), the submission check of `train.routing_replay`, and what it
tells the session server and the engines.

`train.routing_replay` reaches the trainer as it is (part of `train` in `trainer.json`); the session server gets
`record_routing` in the job config (true / false; omitted for None, so that the session server decides from the
model) and answers the value it resolved; the engines of both backends get `--enable-return-routed-experts` when
the job records routing (`engines_record_routing`: the spec's value when set, else what the controller read of the
model, else what the session server resolved at registration).

Limits: the controller reads the config only where `spec.model.path` is a directory on its own filesystem (the
local backend; on Kubernetes only when the controller mounts the models): elsewhere (a Hub id, a path inside the
pods) nothing is refused here, and the session server, the engines and the trainer refuse a dense model at their
start. Only Qwen3-MoE (`routing_shape_from_hf_config`) is recognised as MoE; a config that names experts in another
architecture is "unknown", never refused as dense. A job registered without a session server (an empty
`session_url`: tests, partial stacks) and a model the controller cannot read gets no flag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.common.contracts.routing import RoutingShape, routing_shape_from_hf_config
from miles.common.jobspec.job import JobSpec
from miles.controller.errors import RoutingReplayNeedsMoEError

ENGINE_ROUTING_FLAG = "--enable-return-routed-experts"
"""The engine's flag (SGLang's and miles-engine's) that makes `/generate` answer the routed experts."""
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelRouting:
    """What the controller knows of the model's routing: `known` False when config.json could not be read or
    names experts of an architecture miles does not model; else `shape` (None: a dense model)."""

    known: bool
    shape: RoutingShape | None = None

    @property
    def is_dense(self) -> bool:
        return self.known and self.shape is None

    @property
    def is_moe(self) -> bool:
        return self.known and self.shape is not None


UNKNOWN = ModelRouting(known=False)


def read_model_routing(model_path: str) -> ModelRouting:
    """The routing of the checkpoint at `model_path` from its config.json; UNKNOWN when that is not a readable
    JSON object (a Hub id, a path this process does not mount, a broken file: the services that load the model
    report those)."""
    config_path = Path(model_path) / "config.json"
    try:
        if config_path.stat().st_size > _MAX_CONFIG_BYTES:
            return UNKNOWN
        config: Any = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return UNKNOWN
    if not isinstance(config, dict):
        return UNKNOWN
    try:
        shape = routing_shape_from_hf_config(config)
    except (KeyError, TypeError, ValueError):
        return UNKNOWN
    if shape is None and config.get("model_type") != "qwen3_moe" and any(config.get(k) for k in _EXPERT_COUNT_KEYS):
        return UNKNOWN  # MoE of an architecture the shape reader does not know: not ours to call dense
    return ModelRouting(known=True, shape=shape)


def check_routing_replay(spec: JobSpec, routing: ModelRouting) -> None:
    """Refuse `train.routing_replay: true` with a model known to be dense (422, field `train.routing_replay`)."""
    if spec.train.routing_replay is True and routing.is_dense:
        raise RoutingReplayNeedsMoEError(
            f"train.routing_replay is true but the model at {spec.model.path} is dense (its config.json has no "
            "MoE layers): there is no routing to replay; leave routing_replay unset (on for MoE models) or false",
            field="train.routing_replay",
        )


def session_record_routing(spec: JobSpec) -> dict[str, bool]:
    """The session server's job-config entry: `record_routing` = train.routing_replay when set; nothing when None
    (the session server then records routing exactly when the model is MoE)."""
    replay = spec.train.routing_replay
    return {} if replay is None else {"record_routing": replay}


def engines_record_routing(spec: JobSpec, routing: ModelRouting, resolved: bool | None = None) -> bool:
    """Whether the job's engines must answer routed experts: `train.routing_replay` when set; unset, whether the
    model is MoE as the controller reads it, or when it cannot read the model, `resolved` (the session server's
    `record_routing` from the job's registration; None: unknown, no flag)."""
    replay = spec.train.routing_replay
    if replay is not None:
        return replay
    if routing.known:
        return routing.is_moe
    return bool(resolved)
