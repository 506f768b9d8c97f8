"""OpenEnv: an OpenEnv environment server (openenv-core 0.3.0) driven reset/step, the model's replies as actions.

Args (the job spec's `rollout.environment.args`); exactly one of `app`, `command`, `base_url`:

    app               "module:attr" of an OpenEnv FastAPI app importable here (e.g. OpenEnv's `create_app(...)`):
                      started as `python -m uvicorn <app>` on a free loopback port, a subprocess of this server
    command           the argv of a server to start instead (a list; "{port}" is replaced by the port it must
                      listen on at 127.0.0.1)
    base_url          an OpenEnv server already running (a sidecar or a pod on Kubernetes; its own image)
    env               extra environment variables of the started server (an object of strings)
    startup_timeout_s how long the started server may take to answer GET /health (default 120)
    num_rows          rows are the resets with seed 0 .. num_rows-1 (default 64) ...
    rows              ... or this list of reset keyword arguments, one row each
    reset             keyword arguments of every reset (under each row's own), e.g. {"difficulty": 2}
    observation_field the observation field whose text is the user message (default: the observation as JSON)
    action_field      the action field the model's reply text goes to (e.g. "message"); without it the reply
                      must be a JSON object (bare, in a ```json block, or the outermost {...}): the action itself
    system_prompt     a system message ("" = none, the default); "{action_schema}" in it becomes the action's JSON
                      schema (from the server's /schema)
    max_turns         model calls per episode at most (default 16); an episode still running then is truncated
    reward            "sum" (default) or "last": the episode's reward from the environment's step rewards
    max_sessions      episodes played at once (default 1, OpenEnv's default `max_concurrent_envs`): set it to
                      the server's max_concurrent_envs
    step_timeout_s    how long one reset or step may take, and an episode may wait for a free session (default 300)

An episode is one OpenEnv session: a WebSocket to /ws (OpenEnv's stateful protocol: the server gives each
session its own environment instance; its HTTP /reset and /step are stateless, one fresh instance per call), a
reset with the row's keyword arguments (plus `episode_id`), then turns: the observation as a user message, one
chat completion through the session endpoint, the reply as an action, a step; until the environment says done or
`max_turns`. A reply that is no valid action (no JSON object, or refused by the action's schema) ends the episode
(`invalid_action` in reward_info, 0.0 for that turn). `turn_rewards` has the step reward of each model call.
Sessions past the server's capacity (its CAPACITY_REACHED error) are retried until `step_timeout_s`.

A started server whose process ended (a crash) fails the episodes that were using it (an error of the episode,
with its exit code and last output) and is started again by the next episode; a `base_url` server is only
reported (whatever runs it restarts it). Limits: the model's replies are text (no tool calls); think blocks
(`<think>...</think>`) are removed from the text turned into an action, not from the conversation; only the
server's direct child gets SIGTERM when this process dies (Linux), a `command` whose server is a grandchild may
outlive a SIGKILL of this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from miles.envserver import model_client
from miles.envserver.base import ConnectorArgsError, Environment
from miles.envserver.connectors._openenv_server import (
    CAPACITY_REACHED,
    VALIDATION_ERROR,
    OpenEnvConnectionError,
    OpenEnvServerError,
    ServerProcess,
    client_class,
    free_port,
    get_json,
    wait_healthy,
)
from miles.envserver.protocol import EpisodeRequest, EpisodeResult, Row

log = logging.getLogger("miles.envserver.openenv")

_ARGS = (
    *("app", "command", "base_url", "env", "startup_timeout_s", "num_rows", "rows", "reset", "observation_field"),
    *("action_field", "system_prompt", "max_turns", "reward", "max_sessions", "step_timeout_s"),
)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_JSON_BLOCK = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.DOTALL)


class InvalidActionError(ValueError):
    """The model's reply is no action of this environment."""


@dataclass(frozen=True)
class OpenEnvArgs:
    app: str | None
    command: list[str] | None
    base_url: str | None
    env: dict[str, str]
    startup_timeout_s: float
    resets: list[dict[str, Any]]
    observation_field: str | None
    action_field: str | None
    system_prompt: str
    max_turns: int
    reward: str
    max_sessions: int
    step_timeout_s: float


