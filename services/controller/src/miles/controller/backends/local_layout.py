"""What the local backend runs for one job: the argv, environment and config file of each per-job process.

One job on this machine is:

- `engine-<i>`: `miles-engine --model-path <spec.model.path> --port <free> --weight-version 0 <extra_args>`
  (`--fake-model` only when the spec's `resources.engines.extra_args` carry it), plus
  `--enable-return-routed-experts` when the job records MoE routing (R3: `train.routing_replay` true, or unset
  with a MoE model, or unset with a model the controller cannot read and the session server's resolved
  `record_routing` true; extra_args naming the flag either way win);
- `weightsync` (transport `stream` only): one `miles-weight-sync` daemon, the job's origin, which the trainer
  publishes to and which loads every engine of the job itself (the weight-sync README's one-process setup: no
  peers), draining engines through the router's admin API in the job's pool (lossless deltas to the engines; its
  store and scratch space in the job dir);
- `worker-<i>`: `miles-rollout-worker` with `{"rollout": ...}` in `MILES_ROLLOUT_CONFIG_FILE`;
- `trainer`: `miles-trainer` (torchrun when `resources.trainer.replicas` > 1) with `MILES_TRAINER_CONFIG_FILE`,
  whose `publish` section is what the chart gives the trainer on Kubernetes (`trainer_publish_section`): the
  origin's address (stream), or the router pool of the job's engines that it drives itself (nccl over gloo on
  the CPU, disk into `<job dir>/published`).

Config files, logs and pid files live in the job directory. Nothing here starts a process.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles.common.jobspec.job import JobSpec
from miles.common.jobspec.pools import inference_pool_router_name
from miles.common.ports import free_port
from miles.common.spawn import SettingValue, console_script, settings_env
from miles.controller.backends.base import PlatformTokens, SharedServices, barrier_settings
from miles.controller.backends.local_processes import ProcessRecord
from miles.controller.engine_args import names_flag
from miles.controller.routing_replay import ENGINE_ROUTING_FLAG, engines_record_routing, read_model_routing


def _write_json(path: Path, data: dict[str, Any]) -> str:
    path.write_text(json.dumps(data, indent=1))
    return str(path)


def unsupported(spec: JobSpec, shared: SharedServices) -> tuple[str, str] | None:
    """(field, why) for the first part of `spec` the local backend cannot run; None when it can run all of it."""
    if spec.kueue is not None:
        return "kueue", "kueue (admission by Kueue) needs the kubernetes backend on a release with kueue.enabled"
    pool_name = spec.resources.engines.shared_pool
    if pool_name is not None:
        if shared.shared_pool(pool_name) is None:
            declared = [pool.name for pool in shared.shared_pools]
            return "resources.engines.shared_pool", f"no shared engine pool {pool_name!r} is declared ({declared})"
        return None
    for pool in spec.inference_pools:
        if pool.kind != "cpu":
            return "inference_pools", (
                f"inference pool {pool.name!r} has kind {pool.kind!r}, which needs the kubernetes backend (the local "
                "backend runs miles-engine: kind 'cpu')"
            )
    if spec.resources.engines.kind != "cpu":
        kind = spec.resources.engines.kind
        return "resources.engines.kind", (
            f"engines.kind {kind!r} needs the kubernetes backend (the local backend runs miles-engine: kind 'cpu')"
        )
    return None


def uses_weightsync(spec: JobSpec) -> bool:
    """Whether the job has a weight-sync origin (stream); nccl and disk go from the trainer to the engines, and a job
    on a shared pool publishes adapters to the pool's engines itself."""
    return spec.weight_sync.transport == "stream" and spec.resources.engines.shared_pool is None


def token_env(service_env_name: str, tokens: Mapping[str, str]) -> dict[str, str]:
    """The service's variables of the tokens that are set (an unset one leaves the setting's empty default)."""
    return settings_env(service_env_name, tokens, omit_empty=True)


def _engines_record_routing(spec: JobSpec, record_routing: bool | None) -> bool:
    """Whether to add ENGINE_ROUTING_FLAG: the job records routing and its extra_args do not set the flag."""
    if names_flag(spec.resources.engines.extra_args, ENGINE_ROUTING_FLAG):
        return False
    return engines_record_routing(spec, read_model_routing(spec.model.path), record_routing)


