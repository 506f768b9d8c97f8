"""`miles eval`: the greedy reward of a model directory on a dataset, with a job spec's agent and reward, on the
platform `miles up` started (its router, session server and sandbox gateway).

For one evaluation: a `miles-engine` process on the model directory (the initial model, or a trainer checkpoint's
`model/` directory) joins a router pool of its own, the session server gets a job config naming that pool, and
`miles.rollout.evaluate` runs one greedy episode per prompt (the spec's rollout section; `dataset` replaces its
dataset file); then the pool, the job config and the engine go away. `make run` evaluates the demo model before
and after training on held-out prompts with it. With `--job-id` and `--version` the score is recorded as that
version's (`recorded_eval_body`, `POST /v1/jobs/{id}/evals`): evaluation on an engine of its own that loads a
checkpoint, next to a job's own per-version evaluation (`miles.rollout.eval_loop`).

Limits: the local platform only (the engine runs on this machine); one engine per evaluation; which version a
checkpoint directory holds is the caller's word (`--version`), nothing checks it.
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from miles.cli.launcher import Layout, PlatformError, load_state
from miles.cli.platform_tokens import SESSION_OPERATOR, load_tokens, platform_tokens
from miles.common.jobspec.evaluation import EVAL_DATASET_NAME_PATTERN
from miles.common.jobspec.job import JobSpec
from miles.common.ports import free_port
from miles.common.spawn import ProcessSpec, console_script, settings_env, spawn, terminate
from miles.controller.backends.base import PlatformTokens
from miles.controller.backends.local_pool import RouterPool

if TYPE_CHECKING:
    from miles.rollout.evaluate import EvalResult

READY_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class PlatformEndpoints:
    """What an evaluation needs of the running platform."""

    router_url: str
    session_url: str
    operator_token: str
    sandbox_address: str
    sandbox_http_url: str
    tokens: PlatformTokens = field(default_factory=PlatformTokens)
    """The platform's control-API tokens (router admin, engine admin key ...)."""


def platform_endpoints(layout: Layout) -> PlatformEndpoints:
    state = load_state(layout)
    if state is None:
        raise PlatformError(f"no platform under {layout.home} (miles up)")
    services = state.services
    sandbox = services.get("sandbox")
    tokens = load_tokens(layout.run_dir)
    return PlatformEndpoints(
        router_url=services["router"].url,
        session_url=services["session"].url,
        operator_token=tokens.get(SESSION_OPERATOR, ""),
        sandbox_address=sandbox.url if sandbox is not None else "",
        sandbox_http_url=sandbox.ready_url.removesuffix("/readyz") if sandbox is not None else "",
        tokens=platform_tokens(tokens),
    )


