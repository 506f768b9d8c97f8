"""Hub environments: the worker's side of the environment-server boundary (docs/environments.md).

A job with `rollout.environment` runs no agent function of its own: an environment server (libs/miles-envserver,
in the connector's own interpreter) gives the prompts and runs each episode against the session's OpenAI
endpoint, scoring it with the environment's own rubric, scorer or verifier. The worker keeps everything else
(sessions, TITO samples, groups, timeouts, partial rollouts): `EnvironmentAgent` is one more agent function.

- `LocalEnvironmentServer`: the server as this worker's subprocess (the local backend, tests). It is started
  before the worker rolls out (ConfigError with the server's last output when it cannot start), checked every
  `environment_health_interval_s`, and restarted when its process ends or when /healthz failed
  `environment_failures_to_restart` checks in a row (a hung environment). Restarts back off (1 s doubling to
  30 s); each is counted (`miles_rollout_environment_restarts_total{cause}`).
- `RemoteEnvironmentServer`: a server something else runs (the per-job pods on Kubernetes, restarted by their
  Deployment): only waited for and watched.

Per episode: `environment_error` (the environment raised, or its server was unreachable or restarted mid-way),
`bad_reward` (a result outside the protocol) and `timeout` (rollout.environment.timeout_s) end the episode
ABORTED with that reason; the job goes on. An episode waits (within its timeout) for a restarting server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from miles.common.jobspec.rollout import EnvironmentSpec
from miles.envserver.protocol import EpisodeRequest, EpisodeResult, ProtocolError, Row
from miles.rollout.errors import EnvironmentStartError, EpisodeAbortedError
from miles.rollout.metrics import RolloutMetrics
from miles.rollout.settings import RolloutSettings

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
_LOG_TAIL_BYTES = 4000


def resolve_interpreter(spec: EnvironmentSpec, envs_dir: str) -> Path:
    """The Python that runs the server: `interpreter`, else `<envs_dir>/<env_name>/bin/python`."""
    if spec.interpreter:
        return Path(spec.interpreter)
    base = Path(envs_dir)
    candidates = [base] if base.is_absolute() else [Path.cwd() / base, _checkout_root() / base]
    for directory in candidates:
        python = directory / spec.env_name / "bin" / "python"
        if python.exists():
            return python
    raise EnvironmentStartError(
        f"no interpreter for environment connector {spec.connector!r}: {candidates[0] / spec.env_name} does not "
        f"exist; build it with `make env-{spec.env_name}` (or set rollout.environment.interpreter)",
        field="rollout.environment",
    )


def _checkout_root() -> Path:
    import miles.envserver

    return Path(miles.envserver.__file__).resolve().parents[4]  # libs/miles-envserver/src/miles/envserver


def rows_digest(rows: list[Row]) -> str:
    """What the prompt order depends on besides the count (a restarted server must give the same rows)."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row.to_json(), sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


