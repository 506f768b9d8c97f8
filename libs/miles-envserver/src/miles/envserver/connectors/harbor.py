"""Harbor: its tasks (instruction, environment, tests) run in the miles sandbox gateway instead of Docker, and
harbor's own `Verifier` decides the reward.

Args (the job spec's `rollout.environment.args`):

    tasks_dir          a directory of Harbor tasks (folders with task.toml, instruction.md, environment/ and
                       tests/test.sh), or one task folder; relative to the server's working directory
    tasks              names of the tasks to keep (default: every task, in name order)
    max_turns          model calls per episode (default 10)
    command_timeout_s  wall-clock limit of each command the model runs, seconds (default 30)
    max_output_chars   a command's output is cut to this many characters before the model reads it (default 4000)
    system_prompt      the agent's instructions (default SYSTEM_PROMPT: the <command>/<done/> protocol)
    sandbox_template   the gateway template sandboxes are made from ("" = the gateway's default)
    sandbox_ttl_s      idle seconds after which the gateway reaps a sandbox left behind (default 900)

`dataset` (a Harbor registry name such as terminal-bench@2.0) is refused: the registry is on the internet, which
this deployment and its tests do not reach; download the tasks where it is reachable and give tasks_dir.

An episode: create a sandbox through the job's gateway (`metadata.sandbox_url`, `sandbox_token`, `job_id`), set
the task's environment up in it, run a small terminal agent (the model writes `<command>...</command>`, gets the
exit code and output back, until `<done/>` or max_turns), then harbor's `Verifier` on our `SandboxEnvironment`
(a harbor `BaseEnvironment` over the gateway's HTTP API, harbor_sandbox.py): it uploads tests/, runs test.sh and
reads /logs/verifier/reward.json or reward.txt. Its `reward` (or its only key) is the episode's reward, every key
goes to reward_info. The sandbox is always destroyed. A verifier error (no reward file, a malformed one, its
timeout) fails the episode, which the worker turns into an ABORTED sample.

Limits (a sandbox is not a Docker container; see harbor_sandbox.py for the paths and the Dockerfile subset):
- Supported tasks: single-step, Linux, verifier in the agent's environment (not a separate tests/Dockerfile
  image), no GPU or TPU, no docker-compose.yaml. Others stop the server at start naming the task and the reason.
- No image is built or pulled: commands run on the gateway template's system (for the local backend, the host's
  /usr: python3, coreutils, grep, tar...), not on the image FROM names. RUN lines run in the sandbox as its one
  unprivileged user without network, so file setup works and package installs (apt-get, pip) fail the episode.
- Resources: [environment].memory_mb becomes the sandbox's memory limit (a gateway refuses more than its
  max_limits); cpus and storage_mb are not applied. Timeouts: each command's command_timeout_s, RUN lines 600 s,
  the verifier the task's [verifier].timeout_sec; [agent].timeout_sec is left to the job's episode timeout.
- The agent is ours, not one of harbor's: terminus-2 drives a tmux session in the container and the installed
  agents install CLIs into it, all calling models through LiteLLM; ours sends every call to the session endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import re
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harbor.environments.base import ExecResult
from harbor.models.task.task import Task
from harbor.models.trial.paths import TrialPaths
from harbor.verifier.verifier import Verifier

from miles.envserver import model_client
from miles.envserver.base import ConnectorArgsError, Environment
from miles.envserver.connectors.harbor_sandbox import (
    EnvironmentPlan,
    GatewayClient,
    SandboxEnvironment,
    UnsupportedTaskError,
    environment_plan,
)
from miles.envserver.protocol import EpisodeRequest, EpisodeResult, Row

log = logging.getLogger("miles.envserver.harbor")

SYSTEM_PROMPT = (
    "You solve a task in a Linux shell. Each reply runs one shell command: write it as <command>...</command> "
    "and you get its exit code and output back. Reply <done/> when the task is complete."
)
UNPARSED = "Could not parse a command. Reply with <command>...</command> or <done/>."
COMMAND_RE = re.compile(r"<command>(.*?)</command>", re.DOTALL)
DONE = "<done/>"
_ARGS = (
    "tasks_dir",
    "tasks",
    "max_turns",
    "command_timeout_s",
    "max_output_chars",
    "system_prompt",
    "sandbox_template",
    "sandbox_ttl_s",
)
_GATEWAY_CALL_TIMEOUT_S = 60.0
"""Timeout of each call to the sandbox gateway besides an exec's own timeout_s."""
_MAX_TEST_OUTPUT_CHARS = 2000
"""metadata keeps the end of the verifier's test output (test-stdout.txt) up to this many characters."""


@dataclass(frozen=True)
class AgentSettings:
    max_turns: int = 10
    command_timeout_s: float = 30.0
    max_output_chars: int = 4000
    system_prompt: str = SYSTEM_PROMPT
    sandbox_template: str = ""
    sandbox_ttl_s: float = 900.0


