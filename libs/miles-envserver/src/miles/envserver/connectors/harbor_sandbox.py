"""Harbor's environment interface over the miles sandbox gateway: `SandboxEnvironment` is a harbor
`BaseEnvironment` (exec, upload/download of files and directories, start/stop) whose commands run in one gateway
sandbox, so harbor's own code (its Verifier) runs a task's tests there as it would in Docker. Used by harbor.py;
not a connector itself.

Paths. A sandbox's only writable places are its work dir (the gateway's `workdir`, e.g. /workspace) and a private
/tmp, and the gateway's file API reaches the work dir only. Harbor's fixed container paths are therefore moved
under the work dir (`PathMap`): /logs, /tests and /solution to `<work dir>/.harbor/...`, and the task's WORKDIR
(e.g. /app) to the work dir itself. Every command, cwd and env value passed to `exec`, every upload/download path,
and the text files uploaded (tests/, solution/) get those paths rewritten, so a test.sh that writes
/logs/verifier/reward.txt or reads /app/hello.txt works unchanged. Not rewritten: paths assembled at run time
(`d=/lo; $d"gs"`), binary files, and paths in files the task's own programs read. The agent sees the real paths
(`pwd` prints the work dir) and can see `.harbor/`.

Environment. No image is built: `environment_plan` reads environment/Dockerfile and keeps what a sandbox can
reproduce — WORKDIR, ENV, COPY/ADD of files from environment/ (in order, with RUN) and RUN lines, which run in
the sandbox as its one unprivileged user without network. FROM names an image that is not pulled (the
template's system stands in for it); LABEL, EXPOSE, CMD, ENTRYPOINT, USER, ARG, VOLUME, HEALTHCHECK, STOPSIGNAL,
SHELL and MAINTAINER are ignored; anything else (a second FROM, ONBUILD, COPY --from, ADD of a URL, heredocs)
makes the task unsupported. Harbor's `user="root"` is ignored (one uid per sandbox); the sandbox has no network.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import shlex
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult, transfer_tar_filter
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.models.task.config import NetworkMode, NetworkPolicy, TaskOS, VerifierEnvironmentMode
from harbor.models.task.verifier_mode import resolve_task_verifier_mode

log = logging.getLogger("miles.envserver.harbor")

HARBOR_DIR = ".harbor"
"""Folder of the sandbox's work dir that holds harbor's /logs, /tests, /solution and transfer files."""
MOVED_PATHS = ("/logs", "/tests", "/solution")
_IGNORED_INSTRUCTIONS = {
    *("LABEL", "EXPOSE", "CMD", "ENTRYPOINT", "USER", "ARG"),
    *("VOLUME", "HEALTHCHECK", "STOPSIGNAL", "SHELL", "MAINTAINER"),
}
_SETUP_TIMEOUT_S = 600.0


class UnsupportedTaskError(ValueError):
    """A task this sandbox cannot run (the text says why)."""


class SandboxGatewayError(RuntimeError):
    """The sandbox gateway refused a call or an exec failed where it must not; the text says which."""


@dataclass(frozen=True)
class CommandOutput:
    exit_code: int
    """The command's exit code; 128+N when signal N ended it, 124 when the gateway's timeout killed it."""
    stdout: str
    stderr: str


@dataclass(frozen=True)
class GatewayClient:
    """The gateway's HTTP API (services/sandbox-gateway/README.md), blocking (urllib): call it in a thread.
    `token` is the job's capability (`metadata.sandbox_token`), sent as a bearer token when set."""

    url: str
    token: str = ""
    call_timeout_s: float = 60.0

    def _call(
        self,
        method: str,
        path: str,
        data: bytes | None = None,
        *,
        query: dict[str, str] | None = None,
        wait_s: float = 0,
    ) -> tuple[bytes, Any]:
        target = f"{self.url}/v1/sandboxes{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if data is not None:
            headers["Content-Type"] = "application/octet-stream" if method == "PUT" else "application/json"
        request = urllib.request.Request(target, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.call_timeout_s + wait_s) as response:
                return response.read(), response.headers
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise SandboxGatewayError(f"{method} {target} answered {exc.code}: {detail}") from exc

    def _json(self, method: str, path: str, body: dict[str, Any], wait_s: float = 0) -> dict[str, Any]:
        raw, _ = self._call(method, path, json.dumps(body).encode(), wait_s=wait_s)
        answer: dict[str, Any] = json.loads(raw)
        return answer

    def create(self, job_id: str, *, template: str, ttl_s: float, memory_bytes: int) -> str:
        body = {"job_id": job_id, "template": template, "ttl_s": ttl_s, "limits": {"memory_bytes": memory_bytes}}
        return str(self._json("POST", "", body)["sandbox_id"])

    def exec(self, sandbox_id: str, shell: str, *, env: dict[str, str], timeout_s: float) -> CommandOutput:
        body = {"shell": shell, "env": env, "timeout_s": timeout_s, "stream": False}
        collected = self._json("POST", f"/{sandbox_id}/exec", body, wait_s=timeout_s)
        result = collected["result"]
        exit_code = 128 + int(result["signal"]) if result["signal"] else int(result["exit_code"])
        stderr = str(collected["stderr"])
        if "timeout" in result["limits_hit"]:
            exit_code, stderr = 124, f"{stderr}\n[killed after the timeout of {timeout_s:g} s]"
        return CommandOutput(exit_code, str(collected["stdout"]), stderr)

    def write(self, sandbox_id: str, path: str, data: bytes) -> None:
        self._call("PUT", f"/{sandbox_id}/files", data, query={"path": path})

    def read(self, sandbox_id: str, path: str) -> bytes:
        data, headers = self._call("GET", f"/{sandbox_id}/files", query={"path": path})
        if headers.get("X-Miles-Truncated") == "true":
            raise SandboxGatewayError(f"{path} is larger than the gateway's max_read_bytes")
        return data

    def destroy(self, sandbox_id: str) -> None:
        self._call("DELETE", f"/{sandbox_id}")


