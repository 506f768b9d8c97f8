"""Settings of the sandbox-gateway (environment prefix MILES_SANDBOX_), validated at start-up.

Nested fields use "__" (MILES_SANDBOX_KUBERNETES__NAMESPACE); dict and list fields take JSON
(MILES_SANDBOX_TEMPLATES='{"default": {...}, "python": {...}}').
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator

from miles.common.auth import check_token_setting
from miles.common.settings import ServiceSettings, service_config

MiB = 1024 * 1024
GiB = 1024 * MiB


class LimitValues(BaseModel):
    """A full set of limits: a template's defaults, or the gateway's maxima."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    cpu_s: float = Field(default=60.0, gt=0)
    """CPU time per process of an exec, seconds (RLIMIT_CPU)."""

    memory_bytes: int = Field(default=512 * MiB, gt=0)
    """Memory of the sandbox, bytes (cgroup memory limit where usable; per-process address space always)."""

    max_processes: int = Field(default=64, gt=0)
    """Live processes and threads of the sandbox (pids cgroup where usable; RLIMIT_NPROC always)."""

    max_open_files: int = Field(default=256, gt=0)
    """Open file descriptors per process (RLIMIT_NOFILE)."""

    max_file_bytes: int = Field(default=256 * MiB, gt=0)
    """Largest file a process may write, bytes (RLIMIT_FSIZE)."""

    max_output_bytes: int = Field(default=1 * MiB, gt=0)
    """Output delivered per stream per exec, bytes; an exec writing more is killed (LIMIT_KIND_OUTPUT)."""


MAX_LIMITS_DEFAULT = LimitValues(
    cpu_s=3600.0,
    memory_bytes=8 * GiB,
    max_processes=1024,
    max_open_files=4096,
    max_file_bytes=4 * GiB,
    max_output_bytes=64 * MiB,
)