def _number(args: dict[str, Any], name: str, default: float, low: float, high: float, integer: bool) -> Any:
    value = args.get(name, default)
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise ConnectorArgsError(f"{name} must be {kind} in [{low:g}, {high:g}], got {value!r}")
    return value


def _optional_str(args: dict[str, Any], name: str) -> str | None:
    value = args.get(name)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConnectorArgsError(f"{name} must be a non-empty string, got {value!r}")
    return value


def _resets(args: dict[str, Any]) -> list[dict[str, Any]]:
    common = args.get("reset", {})
    if not isinstance(common, dict):
        raise ConnectorArgsError(f"reset must be an object of reset keyword arguments, got {common!r}")
    if "rows" in args and "num_rows" in args:
        raise ConnectorArgsError("give rows or num_rows, not both")
    rows = args.get("rows")
    if rows is None:
        num_rows = _number(args, "num_rows", 64, 1, 1_000_000, integer=True)
        return [{**common, "seed": seed} for seed in range(num_rows)]
    if not isinstance(rows, list) or not rows or not all(isinstance(row, dict) for row in rows):
        raise ConnectorArgsError("rows must be a non-empty list of objects (reset keyword arguments)")
    return [{**common, **row} for row in rows]


def parse_args(args: dict[str, Any]) -> OpenEnvArgs:
    """The validated args; ConnectorArgsError names the field."""
    unknown = sorted(set(args) - set(_ARGS))
    if unknown:
        raise ConnectorArgsError(f"unknown args {unknown}; openenv takes {list(_ARGS)}")
    given = [name for name in ("app", "command", "base_url") if args.get(name) is not None]
    if len(given) != 1:
        raise ConnectorArgsError(f"give exactly one of app, command and base_url (got {given or 'none'})")
    app, base_url, command = _optional_str(args, "app"), _optional_str(args, "base_url"), args.get("command")
    if app is not None and not re.fullmatch(r"[\w.]+:[\w.]+", app):
        raise ConnectorArgsError(f"app must be 'module:attribute' (an OpenEnv FastAPI app), got {app!r}")
    if command is not None and (
        not isinstance(command, list) or not command or not all(isinstance(part, str) for part in command)
    ):
        raise ConnectorArgsError(f"command must be a non-empty list of strings, got {command!r}")
    if base_url is not None and not re.match(r"(https?|wss?)://", base_url):
        raise ConnectorArgsError(f"base_url must be an http(s):// or ws(s):// URL, got {base_url!r}")
    env = args.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ConnectorArgsError(f"env must be an object of strings, got {env!r}")
    if env and base_url is not None:
        raise ConnectorArgsError("env applies to a server this connector starts (app or command), not to base_url")
    system_prompt = args.get("system_prompt", "")
    if not isinstance(system_prompt, str):
        raise ConnectorArgsError(f"system_prompt must be a string, got {system_prompt!r}")
    reward = args.get("reward", "sum")
    if reward not in ("sum", "last"):
        raise ConnectorArgsError(f"reward must be 'sum' or 'last', got {reward!r}")
    return OpenEnvArgs(
        app=app,
        command=command,
        base_url=base_url.rstrip("/") if base_url else None,
        env=env,
        startup_timeout_s=float(_number(args, "startup_timeout_s", 120.0, 1.0, 86400.0, integer=False)),
        resets=_resets(args),
        observation_field=_optional_str(args, "observation_field"),
        action_field=_optional_str(args, "action_field"),
        system_prompt=system_prompt,
        max_turns=_number(args, "max_turns", 16, 1, 10_000, integer=True),
        reward=reward,
        max_sessions=_number(args, "max_sessions", 1, 1, 4096, integer=True),
        step_timeout_s=float(_number(args, "step_timeout_s", 300.0, 1.0, 86400.0, integer=False)),
    )