@dataclass(frozen=True)
class LoadedTask:
    task: Any
    """harbor.models.task.task.Task, loaded (and so validated) by harbor's own loader."""
    plan: EnvironmentPlan


@dataclass
class Transcript:
    num_turns: int = 0
    num_commands: int = 0
    done: bool = False
    exit_codes: list[int] = field(default_factory=list)


def observation(result: ExecResult, max_chars: int) -> str:
    """What the model reads after a command: its exit code and output (stdout then stderr), cut to max_chars."""
    output = (result.stdout or "") + (result.stderr or "")
    if len(output) > max_chars:
        output = output[:max_chars] + "\n[output truncated]"
    code = result.return_code
    return f"Exit code: {code}\nOutput:\n{output}" if output else f"Exit code: {code} (no output)"


async def run_agent(
    request: EpisodeRequest, environment: SandboxEnvironment, messages: list[dict[str, Any]], settings: AgentSettings
) -> Transcript:
    """The terminal loop: a model call, the command it wrote run in the sandbox, its output back as a user turn;
    ends at `<done/>` (after running a command in the same reply) or after max_turns model calls."""
    transcript = Transcript()
    for _ in range(settings.max_turns):
        reply = await model_client.chat(request, messages)
        transcript.num_turns += 1
        content = reply.get("content") or ""
        messages.append({"role": "assistant", "content": content})
        match = COMMAND_RE.search(content)
        if match is not None:
            result = await environment.exec(match.group(1).strip(), timeout_sec=settings.command_timeout_s)
            transcript.num_commands += 1
            transcript.exit_codes.append(result.return_code)
            if DONE not in content:
                messages.append({"role": "user", "content": observation(result, settings.max_output_chars)})
        if DONE in content:
            transcript.done = True
            break
        if match is None:
            messages.append({"role": "user", "content": UNPARSED})
    return transcript


def episode_reward(rewards: dict[str, float]) -> float:
    """The verifier's `reward`, or its only value; several values without a `reward` key are an error."""
    if "reward" in rewards:
        return float(rewards["reward"])
    if len(rewards) == 1:
        return float(next(iter(rewards.values())))
    raise ValueError(f"the verifier's rewards {sorted(rewards)} have no 'reward' key to train on")


async def verify(task: Any, environment: SandboxEnvironment, trial_paths: Any) -> dict[str, float]:
    """Harbor's own Verifier on our environment, under the task's verifier timeout and user."""
    verifier = Verifier(task=task, trial_paths=trial_paths, environment=environment, logger=log)
    with environment.with_default_user(task.config.verifier.user):
        result = await asyncio.wait_for(verifier.verify(), timeout=task.config.verifier.timeout_sec)
    if not result.rewards:
        raise ValueError("the verifier returned no rewards")
    return {key: float(value) for key, value in result.rewards.items()}


def gateway_of(metadata: dict[str, Any], timeout_s: float) -> GatewayClient:
    url = metadata.get("sandbox_url")
    if not isinstance(url, str) or not url:
        raise RuntimeError(
            "the harbor connector runs tasks in the job's sandbox gateway, but the episode's metadata has no "
            "sandbox_url: give the rollout worker one (MILES_ROLLOUT_SANDBOX_HTTP_URL)"
        )
    return GatewayClient(url.rstrip("/"), str(metadata.get("sandbox_token") or ""), call_timeout_s=timeout_s)


def _tail(path: Path, max_chars: int) -> str:
    return path.read_text(errors="replace")[-max_chars:] if path.is_file() else ""


class HarborEnvironment(Environment):
    connector = "harbor"

    def __init__(self, tasks_dir: Path, tasks: dict[str, LoadedTask], settings: AgentSettings) -> None:
        self.tasks_dir = tasks_dir
        self.tasks = tasks
        self.settings = settings

    @property
    def name(self) -> str:
        return self.tasks_dir.name

    def _messages(self, task: Any) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": self.settings.system_prompt}] if self.settings.system_prompt else []
        return [*system, {"role": "user", "content": str(task.instruction)}]

    def rows(self) -> list[Row]:
        return [
            Row(prompt=self._messages(loaded.task), info={"task": name, "task_dir": str(loaded.task.task_dir)})
            for name, loaded in self.tasks.items()
        ]

    def _task_of(self, request: EpisodeRequest) -> LoadedTask:
        name = request.row.info.get("task")
        if not isinstance(name, str) or name not in self.tasks:
            raise ValueError(f"row.info.task must name one of this server's tasks {sorted(self.tasks)}, got {name!r}")
        return self.tasks[name]

    async def run_episode(self, request: EpisodeRequest) -> EpisodeResult:
        loaded = self._task_of(request)
        task = loaded.task
        gateway = gateway_of(request.metadata, timeout_s=_GATEWAY_CALL_TIMEOUT_S)
        episode_id = str(request.metadata.get("episode_id") or uuid.uuid4().hex)
        with tempfile.TemporaryDirectory(prefix="harbor-trial-") as trial_dir:
            trial_paths = TrialPaths(trial_dir=Path(trial_dir))
            trial_paths.mkdir()
            environment = SandboxEnvironment(
                gateway=gateway,
                job_id=str(request.metadata.get("job_id") or ""),
                task=task,
                plan=loaded.plan,
                trial_paths=trial_paths,
                session_id=f"{task.short_name}__{episode_id}",
                sandbox_template=self.settings.sandbox_template,
                ttl_s=self.settings.sandbox_ttl_s,
                default_timeout_s=float(task.config.verifier.timeout_sec),
            )
            try:
                await environment.start(force_build=False)
                transcript = await run_agent(request, environment, self._messages(task), self.settings)
                rewards = await verify(task, environment, trial_paths)
            finally:
                await environment.stop(delete=True)
            test_output = _tail(trial_paths.test_stdout_path, _MAX_TEST_OUTPUT_CHARS)
        metadata = {
            "task": task.name,
            "num_turns": transcript.num_turns,
            "num_commands": transcript.num_commands,
            "command_exit_codes": transcript.exit_codes,
            "done": transcript.done,
            "test_output": test_output,
        }
        return EpisodeResult(reward=episode_reward(rewards), reward_info=rewards, metadata=metadata)