@contextlib.contextmanager
def engine_process(model_dir: Path, log_path: Path, tokens: PlatformTokens) -> Iterator[str]:
    """A miles-engine on `model_dir` (its URL while the block runs; stopped after), its control routes behind the
    platform's engine admin key."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = (console_script("miles-engine"), "--model-path", str(model_dir), "--port", str(port))
    keys = {"admin_api_key": tokens.engine_admin_api_key, "api_key": tokens.engine_api_key}
    process = spawn(ProcessSpec(argv, log_path, env=settings_env("ENGINE", keys, omit_empty=True)))
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _ready(f"{url}/readyz"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise PlatformError(f"the evaluation engine did not start; see {log_path}")
            time.sleep(0.5)
        yield url
    finally:
        terminate(process, grace_s=30.0)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def eval_session_config(spec: JobSpec, model_dir: Path, job_id: str) -> dict[str, object]:
    """The evaluation's job config for the session server. `record_routing` is false: an evaluation trains on
    nothing, and its engine runs without --enable-return-routed-experts, so a MoE model's default (record the
    routing of every turn) would make every turn fail with an upstream routing mismatch."""
    return {
        "model_path": str(model_dir),
        "model_family": spec.model.family,
        "engine_pool": job_id,
        "chat_template_kwargs": spec.model.chat_template_kwargs,
        "record_routing": False,
    }


async def evaluate_model(
    endpoints: PlatformEndpoints,
    spec: JobSpec,
    model_dir: Path,
    *,
    log_dir: Path,
    dataset_path: str | None = None,
    limit: int | None = None,
    environment_args: dict[str, Any] | None = None,
) -> EvalResult:
    """The EvalResult (miles.rollout.evaluate) of `model_dir` on the spec's (or `dataset_path`'s) prompts; for a
    job with a hub environment, `environment_args` are merged into its args (e.g. another seed: held-out rows)."""
    from miles.rollout.evaluate import evaluate

    job_id = f"eval-{uuid.uuid4().hex[:10]}"
    rollout = spec.rollout
    if dataset_path is not None:
        rollout = rollout.model_copy(update={"dataset": rollout.dataset.model_copy(update={"path": dataset_path})})
    if environment_args and rollout.environment is not None:
        merged = {**rollout.environment.args, **environment_args}
        rollout = rollout.model_copy(update={"environment": rollout.environment.model_copy(update={"args": merged})})
    config = eval_session_config(spec, model_dir, job_id)
    headers = {"authorization": f"Bearer {endpoints.operator_token}"}
    session_config = f"{endpoints.session_url.rstrip('/')}/v1/jobs/{job_id}/config"
    pool = RouterPool(endpoints.router_url, admin_token=endpoints.tokens.router_admin)
    with engine_process(model_dir, log_dir / f"{job_id}-engine.log", endpoints.tokens) as engine_url:
        try:
            if not await pool.register(job_id, engine_url):
                raise PlatformError(f"the router refused the evaluation engine {engine_url}")
            async with httpx.AsyncClient(timeout=60.0) as http:
                (await http.put(session_config, json=config, headers=headers)).raise_for_status()
                try:
                    return await evaluate(
                        rollout,
                        job_id=job_id,
                        session_url=endpoints.session_url,
                        operator_token=endpoints.operator_token,
                        sandbox_http_url=endpoints.sandbox_http_url,
                        sandbox_address=endpoints.sandbox_address,
                        sandbox_token=endpoints.tokens.sandbox_job(job_id),
                        limit=limit,
                    )
                finally:
                    await http.delete(session_config, headers=headers)
        finally:
            await pool.deregister(job_id, engine_url)
            await pool.close()


def valid_dataset_name(name: str) -> bool:
    """Whether the controller accepts `name` as a dataset's name (checked before evaluating, not after)."""
    return re.fullmatch(EVAL_DATASET_NAME_PATTERN, name) is not None


def recorded_eval_body(
    result: EvalResult, spec: JobSpec, *, version: int, dataset_name: str, seen_unix_ms: int
) -> dict[str, Any]:
    """`miles eval --job-id --version`: the body of `POST /v1/jobs/{id}/evals` (evaluator `checkpoint`). One greedy
    episode per prompt, so pass@1 is the share of prompts whose reward reaches the spec's
    `evaluation.pass_threshold` (1.0 without an evaluation section); lag counts from `seen_unix_ms` (when this
    evaluation started: when the trainer wrote the checkpoint is not known here)."""
    threshold = spec.evaluation.pass_threshold if spec.evaluation is not None else 1.0
    passed = sum(reward >= threshold for reward in result.rewards)
    return {
        "version": version,
        "evaluator": "checkpoint",
        "seen_unix_ms": seen_unix_ms,
        "datasets": {
            dataset_name: {
                "mean_reward": result.mean_reward,
                "pass_at_k": {"1": passed / result.num_prompts} if result.num_prompts else {},
                "num_prompts": result.num_prompts,
                "num_episodes": result.num_prompts,
                "reasons": result.reasons,
            }
        },
    }


def eval_lines(evals: dict[str, Any], *, last: int = 5) -> list[str]:
    """`miles status`: the job's `last` evaluated versions (GET /v1/jobs/{id}/evals), one line each: per dataset
    the mean reward and pass@k, then the episodes discarded for running at another version, the lag from the
    evaluator's sighting of the version and the time since the trainer's step that produced it; a score
    an external evaluator recorded names it."""
    lines = []
    for result in evals.get("evals", [])[-last:]:
        if result["status"] == "missed":
            lines.append(f"  eval v{result['version']}: missed (the engines had moved past it)")
            continue
        evaluator = result.get("evaluator", "engines")
        by = "" if evaluator == "engines" else f" ({evaluator})"
        parts = []
        for name, scored in sorted(result["datasets"].items()):
            passes = " ".join(
                f"pass@{k} {v:.2f}" for k, v in sorted(scored["pass_at_k"].items(), key=lambda i: int(i[0]))
            )
            parts.append(
                f"{name} reward {scored['mean_reward']:.3f} {passes} ({scored['num_episodes']} eps, "
                f"{scored['num_discarded']} discarded)"
            )
        step_to_score = result.get("step_to_score_s")
        lag = f"lag {result['lag_s']:.1f}s"
        if step_to_score is not None:
            lag += f", {step_to_score:.1f}s after its step"
        lines.append(f"  eval v{result['version']}{by}: {'; '.join(parts)}; {lag}")
    return lines