def engine_process(
    name: str, model_path: str, args: list[str], log_dir: Path, tokens: PlatformTokens, extra: dict[str, Any]
) -> ProcessRecord:
    """A `miles-engine` on a free port serving `model_path` at version 0, with `args` after the common ones."""
    port = free_port()
    argv = [console_script("miles-engine"), "--model-path", model_path, "--port", str(port), "--weight-version", "0"]
    url = f"http://127.0.0.1:{port}"
    return ProcessRecord(
        name=name,
        role="engine",
        argv=[*argv, *args],
        env={
            **settings_env("ENGINE", {"log_json": False}),
            **token_env("ENGINE", {"admin_api_key": tokens.engine_admin_api_key, "api_key": tokens.engine_api_key}),
        },
        log_path=str(log_dir / f"{name}.log"),
        ready_url=f"{url}/readyz",
        url=url,
        extra=extra,
    )


def engine_record(
    job_dir: Path, spec: JobSpec, index: int, tokens: PlatformTokens, *, record_routing: bool | None = None
) -> ProcessRecord:
    """Engine `index`; `record_routing` is the session server's resolved value (used when this process cannot read
    the model)."""
    args = list(spec.resources.engines.extra_args)
    if _engines_record_routing(spec, record_routing):
        args.append(ENGINE_ROUTING_FLAG)
    return engine_process(f"engine-{index}", spec.model.path, args, job_dir, tokens, {"index": index})


def inference_engine_records(job_dir: Path, job_id: str, spec: JobSpec, tokens: PlatformTokens) -> list[ProcessRecord]:
    """The engines of the job's inference pools (`<pool>-<i>`, role `inference`), each registered at the router in
    its pool's own router pool (`router_pool`), never loaded with new weights."""
    records = []
    for pool in spec.inference_pools:
        for index in range(pool.replicas):
            extra = {"index": index, "router_pool": inference_pool_router_name(job_id, pool.name)}
            record = engine_process(
                f"{pool.name}-{index}", pool.model_path, list(pool.extra_args), job_dir, tokens, extra
            )
            record.role = "inference"
            records.append(record)
    return records


def weightsync_record(
    job_dir: Path, job_id: str, spec: JobSpec, shared: SharedServices, engine_urls: list[str]
) -> ProcessRecord:
    """The job's weight-sync origin loading `engine_urls` (rebuilt, same ports, when the engine set changes)."""
    port, metrics_port = free_port(), free_port()
    record = ProcessRecord(
        name="weightsync",
        role="weightsync",
        argv=[console_script("miles-weight-sync")],
        env={},
        log_path=str(job_dir / "weightsync.log"),
        ready_url=f"http://127.0.0.1:{metrics_port}/readyz",
        url=f"127.0.0.1:{port}",
        extra={"port": port, "metrics_port": metrics_port},
    )
    write_weightsync_config(job_dir, job_id, spec, shared, record, engine_urls)
    return record


def write_weightsync_config(
    job_dir: Path, job_id: str, spec: JobSpec, shared: SharedServices, record: ProcessRecord, engine_urls: list[str]
) -> None:
    config = {
        "job_id": job_id,
        "port": record.extra["port"],
        "metrics_port": record.extra["metrics_port"],
        "engine_urls": engine_urls,
        "router_url": shared.router_url,
        "pool": job_id,
        "pause_mode": spec.pause_mode if shared.router_url else "retract",
        "store_dir": str(job_dir / "weights" / "store"),
        "work_dir": str(job_dir / "weights" / "work"),
        "model_config_dir": spec.model.path,
        "log_json": False,
    }
    path = _write_json(job_dir / "weightsync.json", config)
    tokens = {
        "auth_token": shared.tokens.weightsync,
        "router_admin_token": shared.tokens.router_admin,
        "engine_admin_api_key": shared.tokens.engine_admin_api_key,
        "engine_api_key": shared.tokens.engine_api_key,
    }
    record.env = {**settings_env("WEIGHTSYNC", {"config_file": path}), **token_env("WEIGHTSYNC", tokens)}


def teacher_router_pool(job_id: str, spec: JobSpec) -> str:
    """The router pool of the job's distillation teacher ("" without `train.distillation`)."""
    distillation = spec.train.distillation
    return inference_pool_router_name(job_id, distillation.teacher_pool) if distillation is not None else ""


