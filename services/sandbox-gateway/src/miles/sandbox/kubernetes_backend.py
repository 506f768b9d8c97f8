"""The Kubernetes backend: a Pod plus a NetworkPolicy per sandbox, execs through the API's exec endpoint.

Uses the official `kubernetes` client (blocking) on a dedicated thread pool, so that many concurrent execs do
not starve each other or the default executor. Create makes the NetworkPolicy first (the pod never runs
unfenced), then the Pod (kube_manifests.py), and waits until it is Running. Exec streams stdout/stderr over
the exec websocket (v5.channel.k8s.io, which can close stdin; on v4 a command that reads stdin to its end
waits for its timeout); the pod's `timeout` enforces timeout_s, the gateway stops reading 5 s later at the
latest. Files go through exec too (`cat`, `stat`, `head` as the sandbox's user inside the pod), so paths are
resolved by the pod's kernel with the sandbox's own permissions.

Limits: Kubernetes reports exit codes only (128+N is read as "killed by signal N"), and no CPU time; a
process that outlives its exec's `timeout` runs until Destroy or the TTL; the output cap closes the stream,
the process itself ends at its timeout. What this backend does not protect against is listed in backend.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from miles.common.errors import MilesError, UpstreamError
from miles.sandbox.errors import (
    BackendUnusableError,
    InvalidSandboxRequestError,
    SandboxGoneError,
    SandboxNotFoundError,
    SandboxStartFailedError,
)
from miles.sandbox.kube_manifests import (
    CONTAINER_NAME,
    MANAGED_BY,
    build_network_policy,
    build_pod,
    exec_command,
    pod_name,
)
from miles.sandbox.models import (
    ExecEvent,
    ExecResult,
    ExecSpec,
    FileContent,
    NetworkMode,
    OutputChunk,
    SandboxSpec,
    StreamName,
)
from miles.sandbox.outcome import ProcessOutcome, classify_limits
from miles.sandbox.settings import SandboxSettings

log = logging.getLogger(__name__)

EXEC_GRACE_S = 5.0
MAX_EXEC_THREADS = 256
_STDOUT, _STDERR, _STATUS = 1, 2, 3
_OUTPUT_CHANNELS: tuple[tuple[int, StreamName], ...] = ((_STDOUT, "stdout"), (_STDERR, "stderr"))

Emit = Callable[[StreamName, bytes], None]


@dataclass
class _PodSandbox:
    spec: SandboxSpec
    alive: bool = True


@dataclass(frozen=True)
class _ExecEnd:
    exit_code: int
    timed_out_client: bool
    output_capped: bool
    delivered: dict[StreamName, int]
    stderr_tail: bytes


def _api_status(exc: Exception) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def _exit_code_from_status(text: bytes) -> int:
    """The exit code in the exec error channel's Status ({"status": "Success"} or NonZeroExitCode)."""
    try:
        status = json.loads(text or b"{}")
    except ValueError:
        raise UpstreamError(f"malformed exec status from the Kubernetes API: {text[:200]!r}") from None
    if status.get("status") == "Success":
        return 0
    for cause in (status.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            return int(cause.get("message", "1"))
    raise UpstreamError(f"the pod could not run the command: {status.get('message', status)}")


class KubernetesBackend:
    name = "kubernetes"
    supports_egress_allowlist = True

    def __init__(self, settings: SandboxSettings) -> None:
        self.settings = settings
        self.kube = settings.kubernetes
        self._core: Any = None
        self._net: Any = None
        self._api_client: Any = None
        self._executor = ThreadPoolExecutor(max_workers=MAX_EXEC_THREADS, thread_name_prefix="kube-exec")
        self._sandboxes: dict[str, _PodSandbox] = {}

    async def _call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(function, *args, **kwargs))

    async def start(self) -> None:
        from kubernetes import client, config

        configuration = client.Configuration()
        if self.kube.api_url:
            configuration.host = self.kube.api_url
            configuration.verify_ssl = self.kube.verify_tls
            token = self.kube.bearer_token.get_secret_value()
            if token:
                configuration.api_key = {"authorization": token}
                configuration.api_key_prefix = {"authorization": "Bearer"}
        else:
            try:
                config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            except config.ConfigException:
                try:
                    config.load_kube_config(  # type: ignore[no-untyped-call]
                        config_file=self.kube.kubeconfig or None, client_configuration=configuration
                    )
                except (config.ConfigException, OSError) as exc:
                    raise BackendUnusableError(f"no Kubernetes configuration: {exc}", field="kubernetes") from None
        self._api_client = client.ApiClient(configuration)
        self._core = client.CoreV1Api(self._api_client)
        self._net = client.NetworkingV1Api(self._api_client)
        selector = f"app.kubernetes.io/managed-by={MANAGED_BY}"
        try:
            await self._call(self._core.list_namespaced_pod, self.kube.namespace, label_selector=selector, limit=1)
        except Exception as exc:  # any failure here means the backend cannot work: say so at start-up
            raise BackendUnusableError(
                f"cannot list pods in namespace {self.kube.namespace!r} through the Kubernetes API: {exc}",
                field="kubernetes",
            ) from None

    async def close(self) -> None:
        for sandbox_id in list(self._sandboxes):
            await self.destroy(sandbox_id)
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._api_client is not None:
            self._api_client.close()

    async def create(self, sandbox_id: str, spec: SandboxSpec) -> None:
        self._sandboxes[sandbox_id] = _PodSandbox(spec)
        try:
            policy = build_network_policy(sandbox_id, spec, self.kube)
            await self._call(self._net.create_namespaced_network_policy, self.kube.namespace, policy)
            pod = build_pod(sandbox_id, spec, self.kube)
            await self._call(self._core.create_namespaced_pod, self.kube.namespace, pod)
            await self._wait_running(pod_name(sandbox_id))
        except BaseException as exc:
            await self.destroy(sandbox_id)
            if isinstance(exc, MilesError | asyncio.CancelledError) or not isinstance(exc, Exception):
                raise
            raise SandboxStartFailedError(f"could not create the sandbox pod: {exc}") from exc

    async def _wait_running(self, name: str) -> None:
        deadline_s = time.monotonic() + self.kube.pod_startup_timeout_s
        while True:
            pod = await self._call(self._core.read_namespaced_pod, name, self.kube.namespace)
            phase = pod.status.phase if pod.status is not None else None
            if phase == "Running":
                return
            if phase in ("Failed", "Succeeded"):
                reason = pod.status.reason or pod.status.message or phase
                raise SandboxStartFailedError(f"sandbox pod {name} ended before it was ready: {reason}")
            if time.monotonic() > deadline_s:
                raise SandboxStartFailedError(
                    f"sandbox pod {name} was not Running within {self.kube.pod_startup_timeout_s} s (phase {phase})"
                )
            await asyncio.sleep(self.kube.poll_interval_s)

    async def adopt(self, sandbox_id: str, spec: SandboxSpec) -> bool:
        sandbox = self._sandboxes.get(sandbox_id)
        # A pod's memory limit and template are fixed at creation; rlimits are per exec and can follow spec.
        if sandbox is None or not sandbox.alive or spec.network.mode is not NetworkMode.NONE:
            return False
        if spec.template != sandbox.spec.template or spec.limits.memory_bytes != sandbox.spec.limits.memory_bytes:
            return False
        sandbox.spec = spec
        return True

    def is_alive(self, sandbox_id: str) -> bool:
        sandbox = self._sandboxes.get(sandbox_id)
        return sandbox is not None and sandbox.alive

    def _live(self, sandbox_id: str) -> _PodSandbox:
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None:
            raise SandboxNotFoundError(f"no sandbox {sandbox_id!r}", field="sandbox_id")
        if not sandbox.alive:
            raise SandboxGoneError(f"the pod of sandbox {sandbox_id!r} is gone; destroy it", field="sandbox_id")
        return sandbox

    def _exec_blocking(
        self, sandbox_id: str, command: list[str], stdin: bytes, deadline_s: float, max_output_bytes: int,
        emit: Emit, stop: threading.Event,
    ) -> _ExecEnd:  # fmt: skip
        from kubernetes.stream import stream

        try:
            response = stream(
                self._core.connect_get_namespaced_pod_exec,
                pod_name(sandbox_id),
                self.kube.namespace,
                command=command,
                container=CONTAINER_NAME,
                stderr=True,
                stdin=bool(stdin),
                stdout=True,
                tty=False,
                _preload_content=False,
                binary=True,
            )
        except Exception as exc:  # the client wraps every connection failure in ApiException(status=0)
            if _api_status(exc) == 404 or "404" in str(exc):
                self._sandboxes[sandbox_id].alive = False
                raise SandboxGoneError(f"the pod of sandbox {sandbox_id!r} is gone", field="sandbox_id") from None
            raise UpstreamError(f"exec through the Kubernetes API failed: {exc}") from None
        delivered: dict[StreamName, int] = {"stdout": 0, "stderr": 0}
        stderr_tail = b""
        capped = timed_out = False

        def drain() -> None:
            nonlocal capped, stderr_tail
            for channel, name in _OUTPUT_CHANNELS:
                data = response.read_channel(channel)
                room = max_output_bytes - delivered[name]
                if len(data) > room:
                    data, capped = data[: max(room, 0)], True
                if data:
                    delivered[name] += len(data)
                    if name == "stderr":
                        stderr_tail = (stderr_tail + data)[-4096:]
                    emit(name, data)

        try:
            if stdin:
                response.write_stdin(stdin)
                response.close_channel(0)
            while response.is_open() and not capped and not stop.is_set():
                response.update(timeout=0.05)
                drain()
                if time.monotonic() > deadline_s:
                    timed_out = True
                    break
            drain()
            finished = not (capped or timed_out or stop.is_set())
            exit_code = _exit_code_from_status(response.read_channel(_STATUS)) if finished else -1
        finally:
            response.close()
        return _ExecEnd(exit_code, timed_out, capped, delivered, stderr_tail)

    async def exec(self, sandbox_id: str, spec: ExecSpec) -> AsyncGenerator[ExecEvent, None]:
        self._live(sandbox_id)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[OutputChunk | None] = asyncio.Queue()
        stop = threading.Event()

        def emit(stream_name: StreamName, data: bytes) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, OutputChunk(stream_name, data))

        start_s = time.monotonic()
        command = exec_command(spec, address_space_factor=self.settings.address_space_factor)
        worker = loop.run_in_executor(
            self._executor,
            self._exec_blocking,
            sandbox_id,
            command,
            spec.stdin,
            start_s + spec.timeout_s + EXEC_GRACE_S,
            spec.limits.max_output_bytes,
            emit,
            stop,
        )
        worker.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (chunk := await queue.get()) is not None:
                yield chunk
            end = await worker
        finally:
            stop.set()
        yield self._result(end, spec, time.monotonic() - start_s)

    def _result(self, end: _ExecEnd, spec: ExecSpec, wall_s: float) -> ExecResult:
        code, signum = end.exit_code, 0
        if 128 < code < 160:  # Kubernetes gives exit codes only: read 128+N as "killed by signal N"
            code, signum = -1, end.exit_code - 128
        if end.output_capped or end.timed_out_client:
            code, signum = -1, signal.SIGKILL
        pod_timeout = signum == signal.SIGKILL and wall_s >= spec.timeout_s * 0.98
        outcome = ProcessOutcome(
            exit_code=code,
            signal=signum,
            wall_s=wall_s,
            cpu_s=0.0,
            timed_out=end.timed_out_client or (pod_timeout and not end.output_capped),
            output_capped=end.output_capped,
            stdout_bytes=end.delivered["stdout"],
            stderr_bytes=end.delivered["stderr"],
            stderr_tail=end.stderr_tail,
        )
        # SIGKILL before the deadline, not ours: in a pod that is the cgroup's OOM killer.
        oom_killed = signum == signal.SIGKILL and not outcome.timed_out and not end.output_capped
        return ExecResult(
            exit_code=code,
            signal=signum,
            wall_s=wall_s,
            cpu_s=0.0,
            limits_hit=classify_limits(outcome, spec.limits, oom_killed=oom_killed),
            stdout_bytes=outcome.stdout_bytes,
            stderr_bytes=outcome.stderr_bytes,
        )

    async def _run_collected(
        self, sandbox_id: str, argv: tuple[str, ...], stdin: bytes, max_output_bytes: int
    ) -> tuple[bytes, bytes, ExecResult]:
        sandbox = self._live(sandbox_id)
        spec = sandbox.spec
        limits = replace(spec.limits, max_output_bytes=max_output_bytes)
        exec_spec = ExecSpec(argv, stdin, self.settings.default_timeout_s, spec.workdir, spec.template.env, limits)
        output: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        result: ExecResult | None = None
        async for event in self.exec(sandbox_id, exec_spec):
            if isinstance(event, OutputChunk):
                output[event.stream].append(event.data)
            else:
                result = event
        assert result is not None
        return b"".join(output["stdout"]), b"".join(output["stderr"]), result

    async def write_file(self, sandbox_id: str, parts: tuple[str, ...], data: bytes, mode: int) -> int:
        path = "/".join((self._live(sandbox_id).spec.workdir.rstrip("/"), *parts))
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1" && chmod "$2" -- "$1"'
        _, stderr, result = await self._run_collected(
            sandbox_id, ("/bin/sh", "-c", script, "sh", path, f"{mode:o}"), data, 64 * 1024
        )
        if result.exit_code != 0:
            raise InvalidSandboxRequestError(f"cannot write {path}: {stderr.decode(errors='replace')}", field="path")
        return len(data)

    async def read_file(self, sandbox_id: str, parts: tuple[str, ...], max_bytes: int) -> FileContent:
        path = "/".join((self._live(sandbox_id).spec.workdir.rstrip("/"), *parts))
        script = 'test -f "$1" && stat -c %s -- "$1" && head -c "$2" -- "$1"'
        stdout, stderr, result = await self._run_collected(
            sandbox_id, ("/bin/sh", "-c", script, "sh", path, str(max_bytes)), b"", max_bytes + 64
        )
        size_text, newline, data = stdout.partition(b"\n")
        if result.exit_code != 0 or not newline or not size_text.isdigit():
            message = stderr.decode(errors="replace") or "not a regular file"
            raise InvalidSandboxRequestError(f"cannot read {path}: {message}", field="path")
        size_bytes = int(size_text)
        return FileContent(data=data, size_bytes=size_bytes, truncated=len(data) < size_bytes)

    async def destroy(self, sandbox_id: str) -> None:
        if self._sandboxes.pop(sandbox_id, None) is None:
            return
        name = pod_name(sandbox_id)
        for delete in (self._core.delete_namespaced_pod, self._net.delete_namespaced_network_policy):
            try:
                await self._call(delete, name, self.kube.namespace, grace_period_seconds=0)
            except Exception as exc:  # gone already is fine; otherwise activeDeadlineSeconds still ends the pod
                if _api_status(exc) != 404:
                    log.warning("could not delete a sandbox object", extra={"name": name, "error": str(exc)})
