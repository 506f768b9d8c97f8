"""Settings of weight-sync (environment prefix MILES_WEIGHTSYNC_, or the JSON file named by
MILES_WEIGHTSYNC_CONFIG_FILE), validated at start-up. Per-job daemons get their part of the job spec that way.

Token rule (miles.common.auth): a daemon bound to a non-loopback `host` refuses to start without an `auth_token`
(32+ characters); on 127.0.0.1 / ::1 / localhost it may run without one (development). The tokens it sends to the
router and the engines come from the controller like its own (environment, from the chart's Secret), never from
the job spec.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator

from miles.common.auth import check_token_setting
from miles.common.contracts.engine_control import PauseMode
from miles.common.settings import ServiceSettings, service_config

TransportName = Literal["disk", "delta", "stream"]


class WeightsyncSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("WEIGHTSYNC")

    port: int = 50053
    """gRPC listening port (WeightSyncService)."""

    metrics_port: int = 51053
    """HTTP port for /healthz, /readyz and /metrics."""

    job_id: str = Field(default="default", min_length=1)
    """Job whose weight versions this daemon stores and rolls out; calls naming another job are NOT_FOUND."""

    store_dir: str = ".miles/weightsync/store"
    """Local directory of the version store (the chart mounts a volume here); used when store_url is empty."""

    store_url: str = ""
    """fsspec URL of the version store (e.g. s3://bucket/prefix, gs://..., file:///shared/pvc, memory://x);
    overrides store_dir. Daemons that open the same URL share one store."""

    snapshot_interval: int = Field(default=10, ge=1)
    """A full snapshot every this many versions (version 0 always); lossless deltas against the parent between."""

    retain_versions: int = Field(default=20, ge=1)
    """Newest versions kept readable; older ones are deleted once no kept version's delta chain needs them."""

    zstd_level: int = Field(default=1, ge=1, le=19)
    """zstd level of stored blobs (1 is fast and already removes the zeros of a sparse delta)."""

    engine_urls: list[str] = []
    """Engines this daemon loads itself (JSON list): a sidecar's own engine (http://127.0.0.1:<port>) or the
    engines of a rollout node."""

    peers: list[str] = []
    """gRPC addresses (host:port) of the other daemons of the job whose engines this daemon coordinates in a
    rolling update (set on the origin only)."""

    peers_dns: str = ""
    """"name:port" resolved to every address at each rollout (a headless Service of the sidecars) and added to
    peers; this daemon's own addresses are skipped."""

    origin: str = ""
    """gRPC address of the origin daemon (the one the trainer publishes to). Versions missing from this daemon's
    store are fetched from it (FetchStoredVersion) and full loads stream from it (FetchWeights). "" = this daemon
    is the origin, or shares the origin's store."""

    router_url: str = ""
    """Base URL of the rollout router (its admin API under /admin/v1/); "" = no router (pause modes only)."""

    pool: str = ""
    """Router pool of the job's engines ("" = the router's default pool)."""

    transport: TransportName = "delta"
    """Default transport of UpdateEngines and automatic rollouts: disk, delta or stream."""

    pause_mode: PauseMode = "drain"
    """Default way to quiesce an engine: drain (at the router, waiting for in-flight requests), or
    /pause_generation with abort, retract or in_place."""

    max_engines_updating: int = Field(default=1, ge=1)
    """Default bound on engines updating at once, so generation never stops as a whole."""

    engine_timeout_s: float = Field(default=600.0, gt=0)
    """Default limit for one engine's prepare + quiesce + load + resume, seconds (sized for loading big weights;
    the waits on other parties inside it have their own, shorter bounds: drain_timeout_s, control_timeout_s)."""

    drain_timeout_s: float = Field(default=60.0, gt=0)
    """pause_mode drain: longest wait at the router for the engine's in-flight requests to finish, seconds. After
    it the engine is paused with abort (those requests end with finish_reason abort) and the update goes on, so
    requests that cannot finish cannot hold an update for engine_timeout_s. No wait at all when this daemon left
    the engine paused (a failed update): the requests that pause holds cannot finish before the resume."""

    control_timeout_s: float = Field(default=30.0, gt=0)
    """HTTP timeout of the calls that only wait on another party's bookkeeping, seconds: an engine's
    /pause_generation, /continue_generation, /update_weight_version and /model_info, and each router admin call
    (a waiting drain gets drain_timeout_s on top). Capped by engine_request_timeout_s."""

    peer_timeout_s: float = Field(default=30.0, gt=0)
    """Deadline of a GetVersion call to a peer daemon (it reads its engines' versions), seconds; an UpdateEngines
    call to a peer gets the engine timeout plus this (the peer bounds its update by the engine timeout itself).
    A peer that does not answer in time is reported as failed, like an unreachable one."""

    auto_update: bool = True
    """Roll every stored version out to the engines right after PublishWeights (newest wins when they queue up)."""

    reconcile_interval_s: float = Field(default=5.0, ge=0)
    """On the origin with auto_update: every this many seconds, engines behind the latest stored version (an engine
    that restarted, joined in a resize, or whose update failed) get it, with a per-engine backoff after failures
    (doubling up to reconcile_max_backoff_s). 0 disables."""

    reconcile_max_backoff_s: float = Field(default=60.0, gt=0)
    """Longest wait before retrying an engine whose catch-up failed, seconds."""

    work_dir: str = ".miles/weightsync/work"
    """Scratch directory for the HF checkpoints the disk transport writes; the engine must see the same path."""

    model_config_dir: str = ""
    """HF checkpoint directory the job started from: its config.json and generation_config.json are copied next
    to the weights the disk transport writes (required for the disk transport)."""

    chunk_bytes: int = Field(default=1 << 20, ge=4096, le=64 << 20)
    """Bytes per message of FetchWeights / FetchStoredVersion when the caller does not say."""

    fetch_streams: int = Field(default=4, ge=1, le=64)
    """Concurrent data channel connections (or FetchWeights streams, when falling back) a daemon opens to the
    origin for one full load (tensors split between them)."""

    data_channel: bool = True
    """Move full loads (the stream transport, full loads and fallbacks of daemons with an origin) over a one-shot
    raw TCP data channel negotiated over gRPC (OpenDataChannel), and take the trainer's publishes over one
    (OpenPublishChannel); the origin serves both on data_port. false = gRPC only (FetchWeights, PublishWeights).
    A receiver falls back to FetchWeights, the trainer to PublishWeights, when the channel cannot be set up."""

    data_port: int = Field(default=0, ge=0, le=65535)
    """TCP port of the origin's data channel listener, bound on `host` (0 = an ephemeral port, announced in each
    offer). In Kubernetes set a fixed port that Services and NetworkPolicies let through."""

    data_host: str = ""
    """Host the origin tells receivers to connect to for the data channel ("" = the host they reached its gRPC
    port at)."""

    data_timeout_s: float = Field(default=60.0, gt=0)
    """Seconds an offered data channel waits for its connections, the longest a data connection may stall
    (sending or receiving) before the transfer fails, and how long a received publish waits for CommitPublish."""

    tensor_batch_bytes: int = Field(default=256 << 20, ge=1 << 20)
    """Most raw tensor bytes in one /update_weights_from_tensor request (bigger loads are split)."""

    max_publish_bytes: int = Field(default=256 << 30, ge=1)
    """Largest version accepted by PublishWeights (raw bytes); it is held in memory until committed."""

    engine_request_timeout_s: float = Field(default=600.0, gt=0)
    """HTTP timeout of one weight-load call to an engine (/update_weights_from_*, staging, the NCCL group calls),
    seconds: loads can take long on big models. Control and router calls use control_timeout_s."""

    event_history: int = Field(default=1000, ge=1)
    """Version events remembered for WatchVersions replays."""

    # --- auth ---------------------------------------------------------------------------------------------------
    auth_token: SecretStr = SecretStr("")
    """Bearer token of every WeightSyncService method (PublishWeights, UpdateEngines, GetVersion, WatchVersions,
    FetchWeights, the channel negotiations ...): the job's trainer, controller and other daemons send it, and this
    daemon sends it to its origin and peers (one token per job). 32+ characters; required unless `host` is a
    loopback address. The probes and /metrics stay open; data channel connections carry their per-offer tokens."""

    router_admin_token: SecretStr = SecretStr("")
    """Sent as `Authorization: Bearer <token>` to the rollout router's admin API (drain, undrain, list engines):
    the router's admin_token. "" = the router's admin API is open (loopback development)."""

    engine_admin_api_key: SecretStr = SecretStr("")
    """Sent as `Authorization: Bearer <key>` with every request to an engine (pause/continue, weight loads,
    /update_weight_version, the update-group calls, and /model_info unless engine_api_key is set): the engines'
    admin_api_key. "" = open engines."""

    engine_api_key: SecretStr = SecretStr("")
    """Sent in place of engine_admin_api_key with the version reads (/model_info, an info route): the engines'
    api_key (SGLang --api-key), needed when they have one, since SGLang opens info routes to that key alone. "" =
    the engines have none (their info routes are open)."""

    @model_validator(mode="after")
    def _check_combinations(self) -> WeightsyncSettings:
        check_token_setting(self.auth_token.get_secret_value(), host=self.host, field="auth_token")
        if self.pause_mode == "drain" and not self.router_url and (self.engine_urls or self.peers or self.peers_dns):
            raise ValueError("pause_mode 'drain' needs router_url (or choose abort, retract or in_place)")
        if self.transport == "disk" and not self.model_config_dir:
            raise ValueError("transport 'disk' needs model_config_dir (the config.json written next to the weights)")
        return self
