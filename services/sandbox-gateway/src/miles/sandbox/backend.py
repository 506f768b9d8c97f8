"""The sandbox backend interface, the one function that picks a backend, and the threat model.

Backends: `local` (bubblewrap on this machine), `kubernetes` (a Pod per sandbox), `remote` (an HTTPS provider
speaking the sandbox HTTP API). The gateway core (`core.py`) owns ids, quotas, TTLs, the warm pool and
metrics; a backend only starts, runs in, and stops sandboxes it is told about, keyed by the gateway's id.

What each backend protects against, and — the important part — what it does NOT
================================================================================

Every backend runs each command as a non-root user with no network (unless an enforced egress allowlist is
asked for), a private writable work dir, a bounded wall-clock time per exec, and output capped per stream. The
gateway never runs a command unsandboxed: a backend that cannot start refuses at start-up.

local (bubblewrap + setpriv + rlimits + cgroups) does NOT protect against:
- Kernel exploits. Sandboxes share the host kernel. A seccomp filter refuses the system calls most exploits
  start from (new or nested namespaces, mounts, bpf, perf events, userfaultfd, io_uring, keyrings, ptrace,
  module loading, kexec, 32-bit system calls; local/seccomp.py), but it is a deny list: every other system call
  — file systems, sockets, memory management, and calls added to kernels after the list was written — stays
  reachable, and a bug there is a way out. Use the Kubernetes backend with gVisor if that matters.
- Reading what the template mounts. The template's system_paths (default /usr, /etc, ...) are visible
  read-only; anything world-readable there (e.g. files in /etc) is readable. /etc/shadow is not (mode 0640).
- Disk exhaustion. Each file is bounded by max_file_bytes, but not the number of files or the work dir's
  total size: put state_dir on a size-limited volume. /tmp is a tmpfs bounded by the template's tmp_bytes.
- Memory and process limits without cgroups. Where no cgroup is usable (e.g. an unprivileged gateway) memory
  is bounded only per process (RLIMIT_AS), and processes per uid (RLIMIT_NPROC): many processes can together
  use more.
- A sandbox that escapes its mount namespace in userns mode (unprivileged gateway, e.g. in the container
  image): all sandboxes and the gateway then share one host uid, so such an escape reaches the other
  sandboxes' work dirs and the gateway's files. In setuid mode each sandbox has a uid of its own. In userns
  mode a sandbox can also kill its own keeper process (ending only itself).
- Bugs in the gateway itself. In setuid mode the gateway runs as root; its file API (WriteFile/ReadFile) works
  in directories the sandbox controls. It never follows a symlink and only opens regular files (tested), but
  it is the part of this code to audit first.
- CPU share. cpu_s bounds CPU time per process, and timeout_s the exec's wall time; nothing divides CPU
  between sandboxes (a busy sandbox slows the others and the gateway) and threads of one process can use
  several cores at once.
- Processes that leave their exec. A process that calls setsid() survives its exec's end and timeout (by
  design: it is how a server is started in the background) until Destroy or the TTL; it still counts against
  the sandbox's limits and dies with the sandbox.
- Side channels (timing, cache, Spectre-class) and denial of service through shared kernel resources.
- Information in /proc of its own sandbox: processes of concurrent execs of the same sandbox can see (and,
  running as the same uid, signal) each other; ptrace and process_vm_* are refused by the filter. Sandboxes are
  isolated from each other, execs of one sandbox are not.

kubernetes (Pod + securityContext + NetworkPolicy, optionally gVisor) does NOT protect against:
- Anything the cluster does not enforce: NetworkPolicy needs a CNI that implements it (without one, pods have
  network); runtimeClassName is only as strong as the runtime installed; the pod security settings are only
  as good as the node's kernel (with runc the kernel is shared, like the local backend, but seccomp
  RuntimeDefault filters system calls).
- Process counts: Kubernetes has no per-pod process limit here (set the kubelet's podPidsLimit).
- Per-exec memory: the pod's memory limit is shared by every exec of the sandbox.
- Processes that keep running after their exec's timeout when they left the `timeout` process group, until
  Destroy or the TTL.
- The image: whatever the template's image contains (tools, credentials baked into it) is available.
- Host names in an egress allowlist: NetworkPolicy speaks IP blocks only (host names are refused).
- The gateway's own credentials: its ServiceAccount may create pods and exec into them in the sandbox
  namespace, so whoever controls the gateway controls that namespace (give it a namespace of its own).

remote (a provider over HTTPS) protects against exactly what the provider does: the gateway only forwards
requests, checks sizes and ids, and enforces TTLs and quotas on its side. It does NOT protect against a
provider that ignores limits or network settings, and sends commands, files and env to that provider.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from miles.sandbox.models import ExecEvent, ExecSpec, FileContent, SandboxSpec
from miles.sandbox.settings import SandboxSettings


class SandboxBackend(Protocol):
    """What the gateway core needs from a backend. Ids are the gateway's; every method may raise MilesError."""

    name: str
    supports_egress_allowlist: bool

    async def start(self) -> None:
        """Check prerequisites and prepare; raise BackendUnusableError (a ConfigError) when this backend cannot work."""

    async def close(self) -> None:
        """Destroy whatever this backend still holds."""

    async def create(self, sandbox_id: str, spec: SandboxSpec) -> None:
        """Start a sandbox; return only once it can run commands."""

    async def adopt(self, sandbox_id: str, spec: SandboxSpec) -> bool:
        """Make a warm-pool sandbox (created from the default spec) fit `spec`; False when it cannot."""

    def exec(self, sandbox_id: str, spec: ExecSpec) -> AsyncGenerator[ExecEvent, None]:
        """Run one command: output chunks as they come, then exactly one ExecResult."""

    async def write_file(self, sandbox_id: str, parts: tuple[str, ...], data: bytes, mode: int) -> int:
        """Write a file at work dir / parts (parents created); returns bytes written."""

    async def read_file(self, sandbox_id: str, parts: tuple[str, ...], max_bytes: int) -> FileContent:
        """Read at most max_bytes of the regular file at work dir / parts."""

    async def destroy(self, sandbox_id: str) -> None:
        """Kill every process of the sandbox and delete its files. Idempotent."""

    def is_alive(self, sandbox_id: str) -> bool:
        """False once the backend knows the sandbox can no longer run commands."""


def make_backend(settings: SandboxSettings) -> SandboxBackend:
    """The backend named by settings.backend (imported lazily: only the Kubernetes one needs its client)."""
    if settings.backend == "local":
        from miles.sandbox.local.backend import LocalBackend

        return LocalBackend(settings)
    if settings.backend == "kubernetes":
        from miles.sandbox.kubernetes_backend import KubernetesBackend

        return KubernetesBackend(settings)
    from miles.sandbox.remote_backend import RemoteBackend

    return RemoteBackend(settings)
