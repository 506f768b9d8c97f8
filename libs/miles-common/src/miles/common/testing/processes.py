"""Start a miles service as a real subprocess on a known port and wait for its /readyz.

Logs go to a file (printed when readiness fails, so a broken start-up explains itself in the test output).
Children get SIGTERM when the process that started them dies (Linux PR_SET_PDEATHSIG), so a test run that is
killed (timeout, Ctrl-C twice) does not leave servers behind.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from miles.common.spawn import ProcessSpec, kill, spawn, terminate


def wait_for_http_ready(url: str, timeout_s: float = 60.0, process: subprocess.Popen[bytes] | None = None) -> None:
    """Poll `url` until it answers 200; fail early when `process` exits."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before {url} was ready")
        try:
            response = httpx.get(url, timeout=2.0)
            if response.status_code == 200:
                return
            last_error = f"HTTP {response.status_code}: {response.text[:300]}"
        except httpx.HTTPError as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready within {timeout_s}s ({last_error})")


class ServiceProcess:
    """A service subprocess (argv as given), its environment and log file. Usable as a context manager."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        ready_url: str | None,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.argv = list(argv)
        self.ready_url = ready_url
        self.log_path = log_path
        self.env = dict(env or {})  # added to the environment this process has at start()
        self.cwd = cwd
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout_s: float = 60.0) -> ServiceProcess:
        spec = ProcessSpec(tuple(self.argv), self.log_path, self.env, cwd=self.cwd, die_with_parent=True)
        self.process = spawn(spec)
        if self.ready_url is not None:
            try:
                wait_for_http_ready(self.ready_url, ready_timeout_s, self.process)
            except (RuntimeError, TimeoutError) as exc:
                self.stop()
                raise RuntimeError(f"{exc}\n--- {self.log_path} ---\n{self.log_tail()}") from None
        return self

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        assert self.process is not None, "process not started"
        return self.process.pid

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill9(self) -> None:
        """SIGKILL the whole process group: what a crash looks like."""
        if self.process is not None:
            kill(self.process)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if self.process is None:
            return None
        return terminate(self.process, grace_s=timeout_s)

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