# --- the environment ------------------------------------------------------------------------------------------
def _render(observation: Any, field_name: str | None) -> str:
    """The user message of an observation: one field's text, or the whole observation as JSON."""
    value = observation.get(field_name) if field_name and isinstance(observation, dict) else observation
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def reply_to_action(content: str, action_field: str | None) -> dict[str, Any]:
    """The action of a model reply (think blocks removed): {action_field: text}, or the JSON object it holds."""
    text = _THINK.sub("", content).strip()
    if action_field is not None:
        return {action_field: text}
    candidates = [text, *reversed(_JSON_BLOCK.findall(text))]
    if "{" in text and "}" in text:
        candidates.append(text[text.index("{") : text.rindex("}") + 1])
    for candidate in candidates:
        with contextlib.suppress(ValueError):
            action = json.loads(candidate)
            if isinstance(action, dict):
                return action
    raise InvalidActionError(f"the reply holds no JSON object: {text[:200]!r}")


@dataclass
class _Episode:
    """What one episode collected; `result()` scores it by the args' reward rule."""

    step_rewards: list[float] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    done: bool = False
    invalid_action: str | None = None

    def result(self, rule: str, metadata: dict[str, Any]) -> EpisodeResult:
        if rule == "sum":
            reward = math.fsum(self.step_rewards)
        else:
            reward = 0.0 if self.invalid_action or not self.step_rewards else self.step_rewards[-1]
        reward_info = {
            "return": math.fsum(self.step_rewards),
            "num_steps": len(self.step_rewards),
            "done": self.done,
            "truncated": not self.done and self.invalid_action is None,
            "invalid_action": self.invalid_action,
        }
        return EpisodeResult(reward=reward, reward_info=reward_info, metadata=metadata, turn_rewards=self.turn_rewards)