class PathMap:
    """Harbor's container paths moved under the sandbox's work dir (see the module docstring)."""

    def __init__(self, workdir: str, task_workdir: str | None) -> None:
        self.workdir = workdir.rstrip("/")
        self.rules = {path: f"{self.workdir}/{HARBOR_DIR}{path}" for path in MOVED_PATHS}
        if task_workdir and task_workdir.rstrip("/") not in ("", self.workdir):
            self.rules[task_workdir.rstrip("/")] = self.workdir
        alternatives = "|".join(re.escape(path) for path in sorted(self.rules, key=len, reverse=True))
        # A moved path starts a path (not `/x/logs`, `a/tests`, `$HOME/logs`) and ends at `/` or a non-name char.
        self._pattern = re.compile(rf"(?<![\w./~$-])({alternatives})(?![\w.-])")

    def translate(self, text: str) -> str:
        return self._pattern.sub(lambda match: self.rules[match.group(1)], text)

    def translate_file(self, data: bytes) -> bytes:
        """A text file's bytes with its paths moved; binary (not UTF-8) data unchanged."""
        try:
            return self.translate(data.decode()).encode()
        except UnicodeDecodeError:
            return data


@dataclass(frozen=True)
class SetupStep:
    """One COPY (sources relative to environment/, a container target) or RUN (a shell command) of a Dockerfile."""

    command: str = ""
    sources: tuple[str, ...] = ()
    target: str = ""
    cwd: str | None = None


@dataclass(frozen=True)
class EnvironmentPlan:
    """What of a task's environment a sandbox reproduces: its WORKDIR, ENV, and COPY/RUN steps in order."""

    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    steps: tuple[SetupStep, ...] = ()


def _instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, rest) of each Dockerfile instruction, continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, rest = (pending + stripped).partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    return instructions


def _words(rest: str) -> list[str]:
    """The arguments of an instruction in exec form (a JSON list) or shell form."""
    return [str(word) for word in json.loads(rest)] if rest.startswith("[") else shlex.split(rest)


def _env_pairs(rest: str) -> dict[str, str]:
    words = shlex.split(rest)
    if words and "=" not in words[0]:  # legacy `ENV KEY value with spaces`
        key, _, value = rest.partition(" ")
        return {key: value.strip()}
    return dict(word.split("=", 1) for word in words)


def dockerfile_plan(text: str) -> EnvironmentPlan:
    workdir: str | None = None
    env: dict[str, str] = {}
    steps: list[SetupStep] = []
    num_from = 0
    for keyword, rest in _instructions(text):
        if "<<" in rest and keyword in ("RUN", "COPY"):
            raise UnsupportedTaskError(f"heredoc in {keyword}")
        if keyword == "FROM":
            num_from += 1
            if num_from > 1:
                raise UnsupportedTaskError("multi-stage Dockerfile (a second FROM)")
        elif keyword == "WORKDIR":
            workdir = str(PurePosixPath(workdir or "/") / _words(rest)[0])
        elif keyword == "ENV":
            env.update(_env_pairs(rest))
        elif keyword == "RUN":
            steps.append(SetupStep(command=shlex.join(_words(rest)) if rest.startswith("[") else rest, cwd=workdir))
        elif keyword in ("COPY", "ADD"):
            words = _words(rest)
            if any(word.startswith("--from") for word in words) or any("://" in word for word in words):
                raise UnsupportedTaskError(f"{keyword} from another stage or a URL")
            *sources, target = [word for word in words if not word.startswith("--")]
            if not sources:
                raise UnsupportedTaskError(f"{keyword} without a source")
            target = str(PurePosixPath(workdir or "/") / target) + ("/" if target.endswith("/") else "")
            steps.append(SetupStep(sources=tuple(sources), target=target))
        elif keyword not in _IGNORED_INSTRUCTIONS:
            raise UnsupportedTaskError(f"Dockerfile instruction {keyword}")
    return EnvironmentPlan(workdir=workdir, env=env, steps=tuple(steps))


