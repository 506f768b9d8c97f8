"""verifiers (0.4.0): a taskset loaded by id, played by its environment (its harness, its multi-turn protocol),
scored by its own rewards, every model call through the session endpoint.

Args (the job spec's `rollout.environment.args`):

    env_id      the taskset id (`--env.taskset.id` of `vf-eval`): an installed package exporting a `vf.Taskset`
                (a hub id `owner/name@version` imports `name`); required
    env_args    the taskset's own config fields (its `TasksetConfig` subclass, e.g. {"num_tasks": 64}); default {}
    env_config  the other fields of verifiers' `EnvConfig` (the `[env]` block of a verifiers run): `id` pairs a
                reusable environment (`user-sim`, `best-of-n`) with the taskset, a role's settings
                (`{"agent": {"max_turns": 4, "harness": {"id": "null"}}}`), `timeout`, `retries`; default {}
    split       sets the taskset's `split` field (for tasksets that have one; verifiers 0.4.0 itself has no
                train/eval split); default: the taskset's own
    num_rows    serve the first N tasks only (required for an infinite taskset)

verifiers 0.4.0 is not the 0.1 API (`load_environment(env_id, **kwargs)`, a dataset, a Rubric, a Parser): an
environment is an `Env` over a `Taskset` of `Task`s; each role (seat) of the environment is an agent, a harness
program (verifiers' chat loop for the `null` and `bash` harnesses) whose model calls go to a per-rollout
interception server that records the trace and forwards them to the model endpoint; the task's `@vf.reward`
methods score the trace. So a row is one task (`rows`), and an episode is verifiers' own `Env.run_slot` of that
task with the episode's session as the model endpoint (`run_episode`): the reward is the weighted sum of the
task's rewards (averaged over the episode's trainable traces when an environment has several, as verifiers'
dashboard does), `reward_info` holds each reward's score and each metric.

Choices and limits:
- Every role's harness runs as a local subprocess of this server (`{"type": "subprocess"}`) unless `env_config`
  pins its runtime: verifiers' default is a Prime sandbox (a remote service), and this server's pod is the box.
  Harnesses that need a container (Claude Code, Codex, ...) are refused by verifiers on that runtime.
- The chat loop of the `null` and `bash` harnesses is a script verifiers provisions with `uv sync` on first
  use, a network install at episode time; here it runs on this interpreter, which the lock already gives its
  dependencies (`_provision_chat_program`). Other uv-provisioned programs (terminus-2, mini-swe-agent) still
  need the network.
- Each rollout has its own interception server (verifiers' path for an environment outside `Env.serving()`):
  the shared one of `serving()` keeps one HTTP client per endpoint for its whole life, and every miles episode
  has its own endpoint. Hence taskset-wide tool servers (`Taskset.toolsets`, started by `serving()`) are refused
  at setup; per-task tool servers (`Task.toolsets`) work.
- Every agent of an episode calls the session endpoint, also an untrainable one (user-sim's simulated user):
  verifiers marks its trace untrainable, the session records its tokens all the same.
- A failed episode (a harness or scoring error, an unreachable endpoint) raises, so the worker aborts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

from miles.envserver.base import ConnectorArgsError, Environment
from miles.envserver.protocol import EpisodeRequest, EpisodeResult, Row

DEFAULT_MODEL = "policy"
"""The model name of every call unless request_kwargs has `model` (the session serves one policy)."""
MAX_ROWS = 1_000_000
_ARGS = ("env_id", "env_args", "env_config", "split", "num_rows")
_KEY_VARIABLE_PREFIX = "MILES_SESSION_API_KEY_"
"""verifiers reads an endpoint's key from an environment variable, by name; its subprocess runtime keeps any
variable with API_KEY in its name from the harness programs."""
_SUBPROCESS = {"type": "subprocess"}
_QUIET_LOGGERS = ("verifiers", "httpx", "aiohttp.access")
"""Loggers that log every rollout and request at INFO (six lines an episode): warnings only."""


class EpisodeFailedError(RuntimeError):
    """verifiers recorded the episode as failed (its errors are in the message)."""


def _dict_arg(args: dict[str, Any], name: str) -> dict[str, Any]:
    value = args.get(name, {})
    if not isinstance(value, dict):
        raise ConnectorArgsError(f"{name} must be an object, got {value!r}")
    return dict(value)


def _num_rows(args: dict[str, Any]) -> int | None:
    value = args.get("num_rows")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ROWS:
        raise ConnectorArgsError(f"num_rows must be an integer in [1, {MAX_ROWS}], got {value!r}")
    return value


def _roles(config_type: Any) -> list[str]:
    """The agent seats an EnvConfig class declares (each an AgentConfig field with a default instance)."""
    import verifiers.v1 as vf

    return [name for name, field in config_type.model_fields.items() if isinstance(field.default, vf.AgentConfig)]


def _with_split(env_id: str, taskset: dict[str, Any], split: Any) -> dict[str, Any]:
    import verifiers.v1 as vf

    options = vf.taskset_config_type(env_id).model_fields
    if "split" not in options:
        raise ConnectorArgsError(f"split: taskset {env_id} has no split; its options: {sorted(options)}")
    return {**taskset, "split": split}


def _on_subprocess(env_id: str, rest: dict[str, Any]) -> dict[str, Any]:
    """`rest` with every role's runtime set to a local subprocess where it sets none."""
    import verifiers.v1 as vf

    rest = dict(rest)
    for role in _roles(vf.env_config_type(env_id, rest.get("id") or "")):
        seat = rest.get(role) or {}
        if not isinstance(seat, dict):
            raise ConnectorArgsError(f"env_config.{role} must be an object, got {seat!r}")
        rest[role] = {"runtime": _SUBPROCESS, **seat}
    return rest