class OpenEnvEnvironment(Environment):
    connector = "openenv"

    def __init__(self, args: OpenEnvArgs) -> None:
        self.args = args
        self.server: ServerProcess | None = None
        self.url = args.base_url or ""
        self.metadata: dict[str, Any] = {}
        self.system_prompt = ""
        self._rows: list[Row] = []
        self._sessions = asyncio.Semaphore(args.max_sessions)
        self._restart_lock = asyncio.Lock()

    @property
    def name(self) -> str:
        return str(self.metadata.get("name") or self.args.app or self.args.base_url or "openenv")

    def _new_server(self) -> ServerProcess | None:
        if self.args.base_url is not None:
            return None
        port = free_port()
        if self.args.app is not None:
            argv = [sys.executable, "-m", "uvicorn", self.args.app, "--host", "127.0.0.1", "--port", str(port)]
            argv += ["--log-level", "warning"]
        else:
            assert self.args.command is not None, "validated: app, command or base_url"
            argv = [part.replace("{port}", str(port)) for part in self.args.command]
        return ServerProcess(argv=argv, env=self.args.env, port=port)

    async def _start_server(self) -> None:
        self.server = self._new_server()
        if self.server is None:  # base_url: someone else's server, which may still be starting (a sidecar)
            await wait_healthy(self.url, self.args.startup_timeout_s)
            return
        try:
            await self.server.start(self.args.startup_timeout_s)
        except BaseException:
            await self.server.stop()
            raise
        self.url = self.server.url

    async def setup(self) -> None:
        await asyncio.to_thread(client_class)  # imports openenv (seconds): not on the event loop, not mid-episode
        await self._start_server()
        try:
            await self._describe()
        except BaseException:
            await self.close()  # the server exits on a failed setup without calling close()
            raise

    async def _describe(self) -> None:
        """The environment's name and schemas (GET /metadata, /schema); checks the args' fields against them."""
        self.metadata = await asyncio.to_thread(get_json, f"{self.url}/metadata", 30.0)
        schema = await asyncio.to_thread(get_json, f"{self.url}/schema", 30.0)
        for arg, kind in (("action_field", "action"), ("observation_field", "observation")):
            name = getattr(self.args, arg)
            fields = sorted(schema.get(kind, {}).get("properties", {}))
            if name is not None and name not in fields:
                raise ConnectorArgsError(f"{arg}: {self.name}'s {kind} has no field {name!r}; its fields: {fields}")
        action_schema = {**schema.get("action", {})}
        action_schema["properties"] = {k: v for k, v in action_schema.get("properties", {}).items() if k != "metadata"}
        self.system_prompt = self.args.system_prompt.replace("{action_schema}", json.dumps(action_schema))
        self._rows = [
            Row(prompt=f"OpenEnv {self.name}: reset({json.dumps(kwargs, sort_keys=True)})", info={"reset": kwargs})
            for kwargs in self.args.resets
        ]

    async def close(self) -> None:
        if self.server is not None:
            await self.server.stop()

    def rows(self) -> list[Row]:
        return self._rows

    async def _ensure_server(self) -> None:
        """Start the server again when its process ended (a crash): the episodes on it have failed already."""
        async with self._restart_lock:
            if self.server is None or self.server.exited() is None:
                return
            log.warning("restarting the OpenEnv server: %s", self.server.exited())
            await self.server.stop()
            await self._start_server()

    async def _lost(self, exc: Exception) -> RuntimeError:
        """The episode's error for a lost session: with the exit code and last output of a server that ended."""
        if self.server is not None:
            await self.server.drain()
        ended = self.server.exited() if self.server is not None else None
        return RuntimeError(f"the OpenEnv session at {self.url} was lost ({exc}); {ended or 'the server runs'}")

    async def run_episode(self, request: EpisodeRequest) -> EpisodeResult:
        reset = request.row.info.get("reset")
        if not isinstance(reset, dict):
            raise ValueError(f"row.info.reset must be the reset's keyword arguments, got {reset!r}")
        episode_id = request.metadata.get("episode_id")
        if isinstance(episode_id, str) and "episode_id" not in reset:
            reset = {**reset, "episode_id": episode_id}
        async with self._sessions:
            await self._ensure_server()
            client, first = await self._open_session(reset)
            try:
                episode = await self._play(client, first, request)
            except OpenEnvConnectionError as exc:
                raise await self._lost(exc) from exc
            finally:
                await client.disconnect()
        metadata = {"openenv": self.name, "reset": reset}
        return episode.result(self.args.reward, metadata)

    async def _open_session(self, reset: dict[str, Any]) -> tuple[Any, Any]:
        """A connected client and the reset's result; waits out CAPACITY_REACHED up to step_timeout_s."""
        loop = asyncio.get_running_loop()
        deadline, delay_s = loop.time() + self.args.step_timeout_s, 0.1
        while True:
            client = client_class()(base_url=self.url, message_timeout_s=self.args.step_timeout_s)
            try:
                return client, await client.reset(**reset)
            except OpenEnvServerError as exc:
                await client.disconnect()
                if exc.code != CAPACITY_REACHED or loop.time() + delay_s > deadline:
                    raise
            except OpenEnvConnectionError as exc:
                await client.disconnect()
                raise await self._lost(exc) from exc
            await asyncio.sleep(delay_s)
            delay_s = min(2.0, delay_s * 2)

    async def _play(self, client: Any, result: Any, request: EpisodeRequest) -> _Episode:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages = [*system, {"role": "user", "content": _render(result.observation, self.args.observation_field)}]
        episode = _Episode(done=bool(result.done))
        while not episode.done and len(episode.turn_rewards) < self.args.max_turns:
            reply = await model_client.chat(request, messages)
            content = reply.get("content") or ""
            messages.append({"role": "assistant", "content": content})
            try:
                result = await client.step(reply_to_action(content, self.args.action_field))
            except InvalidActionError as exc:
                episode.invalid_action = str(exc)
            except OpenEnvServerError as exc:
                if exc.code != VALIDATION_ERROR:
                    raise
                episode.invalid_action = f"the environment refused the action: {exc}"
            if episode.invalid_action is not None:
                episode.turn_rewards.append(0.0)
                break
            reward = float(result.reward or 0.0)
            episode.step_rewards.append(reward)
            episode.turn_rewards.append(reward)
            episode.done = bool(result.done)
            if not episode.done:
                messages.append({"role": "user", "content": _render(result.observation, self.args.observation_field)})
        return episode


def create(args: dict[str, Any]) -> OpenEnvEnvironment:
    """Validates `args` (ConnectorArgsError naming the field); the server is started and read in `setup`."""
    return OpenEnvEnvironment(parse_args(args))