def environment_plan(task: Any) -> EnvironmentPlan:
    """The plan for a harbor Task, or UnsupportedTaskError saying what of it a sandbox cannot give."""
    config = task.config
    if task.has_steps:
        raise UnsupportedTaskError("multi-step task ([[steps]])")
    if config.environment.os != TaskOS.LINUX:
        raise UnsupportedTaskError(f"[environment].os = {config.environment.os.value!r}")
    if resolve_task_verifier_mode(config) != VerifierEnvironmentMode.SHARED:
        raise UnsupportedTaskError("separate verifier environment (only the shared mode runs in one sandbox)")
    if config.environment.gpus or config.environment.tpu is not None:
        raise UnsupportedTaskError("GPUs or TPUs requested")
    environment_dir = task.paths.environment_dir
    if any((environment_dir / name).exists() for name in ("docker-compose.yaml", "docker-compose.yml")):
        raise UnsupportedTaskError("docker-compose environment (several containers)")
    dockerfile = environment_dir / "Dockerfile"
    plan = dockerfile_plan(dockerfile.read_text()) if dockerfile.is_file() else EnvironmentPlan()
    return replace(plan, workdir=config.environment.workdir) if config.environment.workdir else plan


class SandboxEnvironment(BaseEnvironment):  # type: ignore[misc]  # harbor is untyped for .venv's mypy
    """One task's environment in one sandbox of the gateway, for one episode (start creates it, stop destroys it)."""

    _persistent_env: dict[str, str]

    def __init__(
        self,
        *,
        gateway: GatewayClient,
        job_id: str,
        task: Any,
        plan: EnvironmentPlan,
        trial_paths: Any,
        session_id: str,
        sandbox_template: str,
        ttl_s: float,
        default_timeout_s: float,
    ) -> None:
        self.gateway, self.job_id, self.plan = gateway, job_id, plan
        self.sandbox_template, self.ttl_s, self.default_timeout_s = sandbox_template, ttl_s, default_timeout_s
        self.sandbox_id: str | None = None
        self._paths: PathMap | None = None
        super().__init__(
            environment_dir=task.paths.environment_dir,
            environment_name=task.short_name,
            session_id=session_id,
            trial_paths=trial_paths,
            task_env_config=task.config.environment,
            logger=log,
            network_policy=NetworkPolicy(network_mode=NetworkMode.NO_NETWORK),
        )
        # The image's ENV under the task's [environment].env (which the base resolved into _persistent_env).
        self._persistent_env = {**plan.env, **self._persistent_env}

    @staticmethod
    def type() -> str:
        return "miles-sandbox"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self) -> None:
        """environment_plan already checked the task when the server loaded it."""

    @property
    def paths(self) -> PathMap:
        if self._paths is None:
            raise RuntimeError("the sandbox is not started")
        return self._paths

    async def _gateway(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(method, *args, **kwargs)

    async def start(self, force_build: bool) -> None:
        memory_mb = self.task_env_config.memory_mb or 0
        self.sandbox_id = await self._gateway(
            self.gateway.create,
            self.job_id,
            template=self.sandbox_template,
            ttl_s=self.ttl_s,
            memory_bytes=memory_mb * 1024 * 1024,
        )
        probe = await self._gateway(self.gateway.exec, self.sandbox_id, "pwd", env={}, timeout_s=30.0)
        self._paths = PathMap(probe.stdout.strip(), self.plan.workdir)
        await self._checked("mkdir -p /logs/agent /logs/verifier /logs/artifacts /tests /solution")
        for step in self.plan.steps:
            if step.command:
                await self._checked(step.command, cwd=step.cwd, timeout_s=_SETUP_TIMEOUT_S, what="RUN")
            else:
                await self._copy_step(step)

    async def stop(self, delete: bool) -> None:
        if self.sandbox_id is not None:
            sandbox_id, self.sandbox_id = self.sandbox_id, None
            await self._gateway(self.gateway.destroy, sandbox_id)

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: float | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """`command` through /bin/sh in the sandbox, paths moved; `user` is ignored (one uid per sandbox)."""
        shell = self.paths.translate(command)
        if cwd:
            shell = f"cd {shlex.quote(self.paths.translate(cwd))} || exit 1\n{shell}"
        merged = {key: self.paths.translate(value) for key, value in (self._merge_env(env) or {}).items()}
        timeout_s = float(timeout_sec or self.default_timeout_s)
        output = await self._gateway(self.gateway.exec, self.sandbox_id, shell, env=merged, timeout_s=timeout_s)
        return ExecResult(stdout=output.stdout, stderr=output.stderr, return_code=output.exit_code)

    async def _checked(self, command: str, *, cwd: str | None = None, timeout_s: float = 60.0, what: str = "") -> None:
        result = await self.exec(command, cwd=cwd, timeout_sec=timeout_s)
        if result.return_code != 0:
            output = ((result.stdout or "") + (result.stderr or ""))[-2000:]
            raise SandboxGatewayError(f"{what or 'setup'} `{command}` exited {result.return_code}: {output}")

    async def _stage(self, data: bytes) -> str:
        """Writes data to a fresh file under the work dir's .harbor/; returns its path inside the sandbox."""
        relative = f"{HARBOR_DIR}/transfer/{uuid.uuid4().hex}"
        await self._gateway(self.gateway.write, self.sandbox_id, relative, data)
        return f"{self.paths.workdir}/{relative}"

    async def _copy_step(self, step: SetupStep) -> None:
        for source in step.sources:
            host = (self.environment_dir / source).resolve()
            if not host.is_relative_to(self.environment_dir.resolve()) or not host.exists():
                raise UnsupportedTaskError(f"COPY source {source!r} is not a path inside environment/")
            if host.is_dir():
                await self.upload_dir(host, step.target)
            else:
                into_dir = step.target.endswith("/") or len(step.sources) > 1
                await self.upload_file(host, f"{step.target.rstrip('/')}/{host.name}" if into_dir else step.target)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        data = await asyncio.to_thread(Path(source_path).read_bytes)
        staged = await self._stage(self.paths.translate_file(data))
        target = shlex.quote(self.paths.translate(target_path))
        await self._checked(f'mkdir -p "$(dirname {target})" && mv {shlex.quote(staged)} {target}')

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        archive = await asyncio.to_thread(_tar_gz, Path(source_dir), self.paths)
        staged = shlex.quote(await self._stage(archive))
        target = shlex.quote(self.paths.translate(target_dir))
        await self._checked(f"mkdir -p {target} && tar -xzf {staged} -C {target} && rm -f {staged}")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        source = self.paths.translate(source_path)
        if source.startswith(f"{self.paths.workdir}/"):
            data = await self._gateway(self.gateway.read, self.sandbox_id, source)
        else:  # the file API reaches the work dir only: copy it there first
            staged = f"{self.paths.workdir}/{HARBOR_DIR}/transfer/{uuid.uuid4().hex}"
            await self._checked(
                f"mkdir -p {shlex.quote(str(PurePosixPath(staged).parent))} && cp {shlex.quote(source)} {staged}"
            )
            data = await self._gateway(self.gateway.read, self.sandbox_id, staged)
            await self._checked(f"rm -f {staged}")
        await asyncio.to_thread(_write_file, Path(target_path), data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        staged = f"{self.paths.workdir}/{HARBOR_DIR}/transfer/{uuid.uuid4().hex}.tar.gz"
        source = shlex.quote(self.paths.translate(source_dir))
        await self._checked(f"mkdir -p {HARBOR_DIR}/transfer && tar -czf {staged} -C {source} .")
        data = await self._gateway(self.gateway.read, self.sandbox_id, staged)
        await self._checked(f"rm -f {staged}")
        await asyncio.to_thread(_untar_gz, data, Path(target_dir))


def _tar_gz(source_dir: Path, paths: PathMap) -> bytes:
    """source_dir's tree as a .tar.gz, its text files' paths moved (PathMap.translate_file)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for path in sorted(source_dir.rglob("*")):
            info = archive.gettarinfo(str(path), arcname=path.relative_to(source_dir).as_posix())
            if info.isfile():
                data = paths.translate_file(path.read_bytes())
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
            elif info.isdir() or info.issym():
                archive.addfile(info)
    return buffer.getvalue()


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _untar_gz(data: bytes, target_dir: Path) -> None:
    target_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        archive.extractall(target_dir, filter=transfer_tar_filter)