class EnvironmentServer:
    """The URL of a healthy environment server, and its rows; see the module docstring."""

    def __init__(self, spec: EnvironmentSpec, settings: RolloutSettings, metrics: RolloutMetrics) -> None:
        self.spec = spec
        self.settings = settings
        self.metrics = metrics
        self.url = ""
        self.ready = asyncio.Event()
        self.rows: list[Row] = []
        self.digest = ""
        self.failed = asyncio.Event()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(settings.environment_health_timeout_s))
        self._watch: asyncio.Task[None] | None = None
        self._check_now = asyncio.Event()

    def suspect(self) -> None:
        """An episode could not connect: hold new episodes and check the server at once."""
        self.ready.clear()
        self._check_now.set()

    async def start(self) -> None:
        """Until healthy (EnvironmentStartError past the startup timeout), then reads the rows and watches."""
        await self._bring_up()
        self.rows = await self._fetch_rows()
        self.digest = rows_digest(self.rows)
        self.metrics.environment_up.set(1.0)
        self._watch = asyncio.create_task(self._watch_loop())

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.client.aclose()

    async def _bring_up(self) -> None:
        raise NotImplementedError

    async def _restart(self, cause: str) -> None:
        raise NotImplementedError

    async def healthy(self) -> bool:
        try:
            answer = await self.client.get(f"{self.url}/healthz")
        except httpx.HTTPError:
            return False
        return answer.status_code == 200

    async def _wait_healthy(self, deadline_s: float, alive: Callable[[], str | None]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if await self.healthy():
                return
            dead = alive()
            if dead is not None:
                raise EnvironmentStartError(dead, field="rollout.environment")
            if loop.time() > deadline_s:
                raise EnvironmentStartError(
                    f"the environment server did not become healthy within {self.spec.startup_timeout_s:g} s",
                    field="rollout.environment",
                )
            await asyncio.sleep(0.2)

    async def _fetch_rows(self) -> list[Row]:
        answer = await self.client.get(f"{self.url}/v1/rows", timeout=60.0)
        answer.raise_for_status()
        try:
            return [Row.from_json(row) for row in answer.json()["rows"]]
        except (KeyError, TypeError, ProtocolError) as exc:
            raise EnvironmentStartError(f"the environment's rows are malformed: {exc}") from exc

    async def _watch_loop(self) -> None:
        failures = 0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._check_now.wait(), self.settings.environment_health_interval_s)
            self._check_now.clear()
            ok = await self.healthy()
            self.metrics.environment_up.set(1.0 if ok else 0.0)
            failures = 0 if ok else failures + 1
            cause = self._restart_cause(failures)
            if cause is None:
                if ok:
                    self.ready.set()
                continue
            self.ready.clear()
            self.metrics.environment_restarts.labels(cause=cause).inc()
            try:
                await self._restart(cause)
                rows = await self._fetch_rows()
            except (EnvironmentStartError, httpx.HTTPError) as exc:
                log.error("environment server restart failed; retrying", extra={"error": str(exc)})
                continue
            if rows_digest(rows) != self.digest:
                log.error("the restarted environment server gives other rows: the prompt order would change")
                self.failed.set()
                return
            failures = 0
            self.ready.set()

    def _restart_cause(self, failures: int) -> str | None:
        """None: leave it be; else why it must be restarted (a remote server is only watched)."""
        return None


class RemoteEnvironmentServer(EnvironmentServer):
    """A server at `settings.environment_url` (Kubernetes pods; their Deployment restarts them)."""

    async def _bring_up(self) -> None:
        self.url = self.settings.environment_url.rstrip("/")
        deadline_s = asyncio.get_running_loop().time() + self.spec.startup_timeout_s
        await self._wait_healthy(deadline_s, lambda: None)
        self.ready.set()


class LocalEnvironmentServer(EnvironmentServer):
    """The server as a subprocess of this worker, restarted when it ends or hangs."""

    def __init__(self, spec: EnvironmentSpec, settings: RolloutSettings, metrics: RolloutMetrics) -> None:
        super().__init__(spec, settings, metrics)
        self.interpreter = resolve_interpreter(spec, settings.envs_dir)
        self.workdir = Path(tempfile.mkdtemp(prefix="miles-envserver-"))
        self.log_path = self.workdir / "server.log"
        self.python_path = os.pathsep.join(str(Path(p).resolve()) for p in spec.python_path)
        self.process: asyncio.subprocess.Process | None = None
        self.backoff_s = 1.0

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError), self.log_path.open("rb") as handle:
            handle.seek(max(0, self.log_path.stat().st_size - _LOG_TAIL_BYTES))
            return handle.read().decode(errors="replace").strip()
        return ""

    def _exited(self) -> str | None:
        if self.process is None or self.process.returncode is None:
            return None
        return f"the environment server exited with code {self.process.returncode}: {self._log_tail()}"

    async def _spawn(self) -> None:
        port_file = self.workdir / "port"
        port_file.unlink(missing_ok=True)
        argv = [str(self.interpreter), "-m", "miles.envserver", "--connector", self.spec.connector]
        argv += ["--args", json.dumps(self.spec.args), "--host", "127.0.0.1", "--port", "0"]
        argv += ["--port-file", str(port_file)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("PYTHONPATH", None)  # the services' packages must not leak into the environment's interpreter
        if self.python_path:
            env["PYTHONPATH"] = self.python_path
        with self.log_path.open("ab") as log_file:
            self.process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file, env=env
            )
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + self.spec.startup_timeout_s
        while not port_file.exists():
            dead = self._exited()
            if dead is not None:
                raise EnvironmentStartError(dead, field="rollout.environment")
            if loop.time() > deadline_s:
                raise EnvironmentStartError("the environment server never listened", field="rollout.environment")
            await asyncio.sleep(0.05)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"
        await self._wait_healthy(deadline_s, self._exited)

    async def _bring_up(self) -> None:
        try:
            await self._spawn()
        except BaseException:
            await self._kill()
            raise
        self.ready.set()
        log.info("environment server started", extra={"connector": self.spec.connector, "log": str(self.log_path)})

    def _restart_cause(self, failures: int) -> str | None:
        if self._exited() is not None:
            return "exited"
        if failures >= self.settings.environment_failures_to_restart:
            return "unresponsive"
        return None

    async def _restart(self, cause: str) -> None:
        log.warning("restarting the environment server", extra={"cause": cause, "tail": self._log_tail()[-500:]})
        await self._kill()
        await asyncio.sleep(self.backoff_s)
        self.backoff_s = min(MAX_BACKOFF_S, self.backoff_s * 2)
        try:
            await self._spawn()
        except BaseException:
            await self._kill()
            raise
        self.backoff_s = 1.0

    async def _kill(self) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGKILL)
        await process.wait()

    async def stop(self) -> None:
        await super().stop()
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                await asyncio.wait_for(process.wait(), timeout=10.0)
            except TimeoutError:
                await self._kill()


