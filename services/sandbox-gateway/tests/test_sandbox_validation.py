"""Request validation (pure): defaults, bounds and the field each refusal names."""

from __future__ import annotations

import math

import pytest

from miles.sandbox.errors import FileTooLargeError, InvalidSandboxRequestError, UnsafePathError
from miles.sandbox.models import CreateParams, ExecParams, Limits, NetworkMode, NetworkSpec
from miles.sandbox.settings import SandboxSettings
from miles.sandbox.validation import path_components, resolve_create, resolve_exec, validate_allowlist_entry


@pytest.fixture
def settings() -> SandboxSettings:
    return SandboxSettings()


def test_zero_limits_take_the_template_defaults(settings: SandboxSettings) -> None:
    spec, ttl_s, env = resolve_create(
        CreateParams(limits=Limits(memory_bytes=64 << 20)), settings, allowlist_supported=False
    )
    defaults = settings.templates["default"].limits
    assert spec.limits == Limits(
        cpu_s=defaults.cpu_s,
        memory_bytes=64 << 20,
        max_processes=defaults.max_processes,
        max_open_files=defaults.max_open_files,
        max_file_bytes=defaults.max_file_bytes,
        max_output_bytes=defaults.max_output_bytes,
    )
    assert ttl_s == settings.default_ttl_s and env == {}


@pytest.mark.parametrize(
    ("limits", "field"),
    [
        (Limits(cpu_s=-1), "limits.cpu_s"),
        (Limits(cpu_s=math.inf), "limits.cpu_s"),
        (Limits(memory_bytes=9 << 30), "limits.memory_bytes"),
        (Limits(max_processes=-2), "limits.max_processes"),
        (Limits(max_file_bytes=5 << 30), "limits.max_file_bytes"),
    ],
)
def test_limits_out_of_bounds_name_the_field(settings: SandboxSettings, limits: Limits, field: str) -> None:
    with pytest.raises(InvalidSandboxRequestError) as error:
        resolve_create(CreateParams(limits=limits), settings, allowlist_supported=False)
    assert error.value.field == field


def test_network_allowlist_needs_a_backend_that_enforces_it(settings: SandboxSettings) -> None:
    allowlist = NetworkSpec(NetworkMode.EGRESS_ALLOWLIST, ("10.0.0.0/8", "1.2.3.4/32:443", "[2001:db8::/32]:53"))
    with pytest.raises(InvalidSandboxRequestError) as error:
        resolve_create(CreateParams(network=allowlist), settings, allowlist_supported=False)
    assert error.value.field == "network.mode"
    spec, _, _ = resolve_create(CreateParams(network=allowlist), settings, allowlist_supported=True)
    assert spec.network == allowlist
    bad = NetworkSpec(NetworkMode.EGRESS_ALLOWLIST, ("10.0.0.0/8", "example.com:443"))
    with pytest.raises(InvalidSandboxRequestError) as error:
        resolve_create(CreateParams(network=bad), settings, allowlist_supported=True)
    assert error.value.field == "network.egress_allowlist[1]"


@pytest.mark.parametrize("entry", ["10.0.0.0/8:0", "10.0.0.0/8:70000", "host", "1.2.3.4/33"])
def test_malformed_allowlist_entries(entry: str) -> None:
    with pytest.raises(ValueError):
        validate_allowlist_entry(entry)


def test_exec_resolves_shell_cwd_env_and_defaults(settings: SandboxSettings) -> None:
    params = CreateParams(env={"A": "sandbox", "B": "sandbox"})
    spec, _, env = resolve_create(params, settings, allowlist_supported=False)
    exec_spec = resolve_exec(
        ExecParams(shell="echo hi", cwd="/workspace/sub/./dir/", env={"B": "exec"}),
        sandbox_env=env,
        spec=spec,
        settings=settings,
    )
    assert exec_spec.argv == ("/bin/sh", "-c", "echo hi")
    assert exec_spec.cwd == "/workspace/sub/dir"
    assert exec_spec.env["A"] == "sandbox" and exec_spec.env["B"] == "exec" and exec_spec.env["HOME"] == "/workspace"
    assert exec_spec.timeout_s == settings.default_timeout_s


@pytest.mark.parametrize(
    ("params", "field", "error_class"),
    [
        (ExecParams(), "command", InvalidSandboxRequestError),
        (ExecParams(argv=("a",), shell="b"), "command", InvalidSandboxRequestError),
        (ExecParams(argv=("X=1", "cmd")), "argv", InvalidSandboxRequestError),
        (ExecParams(argv=("a\0b",)), "argv", InvalidSandboxRequestError),
        (ExecParams(argv=("true",), timeout_s=1e9), "timeout_s", InvalidSandboxRequestError),
        (ExecParams(argv=("true",), cwd="/etc"), "cwd", UnsafePathError),
        (ExecParams(argv=("true",), env={"": "x"}), "env", InvalidSandboxRequestError),
        (ExecParams(argv=("true",), stdin=b"x" * (2 << 20)), "stdin", FileTooLargeError),
    ],
)
def test_bad_exec_requests_name_the_field(
    settings: SandboxSettings, params: ExecParams, field: str, error_class: type[Exception]
) -> None:
    spec, _, env = resolve_create(CreateParams(), settings, allowlist_supported=False)
    with pytest.raises(error_class) as error:
        resolve_exec(params, sandbox_env=env, spec=spec, settings=settings)
    assert error.value.field == field  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("path", "parts"),
    [("a/b.txt", ("a", "b.txt")), ("/workspace/a", ("a",)), ("./a//b/", ("a", "b")), ("/workspace/", ())],
)
def test_path_components(path: str, parts: tuple[str, ...]) -> None:
    assert path_components(path, "/workspace", field="path", allow_empty=True) == parts


@pytest.mark.parametrize("path", ["../x", "a/../../x", "/etc/passwd", "/workspacex/a", "a\0b", ""])
def test_unsafe_paths_are_refused(path: str) -> None:
    with pytest.raises(UnsafePathError) as error:
        path_components(path, "/workspace", field="path")
    assert error.value.field == "path"


def test_settings_refuse_template_limits_above_the_maximum() -> None:
    from miles.common.errors import ConfigError
    from miles.common.settings import load_settings

    with pytest.raises(ConfigError) as error:
        load_settings(SandboxSettings, templates={"default": {"limits": {"memory_bytes": 1 << 40}}})
    assert "max_limits.memory_bytes" in error.value.message and error.value.field == "templates"
    with pytest.raises(ConfigError) as error:
        load_settings(SandboxSettings, default_template="missing")
    assert error.value.field == "default_template"
    with pytest.raises(ConfigError) as error:
        load_settings(SandboxSettings, backend="remote")
    assert error.value.field == "remote"
