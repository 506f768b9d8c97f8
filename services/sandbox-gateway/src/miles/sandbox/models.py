"""The sandbox-gateway's own data types: what the transports hand to the core and the core to the backends.

Requests arrive as `CreateParams` / `ExecParams` (raw, 0 = "default"); `validation.py` turns them into
`SandboxSpec` / `ExecSpec` (every field resolved and within bounds) before any backend sees them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from miles.sandbox.settings import SandboxTemplate

StreamName = Literal["stdout", "stderr"]


class LimitKind(enum.Enum):
    """A limit an exec ran into (the proto's LimitKind)."""

    TIMEOUT = "timeout"
    CPU = "cpu"
    MEMORY = "memory"
    PROCESSES = "processes"
    FILE_SIZE = "file_size"
    OUTPUT = "output"


class NetworkMode(enum.Enum):
    NONE = "none"
    EGRESS_ALLOWLIST = "egress_allowlist"


@dataclass(frozen=True)
class Limits:
    """Limits of one sandbox. In CreateParams a 0 means "template default"; in a SandboxSpec all are > 0."""

    cpu_s: float = 0.0
    memory_bytes: int = 0
    max_processes: int = 0
    max_open_files: int = 0
    max_file_bytes: int = 0
    max_output_bytes: int = 0


LIMIT_FIELDS: tuple[str, ...] = tuple(Limits.__dataclass_fields__)


@dataclass(frozen=True)
class NetworkSpec:
    mode: NetworkMode = NetworkMode.NONE
    egress_allowlist: tuple[str, ...] = ()


@dataclass(frozen=True)
class CreateParams:
    """A Create request as received (unvalidated)."""

    job_id: str = ""
    template: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    limits: Limits = Limits()
    ttl_s: float = 0.0
    network: NetworkSpec = NetworkSpec()


@dataclass(frozen=True)
class SandboxSpec:
    """A validated Create: what a backend builds a sandbox from."""

    template_name: str
    template: SandboxTemplate
    limits: Limits
    network: NetworkSpec
    workdir: str


@dataclass(frozen=True)
class ExecParams:
    """An Exec request as received (unvalidated): exactly one of argv / shell should be set."""

    argv: tuple[str, ...] | None = None
    shell: str | None = None
    stdin: bytes = b""
    timeout_s: float = 0.0
    cwd: str = ""
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ExecSpec:
    """A validated exec: absolute cwd inside the sandbox, the full environment, the sandbox's limits."""

    argv: tuple[str, ...]
    stdin: bytes
    timeout_s: float
    cwd: str
    env: Mapping[str, str]
    limits: Limits


@dataclass(frozen=True)
class OutputChunk:
    stream: StreamName
    data: bytes


@dataclass(frozen=True)
class ExecResult:
    """How an exec ended. exit_code is -1 when a signal ended it (then `signal` is set)."""

    exit_code: int
    signal: int
    wall_s: float
    cpu_s: float
    limits_hit: tuple[LimitKind, ...]
    stdout_bytes: int
    stderr_bytes: int


ExecEvent = OutputChunk | ExecResult


@dataclass(frozen=True)
class FileContent:
    data: bytes
    size_bytes: int
    truncated: bool


@dataclass(frozen=True)
class CreatedSandbox:
    sandbox_id: str
    backend: str
    startup_s: float
    limits: Limits
    warm: bool


@dataclass(frozen=True)
class SandboxInfo:
    sandbox_id: str
    job_id: str
    backend: str
    template: str
    created_at_unix_ms: int
    last_used_unix_ms: int
    ttl_s: float
    limits: Limits
    network_mode: NetworkMode
    active_execs: int