def env_config(args: dict[str, Any]) -> Any:
    """verifiers' `EnvConfig` for `args` (its concrete subclass, validated), roles on the subprocess runtime."""
    import verifiers.v1 as vf

    unknown = sorted(set(args) - set(_ARGS))
    if unknown:
        raise ConnectorArgsError(f"unknown args {unknown}; verifiers takes {list(_ARGS)}")
    env_id = args.get("env_id")
    if not isinstance(env_id, str) or not env_id:
        raise ConnectorArgsError("env_id is required: the id of an installed verifiers taskset (e.g. miles-vf-arith)")
    taskset, rest = _dict_arg(args, "env_args"), _dict_arg(args, "env_config")
    if "id" in taskset:
        raise ConnectorArgsError("env_args.id: the taskset id is env_id")
    if "taskset" in rest:
        raise ConnectorArgsError("env_config.taskset: give the taskset's fields as env_args")
    try:
        if "split" in args:
            taskset = _with_split(env_id, taskset, args["split"])
        data = {**_on_subprocess(env_id, rest), "taskset": {**taskset, "id": env_id}}
    except ImportError as exc:  # ModuleNotFoundError: no such taskset or environment installed
        raise ConnectorArgsError(f"env_id/env_config.id: {exc}") from exc
    try:
        return vf.resolve_env_config(data)
    except ImportError as exc:  # a role's harness that is not installed
        raise ConnectorArgsError(f"env_config: {exc}") from exc
    except ValueError as exc:  # pydantic's ValidationError; its field paths: taskset.* is env_args.*
        raise ConnectorArgsError(f"verifiers refused the config (taskset.X is env_args.X): {exc}") from exc


def _check_installed(requirements: list[str]) -> None:
    for requirement in requirements:
        name = re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            raise RuntimeError(f"verifiers' chat program needs {requirement}: not in this interpreter") from None
        pinned = requirement.partition("==")[2].strip()
        if pinned and version != pinned:
            raise RuntimeError(f"verifiers' chat program needs {requirement}, this interpreter has {version}")


def _provision_chat_program() -> None:
    """Register verifiers' bundled chat program (the `null` and `bash` harnesses) as prepared on this interpreter.

    `Runtime.prepare_uv_script` runs `uv sync --script` (installing uv when missing) the first time a script is
    used, then records the script's interpreter in the subprocess runtime's table of prepared scripts, keyed by
    the script's content-addressed path; later calls only read the table. Writing the script there and recording
    this interpreter is what that first call would leave, minus the network install of unpinned packages (it
    fetched openai 3.x when tried): the program's dependencies (its PEP 723 header, checked here) come from the
    lock. The harnesses then run `<this python> <script>`, or with `activate`, the same with this venv on PATH.
    """
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM, CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    header = re.search(r"^# dependencies = (\[.*\])$", CHAT_PROGRAM, re.MULTILINE)
    if header is None:
        raise RuntimeError("verifiers' chat program declares no dependencies (an unknown verifiers version?)")
    _check_installed(json.loads(header.group(1)))
    data = CHAT_PROGRAM_SOURCE.encode()
    scripts_dir = SubprocessRuntime.scripts_dir
    path = f"{scripts_dir}/{hashlib.sha256(data).hexdigest()}.py"  # as prepare_uv_script names it
    os.makedirs(scripts_dir, exist_ok=True)
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "wb") as file:
        file.write(data)
    os.replace(partial, path)
    SubprocessRuntime._interpreters[path] = sys.executable


class _SessionKeys:
    """Each episode's session API key in an environment variable of its own while the episode runs."""

    def __init__(self) -> None:
        self._users: Counter[str] = Counter()

    @contextlib.contextmanager
    def variable(self, api_key: str) -> Iterator[str]:
        name = _KEY_VARIABLE_PREFIX + hashlib.sha256(api_key.encode()).hexdigest()[:24].upper()
        os.environ[name] = api_key
        self._users[name] += 1
        try:
            yield name
        finally:
            self._users[name] -= 1
            if not self._users[name]:
                del self._users[name]
                os.environ.pop(name, None)