class SandboxTemplate(BaseModel):
    """What a sandbox is made of. Local backend: `system_paths`; Kubernetes: `image`; both: env and limits."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    system_paths: tuple[str, ...] = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc")
    """Local backend: host paths mounted read-only into the sandbox (symlinks such as /bin -> usr/bin are
    recreated as symlinks; missing paths are skipped). Must provide /bin/sh, sleep, env and setpriv (the
    gateway runs them inside the sandbox)."""

    image: str = "python:3.11-slim"
    """Kubernetes backend: container image of the sandbox pod (must provide /bin/sh, coreutils `env`, `timeout`,
    `head`, `stat`, `cat` and util-linux `prlimit`; Debian-based images do)."""

    env: dict[str, str] = Field(
        default_factory=lambda: {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/workspace", "LANG": "C.UTF-8"}
    )
    """Environment of every exec (a sandbox's and an exec's own env override it)."""

    limits: LimitValues = LimitValues()
    """Default limits of sandboxes made from this template (each must be within the gateway's max_limits)."""

    tmp_bytes: int = Field(default=64 * MiB, gt=0)
    """Size of the sandbox's private /tmp (a tmpfs; its pages count against the sandbox's memory)."""

    workspace_bytes: int = Field(default=1 * GiB, gt=0)
    """Kubernetes backend: sizeLimit of the work dir emptyDir. The local backend does not bound the work dir's
    total size (only each file, by max_file_bytes): put state_dir on a size-limited volume."""


class KubernetesSettings(BaseModel):
    """The Kubernetes backend: one Pod (plus a deny-egress NetworkPolicy) per sandbox."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    namespace: str = "miles-sandboxes"
    """Namespace the sandbox pods and NetworkPolicies are created in."""

    api_url: str = ""
    """API server URL; "" = in-cluster service-account config, else the kubeconfig below."""

    kubeconfig: str = ""
    """Path of a kubeconfig used when api_url is "" and the gateway does not run in a cluster."""

    bearer_token: SecretStr = SecretStr("")
    """Token sent to api_url (only with api_url)."""

    verify_tls: bool = True
    """Verify the API server's certificate (only with api_url)."""

    runtime_class_name: str = ""
    """RuntimeClass of sandbox pods (e.g. "gvisor" for a user-space kernel); "" = the cluster default."""

    cpu_cores: float = Field(default=1.0, gt=0)
    """CPU limit of each sandbox pod, cores (resources.limits.cpu)."""

    run_as_user: int = Field(default=65534, gt=0)
    """Non-root uid (and gid) the sandbox container runs as."""

    pod_startup_timeout_s: float = Field(default=120.0, gt=0)
    """Seconds a pod may take to reach Running before Create fails (and the pod is deleted)."""

    poll_interval_s: float = Field(default=0.5, gt=0)
    """Seconds between pod status polls while waiting for Running."""

    max_lifetime_s: int = Field(default=86400, gt=0)
    """activeDeadlineSeconds of each pod: Kubernetes kills it after this long even if the gateway is gone."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """nodeSelector of sandbox pods (e.g. a dedicated, tainted node pool)."""


class RemoteSettings(BaseModel):
    """The remote-provider backend: an HTTPS service speaking the sandbox HTTP API (see README)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    base_url: str = ""
    """Provider base URL, e.g. https://sandboxes.example.com (required with backend "remote")."""

    api_key: SecretStr = SecretStr("")
    """Sent as `Authorization: Bearer <api_key>`."""

    request_timeout_s: float = Field(default=30.0, gt=0)
    """Timeout of every call except Exec (whose timeout is its timeout_s plus this)."""

    verify_tls: bool = True
    """Verify the provider's certificate."""


class SandboxSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("SANDBOX")

    port: int = 50054
    """gRPC listening port."""

    metrics_port: int = 51054
    """HTTP port: the HTTP facade (/v1/sandboxes ...) plus /healthz, /readyz and /metrics."""

    operator_token: SecretStr = SecretStr("")
    """Bearer token of the control API (HTTP /v1/sandboxes and every SandboxService RPC); it opens every job's
    sandboxes and is held by the controller. Each job gets job_capability(operator_token, "sandbox", job_id) from
    the controller, which opens only that job's sandboxes. Required (32+ characters) when host is not a loopback
    address; empty on loopback leaves the API open (development). /healthz, /readyz and /metrics stay open."""

    backend: Literal["local", "kubernetes", "remote"] = "local"
    """Where sandboxes run: local bubblewrap, Kubernetes pods, or a remote provider."""

    max_limits: LimitValues = MAX_LIMITS_DEFAULT
    """Largest limits a Create may ask for; larger values are refused naming the field."""

    templates: dict[str, SandboxTemplate] = Field(default_factory=lambda: {"default": SandboxTemplate()})
    """Named sandbox templates (JSON); Create picks one by name."""

    default_template: str = "default"
    """Template used when Create names none; must be a key of templates."""

    workdir: str = "/workspace"
    """Absolute path of the sandbox's private writable work dir, as seen inside the sandbox."""

    max_ttl_s: float = Field(default=86400.0, gt=0)
    """Largest ttl_s a Create may ask for."""

    default_ttl_s: float = Field(default=600.0, gt=0)
    """Idle seconds after which the reaper destroys a sandbox when Create gives no ttl_s."""

    reaper_interval_s: float = Field(default=1.0, gt=0)
    """Seconds between reaper passes (TTL expiry, dead sandboxes)."""

    max_timeout_s: float = Field(default=3600.0, gt=0)
    """Largest timeout_s an exec may ask for."""

    default_timeout_s: float = Field(default=60.0, gt=0)
    """Wall-clock limit of an exec that gives no timeout_s, seconds."""

    max_sandboxes: int = Field(default=1024, gt=0)
    """Live sandboxes in the whole gateway (the warm pool not included)."""

    max_sandboxes_per_job: int = Field(default=256, gt=0)
    """Live sandboxes per job_id; Create beyond it is RESOURCE_EXHAUSTED."""

    warm_pool_size: int = Field(default=2, ge=0)
    """Sandboxes of the default template kept started ahead of Create (0 = no pool)."""

    max_write_bytes: int = Field(default=16 * MiB, gt=0)
    """Largest WriteFile, bytes."""

    max_read_bytes: int = Field(default=16 * MiB, gt=0)
    """Largest ReadFile answer, bytes (longer files are truncated and flagged)."""

    max_stdin_bytes: int = Field(default=1 * MiB, gt=0)
    """Largest stdin of an exec, bytes."""

    max_env_bytes: int = Field(default=64 * 1024, gt=0)
    """Largest total size of an exec's environment (names + values), bytes."""

    startup_timeout_s: float = Field(default=15.0, gt=0)
    """Local backend: seconds a sandbox may take to start before Create fails."""

    bwrap_path: str = "bwrap"
    """Local backend: the bubblewrap binary (a name looked up on PATH, or a path)."""

    state_dir: str = ""
    """Local backend: directory holding the sandboxes' work dirs; "" = a fresh temporary directory."""

    privilege_mode: Literal["auto", "setuid", "userns"] = "auto"
    """Local backend: "setuid" (gateway runs as root; each sandbox gets its own uid via setpriv), "userns"
    (gateway runs unprivileged; sandboxes run as the gateway's uid inside a user namespace), "auto" (by uid)."""

    uid_range_start: int = Field(default=200000, gt=0)
    """Local backend, setuid mode: first uid handed to sandboxes (one uid per live sandbox)."""

    uid_range_size: int = Field(default=20000, gt=0)
    """Local backend, setuid mode: number of uids in the range (bounds live local sandboxes)."""

    cgroup_mode: Literal["auto", "off", "require"] = "auto"
    """Local backend: memory and pids cgroups per sandbox. "auto" uses them where usable (v1 or v2) and
    otherwise relies on rlimits alone; "require" refuses to start without a usable memory cgroup."""

    address_space_factor: float = Field(default=4.0, ge=1.0)
    """Local backend: RLIMIT_AS per process = memory_bytes x this when a cgroup enforces memory_bytes (runtimes
    reserve more address space than they use); exactly memory_bytes when no cgroup is usable."""

    kubernetes: KubernetesSettings = KubernetesSettings()
    """Kubernetes backend settings."""

    remote: RemoteSettings = RemoteSettings()
    """Remote-provider backend settings."""

    # Field validators (not one model validator) so that a refusal names its field; each only looks at fields
    # declared above it.
    @field_validator("operator_token")
    @classmethod
    def _operator_token_guards_a_network_bind(cls, token: SecretStr, info: ValidationInfo) -> SecretStr:
        if "host" in info.data:  # else host itself was refused, which already stops start-up
            check_token_setting(token.get_secret_value(), host=info.data["host"], field="operator_token")
        return token

    @field_validator("templates")
    @classmethod
    def _templates_within_max_limits(cls, templates: dict[str, SandboxTemplate], info: ValidationInfo) -> Any:
        maxima = info.data.get("max_limits", MAX_LIMITS_DEFAULT)
        for name, template in templates.items():
            for field in LimitValues.model_fields:
                if getattr(template.limits, field) > getattr(maxima, field):
                    raise ValueError(f"templates.{name}.limits.{field} is above max_limits.{field}")
        return templates

    @field_validator("default_template")
    @classmethod
    def _default_template_exists(cls, name: str, info: ValidationInfo) -> str:
        known = sorted(info.data.get("templates", {}))
        if name not in known:
            raise ValueError(f"{name!r} is not one of templates {known}")
        return name

    @field_validator("workdir")
    @classmethod
    def _workdir_is_a_private_absolute_path(cls, workdir: str) -> str:
        if not workdir.startswith("/") or workdir.rstrip("/") in ("", "/tmp", "/proc", "/dev", "/usr", "/etc"):
            raise ValueError(f"must be an absolute path other than /, /tmp, /proc, /dev, /usr, /etc (got {workdir!r})")
        return workdir.rstrip("/")

    @field_validator("default_ttl_s", "default_timeout_s")
    @classmethod
    def _default_within_max(cls, value: float, info: ValidationInfo) -> float:
        maximum_field = "max_ttl_s" if info.field_name == "default_ttl_s" else "max_timeout_s"
        maximum = info.data.get(maximum_field)
        if maximum is not None and value > maximum:
            raise ValueError(f"is above {maximum_field} ({maximum})")
        return value

    @field_validator("remote")
    @classmethod
    def _remote_needs_a_url(cls, remote: RemoteSettings, info: ValidationInfo) -> RemoteSettings:
        if info.data.get("backend") == "remote" and not remote.base_url:
            raise ValueError("backend 'remote' needs remote.base_url (MILES_SANDBOX_REMOTE__BASE_URL)")
        return remote