async def start_environment_server(
    spec: EnvironmentSpec, settings: RolloutSettings, metrics: RolloutMetrics
) -> EnvironmentServer:
    server_class = RemoteEnvironmentServer if settings.environment_url else LocalEnvironmentServer
    server: EnvironmentServer = server_class(spec, settings, metrics)
    try:
        await server.start()
    except BaseException:
        await server.stop()
        raise
    return server


def environment_rows(server: EnvironmentServer, prompt_key: str, label_key: str) -> list[dict[str, Any]]:
    """The server's rows as dataset rows (`info` kept: the environment needs it back)."""
    return [{prompt_key: row.prompt, label_key: row.label, "info": row.info} for row in server.rows]


class EnvironmentAgent:
    """The agent function of an environment job: one POST /v1/episodes per episode."""

    def __init__(self, server: EnvironmentServer, prompt_key: str) -> None:
        self.server = server
        self.prompt_key = prompt_key
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))

    async def __call__(
        self, base_url: str, prompt: dict[str, Any], request_kwargs: dict[str, Any], metadata: dict[str, Any]
    ) -> dict[str, Any]:
        row = Row(prompt=prompt[self.prompt_key], label=metadata.get("label"), info=prompt.get("info") or {})
        passed = {k: v for k, v in metadata.items() if k not in ("api_key", "label", "agent_config")}
        request = EpisodeRequest(
            base_url=base_url,
            api_key=metadata["api_key"],
            row_index=int(metadata["prompt_index"]),
            row=row,
            request_kwargs=request_kwargs,
            metadata=passed,
        )
        while True:
            await self.server.ready.wait()  # a restarting server: the episode's timeout bounds the wait
            try:
                answer = await self.client.post(f"{self.server.url}/v1/episodes", json=request.to_json())
                break
            except httpx.ConnectError:  # it never reached the server (gone since): safe to send again
                self.server.suspect()
                await asyncio.sleep(0.1)
            except httpx.HTTPError as exc:
                reason = f"the environment server was lost mid-episode: {type(exc).__name__}: {exc}"
                raise EpisodeAbortedError("environment_error", reason) from exc
        if answer.status_code != 200:
            text = f"the environment answered {answer.status_code}: {answer.text}"
            raise EpisodeAbortedError("environment_error", text)
        try:
            result = EpisodeResult.from_json(answer.json())
        except (ValueError, ProtocolError) as exc:
            text = f"malformed environment result: {exc}: {answer.text[:500]}"
            raise EpisodeAbortedError("bad_reward", text) from exc
        return {
            "reward": result.reward,
            "reward_info": result.reward_info,
            "metadata": {**result.metadata, "environment": self.server.spec.connector},
            "turn_rewards": result.turn_rewards,
        }

    async def close(self) -> None:
        await self.client.aclose()
