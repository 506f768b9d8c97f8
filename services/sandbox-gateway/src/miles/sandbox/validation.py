"""Request validation: raw Create/Exec parameters become specs, or an InvalidSandboxRequestError naming the field.

Every bound is checked here, once, for every transport (gRPC, HTTP) and every backend. Paths are reduced to
plain components ("a/b/c" -> ("a", "b", "c")); a component of "..", a NUL byte, or an absolute path outside the
work dir is refused, so no backend ever resolves a path that climbs out of the work dir by name (symlinks are
the backends' concern: the local one never follows them, the others resolve them inside the sandbox).
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Mapping

from miles.sandbox.errors import FileTooLargeError, InvalidSandboxRequestError, UnsafePathError
from miles.sandbox.models import (
    LIMIT_FIELDS,
    CreateParams,
    ExecParams,
    ExecSpec,
    Limits,
    NetworkMode,
    NetworkSpec,
    SandboxSpec,
)
from miles.sandbox.settings import LimitValues, SandboxSettings

MAX_JOB_ID_CHARS = 253
MAX_PATH_CHARS = 4096


def resolve_limits(requested: Limits, defaults: LimitValues, maxima: LimitValues, field_prefix: str) -> Limits:
    """Fill zeros from `defaults`; refuse negatives, NaN and values above `maxima`, naming the field."""
    resolved: dict[str, float | int] = {}
    for name in LIMIT_FIELDS:
        value = getattr(requested, name)
        field = f"{field_prefix}.{name}"
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidSandboxRequestError(f"{field} must be a finite number", field=field)
        if value < 0:
            raise InvalidSandboxRequestError(f"{field} must be >= 0 (0 = template default), got {value}", field=field)
        maximum = getattr(maxima, name)
        if value > maximum:
            raise InvalidSandboxRequestError(f"{field} = {value} is above the gateway maximum {maximum}", field=field)
        resolved[name] = value or getattr(defaults, name)
    return Limits(**resolved)  # type: ignore[arg-type]


def validate_env(env: Mapping[str, str], field: str, max_env_bytes: int) -> dict[str, str]:
    """Environment names must be non-empty, without "=" or NUL; values without NUL; total size bounded."""
    total_bytes = 0
    for name, value in env.items():
        if not name or "=" in name or "\0" in name:
            raise InvalidSandboxRequestError(f"{field}: invalid variable name {name!r}", field=field)
        if "\0" in value:
            raise InvalidSandboxRequestError(f"{field}.{name}: value contains a NUL byte", field=field)
        total_bytes += len(name.encode()) + len(value.encode()) + 2
    if total_bytes > max_env_bytes:
        message = f"{field} is {total_bytes} bytes, above the cap of {max_env_bytes}"
        raise InvalidSandboxRequestError(message, field=field)
    return dict(env)


def validate_seconds(value: float, *, default: float, maximum: float, field: str) -> float:
    """0 -> default; refuse negatives, NaN/inf and values above maximum."""
    if not math.isfinite(value) or value < 0:
        message = f"{field} must be a finite number >= 0 (0 = default), got {value}"
        raise InvalidSandboxRequestError(message, field=field)
    if value > maximum:
        raise InvalidSandboxRequestError(f"{field} = {value} is above the gateway maximum {maximum}", field=field)
    return value or default


def validate_allowlist_entry(entry: str) -> None:
    """ "CIDR", "CIDR:port" (IPv4) or "[CIDR]:port" (IPv6); raises ValueError when malformed."""
    network, port = entry, ""
    if entry.startswith("["):
        network, _, port = entry[1:].partition("]:")
    elif entry.count(":") == 1:
        network, _, port = entry.partition(":")
    ipaddress.ip_network(network, strict=False)
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"bad port {port!r}")


def validate_network(network: NetworkSpec, *, allowlist_supported: bool) -> NetworkSpec:
    if network.mode is NetworkMode.NONE:
        if network.egress_allowlist:
            raise InvalidSandboxRequestError(
                "network.egress_allowlist needs network.mode EGRESS_ALLOWLIST", field="network.egress_allowlist"
            )
        return network
    if not allowlist_supported:
        raise InvalidSandboxRequestError(
            "this gateway's backend cannot enforce an egress allowlist; use network mode NONE", field="network.mode"
        )
    for index, entry in enumerate(network.egress_allowlist):
        try:
            validate_allowlist_entry(entry)
        except ValueError as exc:
            field = f"network.egress_allowlist[{index}]"
            raise InvalidSandboxRequestError(f"{field}: {entry!r} is not CIDR[:port] ({exc})", field=field) from None
    return network


def resolve_create(
    params: CreateParams, settings: SandboxSettings, *, allowlist_supported: bool
) -> tuple[SandboxSpec, float, dict[str, str]]:
    """A validated SandboxSpec, the effective ttl_s and the sandbox env."""
    if len(params.job_id) > MAX_JOB_ID_CHARS:
        raise InvalidSandboxRequestError(f"job_id is longer than {MAX_JOB_ID_CHARS} characters", field="job_id")
    template_name = params.template or settings.default_template
    template = settings.templates.get(template_name)
    if template is None:
        raise InvalidSandboxRequestError(
            f"unknown template {template_name!r}; known: {sorted(settings.templates)}", field="template"
        )
    limits = resolve_limits(params.limits, template.limits, settings.max_limits, "limits")
    ttl_s = validate_seconds(params.ttl_s, default=settings.default_ttl_s, maximum=settings.max_ttl_s, field="ttl_s")
    env = validate_env(params.env, "env", settings.max_env_bytes)
    network = validate_network(params.network, allowlist_supported=allowlist_supported)
    spec = SandboxSpec(
        template_name=template_name, template=template, limits=limits, network=network, workdir=settings.workdir
    )
    return spec, ttl_s, env


def resolve_exec(
    params: ExecParams, *, sandbox_env: Mapping[str, str], spec: SandboxSpec, settings: SandboxSettings
) -> ExecSpec:
    """A validated ExecSpec: argv (shell -> /bin/sh -c), absolute cwd, merged env, bounded stdin and timeout."""
    if params.argv is not None and params.shell is not None:
        raise InvalidSandboxRequestError("give either argv or shell, not both", field="command")
    if params.shell is not None:
        if "\0" in params.shell:
            raise InvalidSandboxRequestError("shell contains a NUL byte", field="shell")
        argv: tuple[str, ...] = ("/bin/sh", "-c", params.shell)
    elif params.argv:
        argv = tuple(params.argv)
        if any("\0" in arg for arg in argv):
            raise InvalidSandboxRequestError("argv contains a NUL byte", field="argv")
        if "=" in argv[0]:
            raise InvalidSandboxRequestError("argv[0] must not contain '='", field="argv")
    else:
        raise InvalidSandboxRequestError("give a command: a non-empty argv or a shell string", field="command")
    if len(params.stdin) > settings.max_stdin_bytes:
        raise FileTooLargeError(
            f"stdin is {len(params.stdin)} bytes, above the cap of {settings.max_stdin_bytes}", field="stdin"
        )
    timeout_s = validate_seconds(
        params.timeout_s, default=settings.default_timeout_s, maximum=settings.max_timeout_s, field="timeout_s"
    )
    cwd_parts = path_components(params.cwd, spec.workdir, field="cwd", allow_empty=True)
    env = {**spec.template.env, **sandbox_env, **validate_env(params.env, "env", settings.max_env_bytes)}
    validate_env(env, "env", settings.max_env_bytes)
    return ExecSpec(
        argv=argv,
        stdin=params.stdin,
        timeout_s=timeout_s,
        cwd="/".join((spec.workdir.rstrip("/"), *cwd_parts)),
        env=env,
        limits=spec.limits,
    )


def path_components(path: str, workdir: str, *, field: str, allow_empty: bool = False) -> tuple[str, ...]:
    """Components of a path relative to the work dir ("/workspace/a/b" and "a/b" -> ("a", "b")).

    Refuses "..", NUL bytes, absolute paths outside the work dir, and (unless allow_empty) the work dir itself.
    """
    if "\0" in path or len(path) > MAX_PATH_CHARS:
        raise UnsafePathError(f"{field} contains a NUL byte or is too long", field=field)
    root = workdir.rstrip("/")
    relative = path
    if path.startswith("/"):
        if path != root and not path.startswith(root + "/"):
            raise UnsafePathError(f"{field} {path!r} is outside the work dir {root}", field=field)
        relative = path[len(root) :]
    parts = tuple(part for part in relative.split("/") if part not in ("", "."))
    if ".." in parts:
        raise UnsafePathError(f"{field} {path!r} contains '..'", field=field)
    if not parts and not allow_empty:
        raise UnsafePathError(f"{field} must name a file inside the work dir", field=field)
    return parts