def worker_record(job_dir: Path, job_id: str, spec: JobSpec, shared: SharedServices, index: int) -> ProcessRecord:
    port = free_port()
    name = f"worker-{index}"
    config = {"rollout": spec.rollout.model_dump(mode="json")}
    if spec.evaluation is not None:
        config["evaluation"] = spec.evaluation.model_dump(mode="json")
    config_path = _write_json(job_dir / f"{name}.json", config)
    settings: dict[str, SettingValue] = {
        "port": port,
        "job_id": job_id,
        "worker_id": f"{job_id}-{name}",
        "config_file": config_path,
        "redis_url": shared.redis_url,
        "session_server_url": shared.session_url,
        "session_operator_token": shared.session_operator_token,
        "inference_pools": {pool.name: inference_pool_router_name(job_id, pool.name) for pool in spec.inference_pools},
        "router_url": shared.router_url,
        "teacher_pool": teacher_router_pool(job_id, spec),
        **barrier_settings(spec),
        "buffer_address": shared.buffer_address,
        "sandbox_address": shared.sandbox_address,
        "sandbox_http_url": shared.sandbox_http_url,
        "log_json": False,
    }
    env = {
        **settings_env("ROLLOUT", settings),
        **token_env("ROLLOUT", {"sandbox_token": shared.tokens.sandbox_job(job_id)}),
    }
    url = f"http://127.0.0.1:{port}"
    return ProcessRecord(
        name=name,
        role="worker",
        argv=[console_script("miles-rollout-worker")],
        env=env,
        log_path=str(job_dir / f"{name}.log"),
        ready_url=f"{url}/readyz",
        url=url,
        extra={"index": index},
    )


def publish_dir(job_dir: Path) -> Path:
    return job_dir / "published"


def trainer_publish_section(
    job_dir: Path, job_id: str, spec: JobSpec, shared: SharedServices, origin: str
) -> dict[str, Any]:
    """The trainer's `publish` settings for the spec's transport (what the chart sets on Kubernetes); a job on a
    shared pool publishes adapter versions into the pool's engines."""
    pool_name = spec.resources.engines.shared_pool
    if pool_name is not None:
        return {
            "kind": "adapter",
            "dtype": spec.weight_sync.dtype,
            "router_url": shared.router_url,
            "pool": pool_name,
            "session_url": shared.session_url,
            "dir": str(publish_dir(job_dir)),
        }
    transport = spec.weight_sync.transport
    section: dict[str, Any] = {"kind": transport, "dtype": spec.weight_sync.dtype}
    if transport == "stream":
        section["weightsync_address"] = origin
        return section
    section.update(router_url=shared.router_url, pool=job_id, pause_mode=spec.pause_mode)
    if transport == "nccl":
        section.update(nccl_master_address="127.0.0.1", nccl_master_port=0, nccl_backend="gloo")
    else:
        section["dir"] = str(publish_dir(job_dir))
    return section


def _trainer_tokens(shared: SharedServices) -> dict[str, str]:
    return {
        "auth_token": shared.tokens.trainer,
        "weightsync_auth_token": shared.tokens.weightsync,
        "engine_admin_api_key": shared.tokens.engine_admin_api_key,
        "engine_api_key": shared.tokens.engine_api_key,
        "router_admin_token": shared.tokens.router_admin,
        "session_operator_token": shared.session_operator_token,
    }


def trainer_record(job_dir: Path, job_id: str, spec: JobSpec, shared: SharedServices, origin: str) -> ProcessRecord:
    """The trainer; `origin` is the job's weight-sync origin (host:port) for the stream transport."""
    port, metrics_port = free_port(), free_port()
    config = {
        "job_id": job_id,
        "port": port,
        "metrics_port": metrics_port,
        "buffer_address": shared.buffer_address,
        "model_path": spec.model.path,
        "checkpoint_dir": str(job_dir / "checkpoints"),
        "backend": spec.resources.trainer.backend,
        "train": spec.train.model_dump(mode="json"),
        "publish": trainer_publish_section(job_dir, job_id, spec, shared, origin),
        "log_json": False,
    }
    path = _write_json(job_dir / "trainer.json", config)
    script = console_script("miles-trainer")
    replicas = spec.resources.trainer.replicas
    argv = [script]
    if replicas > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(replicas)]
        argv += ["--master_port", str(free_port()), script]
    return ProcessRecord(
        name="trainer",
        role="trainer",
        argv=argv,
        env={**settings_env("TRAINER", {"config_file": path}), **token_env("TRAINER", _trainer_tokens(shared))},
        log_path=str(job_dir / "trainer.log"),
        ready_url=f"http://127.0.0.1:{metrics_port}/readyz",
        url=f"127.0.0.1:{port}",
        extra={"port": port, "metrics_port": metrics_port},
    )
