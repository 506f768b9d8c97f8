"""Settings of the rollout-router (environment prefix MILES_ROUTER_), validated at start-up.

Complex fields (lists, dicts) are read from the environment as JSON, e.g.
`MILES_ROUTER_STATIC_ENGINES='{"job-a": ["http://10.0.0.5:30000"]}'`.

Admin token rule (miles.common.auth): a router bound to a non-loopback interface refuses to start without an
`admin_token` (32+ characters). On 127.0.0.1 / ::1 / localhost it may run without one; the admin API (HTTP
/admin/v1/* and gRPC RouterAdminService) is then open to local callers, which is meant for development only. The
data plane and the probes never need a token.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator

from miles.common.auth import check_token_setting
from miles.common.settings import ServiceSettings, service_config

PolicyName = Literal["session_affinity", "cache_aware", "least_load", "round_robin"]
NewKeyPlacement = Literal["least_load", "prefix", "hash"]


class RouterSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("ROUTER")

    port: int = 8082
    """HTTP listening port: data plane (/generate, /v1/chat/completions, /v1/completions), /admin/v1/*, probes."""

    admin_grpc_port: int = 8083
    """gRPC port of RouterAdminService (miles.router.v1); 0 picks a free port, -1 disables the gRPC server (the HTTP
    mirror under /admin/v1/ stays)."""

    # --- auth ---------------------------------------------------------------------------------------------------
    admin_token: SecretStr = SecretStr("")
    """Bearer token of the admin API (HTTP /admin/v1/* and gRPC RouterAdminService), held by the platform's callers
    (controller, weight-sync). 32+ characters; required unless `host` is a loopback address."""

    engine_api_key: SecretStr = SecretStr("")
    """Sent as `Authorization: Bearer <key>` with every request to an engine (generation and probes), replacing
    the client's own header: the engines' api key (SGLang --api-key, miles-engine api_key). "" = engines are
    open."""

    # --- pools and engines -------------------------------------------------------------------------------------
    default_pool: str = Field(default="default", min_length=1)
    """Pool a data-plane request goes to when it carries no X-Miles-Pool header."""

    engine_urls: list[str] = []
    """Engine base URLs registered at start-up in the default pool (JSON list)."""

    static_engines: dict[str, list[str]] = {}
    """Engines registered at start-up per pool: {"pool": ["http://host:port", ...]} (JSON)."""

    # --- routing policy ----------------------------------------------------------------------------------------
    policy: PolicyName = "session_affinity"
    """Routing policy of every pool: session_affinity (sticky routing key), cache_aware (SGLang router's prefix
    tree algorithm over token ids), least_load or round_robin."""

    pool_policies: dict[str, PolicyName] = {}
    """Per-pool override of `policy`: {"pool": "cache_aware"} (JSON)."""

    new_key_placement: NewKeyPlacement = "prefix"
    """session_affinity: where a routing key seen for the first time (or a request without key) goes: prefix
    (cache_aware rules among the engines below their bounded-load share: the longest cached prefix, e.g. a sibling
    episode of the same GRPO prompt, else the least-loaded; best hit rate in make bench-router), least_load
    (least-loaded engine, then fewest sticky sessions) or hash (consistent hashing with bounded load; the same
    answer on every router replica)."""

    sticky_max_keys: int = Field(default=1_000_000, ge=1)
    """session_affinity: routing keys remembered per pool; the least recently used is forgotten beyond this."""

    sticky_idle_s: float = Field(default=4 * 3600.0, gt=0)
    """session_affinity: a routing key unused this long is forgotten (its next request is placed as new)."""

    hash_vnodes_per_engine: int = Field(default=150, ge=1)
    """Virtual nodes per engine on the consistent-hash ring (SGLang router: 150)."""

    hash_load_factor: float = Field(default=1.25, ge=1.0)
    """Bounded-load consistent hashing: an engine takes a re-homed or hashed key only while its load is below
    ceil(factor * (total load + 1) / engines); otherwise the ring walk continues."""

    cache_threshold: float = Field(default=0.3, ge=0.0, le=1.0)
    """cache_aware: the longest-prefix engine is chosen only when matched / prompt length is above this
    (SGLang router default 0.3)."""

    balance_abs_threshold: int = Field(default=64, ge=0)
    """cache_aware: load is imbalanced when max - min load exceeds this (requests) ... (SGLang default 64). Also
    caps the spill margin: the prefix holder is skipped when its load exceeds the mean by min(this, max(4,
    2 * sqrt(mean))) and the mean * balance_rel_threshold."""

    balance_rel_threshold: float = Field(default=1.5, ge=1.0)
    """cache_aware: ... and max load exceeds min load * this (SGLang default 1.5); then the least-loaded engine
    is chosen regardless of prefix. Also the relative part of the spill gate."""

    cache_tree_max_tokens_per_engine: int = Field(default=1_048_576, ge=1)
    """Prefix tree budget per engine (tokens; characters for text prompts) when the engine does not report its
    KV capacity (server_info max_total_num_tokens); least recently used leaves are evicted beyond it."""

    learn_from_outputs: bool = True
    """cache_aware / prefix placement: after a /generate response, also record prompt + output ids (what the
    engine now caches) in the prefix tree, so the next turn of a conversation matches in full."""

    # --- per-engine admission -----------------------------------------------------------------------------------
    engine_max_concurrency: int = Field(default=64, ge=1)
    """Concurrent requests sent to one engine when neither RegisterEngine nor the engine (server_info
    max_running_requests) says otherwise; more wait in the engine's queue."""

    engine_max_queue: int = Field(default=512, ge=0)
    """Requests that may wait in one engine's queue; when every available engine's queue is full the router
    answers 429 with Retry-After."""

    queue_timeout_s: float = Field(default=60.0, gt=0)
    """Longest a request waits in an engine's queue before it is answered 429."""

    backpressure_retry_after_s: float = Field(default=1.0, gt=0)
    """Retry-After sent with 429 backpressure answers, seconds."""

    transient_hold_s: float = Field(default=30.0, ge=0)
    """Longest a request waits, when no engine of its pool is available only because some are drained (for a weight
    update) or joining (waiting for the pool's version), for one to come back, before 503 no_routable_engine;
    0 answers at once. Unhealthy, paused or circuit-open engines are not waited for."""

    # --- forwarding, retries ------------------------------------------------------------------------------------
    request_timeout_s: float = Field(default=1800.0, gt=0)
    """Longest wait for an engine's response headers or for the next body chunk, seconds."""

    connect_timeout_s: float = Field(default=5.0, gt=0)
    """TCP connect timeout to an engine, seconds."""

    max_attempts: int = Field(default=5, ge=1)
    """Attempts per request (1 = no retry). A retry re-selects an engine, excluding those that failed, and happens
    only before any response byte reached the client."""

    retry_on_status: list[int] = [408, 429, 500, 502, 503, 504]
    """Engine statuses that trigger a retry on another engine (connection errors always do)."""

    retry_backoff_initial_s: float = Field(default=0.05, ge=0)
    """Pause before the first retry; multiplied by retry_backoff_multiplier per retry, ±20 % jitter."""

    retry_backoff_multiplier: float = Field(default=1.5, ge=1.0)
    """Growth of the pause between retries."""

    retry_backoff_max_s: float = Field(default=2.0, ge=0)
    """Longest pause between retries."""

    max_connections: int = Field(default=4096, ge=1)
    """Open HTTP connections to one engine (each engine has its own connection pool)."""

    # --- health, circuit breaker, versions ----------------------------------------------------------------------
    health_check_path: str = "/health"
    """Engine path probed for health (200 = healthy)."""

    health_check_interval_s: float = Field(default=5.0, gt=0)
    """Seconds between health probes of one engine."""

    health_check_timeout_s: float = Field(default=5.0, gt=0)
    """Timeout of one health probe, seconds."""

    health_failure_threshold: int = Field(default=3, ge=1)
    """Consecutive failed probes (or data-plane connection errors) that mark an engine unhealthy."""

    health_success_threshold: int = Field(default=2, ge=1)
    """Consecutive successful probes that mark an unhealthy engine healthy again."""

    circuit_failure_threshold: int = Field(default=5, ge=1)
    """Consecutive failed requests (5xx, broken connection or stream) that open an engine's circuit breaker."""

    circuit_success_threshold: int = Field(default=2, ge=1)
    """Successful trial requests in half-open state that close the breaker again."""

    circuit_open_s: float = Field(default=30.0, gt=0)
    """Seconds an open breaker keeps requests away before letting trial requests through (half-open)."""

    serving_check_path: str = "/health_generate"
    """Engine path that generates one token (SGLang /health_generate: 503, or no answer within
    health_check_timeout_s, while generation is paused or a weight load runs). A paused SGLang engine still
    answers /health and holds new requests instead of refusing them, so an engine whose check fails is marked
    paused and gets no requests until a check passes. Checked at registration and at undrain of a paused engine
    (one failure pauses), every serving_check_interval_s while it serves (health_failure_threshold consecutive
    failures pause), every health_check_interval_s while paused (one success ends it). An engine that answers
    404/405 has no such route and is never marked paused. "" = off."""

    serving_check_interval_s: float = Field(default=30.0, gt=0)
    """Seconds between generation checks (serving_check_path) of an engine that serves; draining engines are not
    checked (their caller undrains them once they serve)."""

    version_poll_interval_s: float = Field(default=2.0, gt=0)
    """Seconds between reads of an engine's weight_version (/model_info, /get_model_info, /server_info)."""

    drain_timeout_s: float = Field(default=60.0, gt=0)
    """DrainEngine wait limit when the request gives none, seconds (weight-sync and the controller pass their
    own). A drain that times out answers drained=false; the engine stays draining."""

    # --- Kubernetes discovery -----------------------------------------------------------------------------------
    k8s_discovery: bool = False
    """Watch EndpointSlices of engine Services and register their ready endpoints (per pool)."""

    k8s_namespace: str = ""
    """Namespace whose EndpointSlices are watched; "" = every namespace."""

    k8s_label_selector: str = "app.kubernetes.io/component=engine"
    """Label selector of the engine Services' EndpointSlices (Service labels are copied onto their slices)."""

    k8s_pool_label: str = "miles.dev/pool"
    """EndpointSlice label naming the pool of its engines; slices without it use their Service's name."""

    k8s_port_name: str = "http"
    """Name of the EndpointSlice port the engines serve HTTP on (the first port when no port has this name)."""

    k8s_scheme: Literal["http", "https"] = "http"
    """Scheme of discovered engine URLs."""

    k8s_api_url: str | None = None
    """Kubernetes API server URL without authentication (tests, kubectl proxy); unset = in-cluster config, else
    the local kubeconfig."""

    k8s_watch_timeout_s: int = Field(default=300, ge=1)
    """Server-side timeout of one watch call before it is renewed, seconds."""

    @model_validator(mode="after")
    def _check_admin_token(self) -> RouterSettings:
        check_token_setting(self.admin_token.get_secret_value(), host=self.host, field="admin_token")
        return self

    @model_validator(mode="after")
    def _check_pools(self) -> RouterSettings:
        for name in (*self.static_engines, *self.pool_policies):
            if not name:
                raise ValueError("pool names must not be empty")
        return self

    def policy_for(self, pool: str) -> PolicyName:
        """The routing policy of one pool."""
        return self.pool_policies.get(pool, self.policy)

    def startup_engines(self) -> dict[str, list[str]]:
        """Every statically configured engine by pool (engine_urls land in the default pool)."""
        engines = {pool: list(urls) for pool, urls in self.static_engines.items()}
        if self.engine_urls:
            engines.setdefault(self.default_pool, []).extend(self.engine_urls)
        return engines