def _number(args: dict[str, Any], name: str, default: float, low: float, high: float, *, integer: bool) -> Any:
    value = args.get(name, default)
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise ConnectorArgsError(f"{name} must be {kind} in [{low:g}, {high:g}], got {value!r}")
    return value


def _string(args: dict[str, Any], name: str, default: str) -> str:
    value = args.get(name, default)
    if not isinstance(value, str):
        raise ConnectorArgsError(f"{name} must be a string, got {value!r}")
    return value


def load_tasks(tasks_dir: Path, names: list[str] | None) -> dict[str, LoadedTask]:
    """Every task under tasks_dir (or tasks_dir itself), loaded by harbor's Task and checked for the sandbox."""
    if not tasks_dir.is_dir():
        raise ConnectorArgsError(f"tasks_dir {str(tasks_dir)!r} is not a directory")
    single = (tasks_dir / "task.toml").is_file()
    folders = [tasks_dir] if single else sorted(path.parent for path in tasks_dir.glob("*/task.toml"))
    loaded: dict[str, LoadedTask] = {}
    problems: list[str] = []
    for folder in folders:
        try:
            task = Task(folder)
            if task.name in loaded:
                raise ValueError(f"its name {task.name!r} is also another task's")
            loaded[task.name] = LoadedTask(task, environment_plan(task))
        except (UnsupportedTaskError, OSError, ValueError) as exc:
            problems.append(f"{folder.name}: {exc}")
    if problems:
        raise ConnectorArgsError(f"tasks_dir {str(tasks_dir)!r} has tasks this connector cannot run: {problems}")
    if names is not None:
        missing = sorted(set(names) - set(loaded))
        if missing:
            raise ConnectorArgsError(f"tasks {missing} are not in tasks_dir; it has {sorted(loaded)}")
        loaded = {name: loaded[name] for name in sorted(names)}
    if not loaded:
        raise ConnectorArgsError(f"tasks_dir {str(tasks_dir)!r} holds no Harbor task (no */task.toml)")
    return loaded


def create(args: dict[str, Any]) -> HarborEnvironment:
    """Validates `args` (ConnectorArgsError naming the field) and loads the tasks with harbor's own loader."""
    if "dataset" in args:
        raise ConnectorArgsError(
            "dataset: Harbor registry datasets are downloaded from the internet, which this deployment does not "
            "reach; download the tasks where it is reachable and give tasks_dir"
        )
    unknown = sorted(set(args) - set(_ARGS))
    if unknown:
        raise ConnectorArgsError(f"unknown args {unknown}; harbor takes {list(_ARGS)}")
    if not isinstance(args.get("tasks_dir"), str):
        raise ConnectorArgsError("tasks_dir is required: a directory of Harbor tasks (or one task folder)")
    names = args.get("tasks")
    if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
        raise ConnectorArgsError(f"tasks must be a list of task names, got {names!r}")
    settings = AgentSettings(
        max_turns=_number(args, "max_turns", 10, 1, 1000, integer=True),
        command_timeout_s=float(_number(args, "command_timeout_s", 30.0, 1, 3600, integer=False)),
        max_output_chars=_number(args, "max_output_chars", 4000, 100, 1_000_000, integer=True),
        system_prompt=_string(args, "system_prompt", SYSTEM_PROMPT),
        sandbox_template=_string(args, "sandbox_template", ""),
        sandbox_ttl_s=float(_number(args, "sandbox_ttl_s", 900.0, 10, 86400, integer=False)),
    )
    tasks_dir = Path(args["tasks_dir"]).resolve()
    return HarborEnvironment(tasks_dir, load_tasks(tasks_dir, names), settings)