def _model_context(request: EpisodeRequest, key_variable: str) -> Any:
    import verifiers.v1 as vf

    sampling = dict(request.request_kwargs)
    model = str(sampling.pop("model", DEFAULT_MODEL))
    client = vf.EvalClientConfig(base_url=request.base_url, api_key_var=key_variable)
    return vf.ModelContext(model=model, client=client, sampling=vf.SamplingConfig.model_validate(sampling))


def _prompt(data: Any) -> str | list[dict[str, Any]]:
    """The task's opening messages as the model first sees them (its system prompt first)."""
    from verifiers.v1.dialects.chat import message_to_wire

    messages: list[dict[str, Any]] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages.extend(message_to_wire(message) for message in data.prompt)
    return messages or ""


def _row(task: Any) -> Row:
    fields = task.data.model_dump(mode="json")
    info = {"task_key": task.key, "task_idx": task.data.idx, "task_id": task.data.id}
    return Row(prompt=_prompt(task.data), label=fields.get("answer"), info=info)


def _failure(episode: Any) -> str:
    errors = [*episode.errors, *(error for trace in episode.traces for error in trace.errors)]
    if not errors:
        return "verifiers marked the episode failed without an error"
    return "; ".join(f"{error.type}: {error.message}" for error in errors[-3:])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _result(episode: Any) -> EpisodeResult:
    if not episode.ok:
        raise EpisodeFailedError(_failure(episode))
    scored = [trace for trace in episode.traces if trace.agent.trainable] or list(episode.traces)
    rewards: dict[str, list[float]] = {}
    metrics: dict[str, list[float]] = {}
    for trace in scored:
        for name, reward in trace.rewards.items():
            if reward is not None:
                rewards.setdefault(name, []).append(float(reward.score))
        for name, value in trace.metrics.items():
            if value is not None:
                metrics.setdefault(name, []).append(float(value))
    reward_info = {
        "rewards": {name: _mean(scores) for name, scores in rewards.items()},
        "metrics": {name: _mean(values) for name, values in metrics.items()},
    }
    metadata = {
        "episode_id": episode.id,
        "env": episode.env.id,
        "num_turns": int(episode.num_turns),
        "stop_conditions": [trace.stop_condition for trace in scored],
        "is_timeout": bool(episode.is_timeout or any(trace.is_timeout for trace in scored)),
    }
    reward = _mean([float(trace.reward) for trace in scored])
    return EpisodeResult(reward=reward, reward_info=reward_info, metadata=metadata)


class VerifiersEnvironment(Environment):
    connector = "verifiers"

    def __init__(self, config: Any, num_rows: int | None) -> None:
        self.config = config
        self.num_rows = num_rows
        self.env: Any = None
        self.tasks: list[Any] = []
        self._rows: list[Row] = []
        self._keys = _SessionKeys()

    @property
    def name(self) -> str:
        return str(self.config.env_id)

    async def setup(self) -> None:
        import verifiers.v1 as vf

        for name in _QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
        _provision_chat_program()
        self.env = await asyncio.to_thread(vf.load_environment, self.config)
        taskset = self.env.taskset
        if type(taskset).toolsets(taskset.config):
            raise RuntimeError(f"{self.name}: taskset-wide tool servers (Taskset.toolsets) are not supported")
        if self.num_rows is not None:
            taskset = taskset.take(self.num_rows)
        elif not taskset.bounded:
            raise ConnectorArgsError(f"num_rows is required: taskset {self.name} is infinite")
        self.tasks = await asyncio.to_thread(list, taskset)  # load() is the taskset's code (may read files)
        if not self.tasks:
            raise RuntimeError(f"{self.name}: the taskset has no tasks")
        self._rows = [_row(task) for task in self.tasks]
        await self.env.start()

    async def close(self) -> None:
        if self.env is not None:
            await self.env.stop()

    def rows(self) -> list[Row]:
        return self._rows

    def _task_of(self, request: EpisodeRequest) -> Any:
        task = self.tasks[request.row_index]
        key = request.row.info.get("task_key")
        if key is not None and key != task.key:
            raise ValueError(f"row {request.row_index} is another task here (its task_key differs): rows changed")
        return task

    async def run_episode(self, request: EpisodeRequest) -> EpisodeResult:
        task = self._task_of(request)
        with self._keys.variable(request.api_key) as key_variable:
            ctx = _model_context(request, key_variable)
            (slot,) = self.env.slots(task)
            episode = await self.env.run_slot(slot, ctx)
        return _result(episode)


def create(args: dict[str, Any]) -> VerifiersEnvironment:
    """Validates `args` (ConnectorArgsError naming the field) into verifiers' EnvConfig; loading is in `setup`."""
    return VerifiersEnvironment(env_config(args), _num_rows(args))
