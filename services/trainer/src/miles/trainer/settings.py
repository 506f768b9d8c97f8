"""Settings of the trainer (environment prefix MILES_TRAINER_), validated at start-up.

Process fields (where the data, model and checkpoints are; which backend; the rank layout) are top-level; the
training recipe is the nested `train` section (`miles.common.jobspec.trainer.TrainConfig`), e.g.
`MILES_TRAINER_TRAIN__LOSS__CLIP_HIGH=0.28` or `{"train": {"loss": {"clip_high": 0.28}}}` in the JSON file named
by `MILES_TRAINER_CONFIG_FILE` (written by the controller from the job spec).

Tokens (miles.common.auth) are top-level, so that their variables stay flat (`MILES_TRAINER_AUTH_TOKEN`,
`MILES_TRAINER_WEIGHTSYNC_AUTH_TOKEN`, `MILES_TRAINER_ENGINE_ADMIN_API_KEY`, `MILES_TRAINER_ENGINE_API_KEY`,
`MILES_TRAINER_ROUTER_ADMIN_TOKEN`):
the controller sets them in the environment (from the chart's Secret), never in the job spec's file. A trainer
bound to a non-loopback `host` refuses to start without `auth_token` (32+ characters).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, SecretStr, model_validator

from miles.common.auth import check_token_setting
from miles.common.contracts.adapters import VERSIONS_LOADED_PER_JOB
from miles.common.contracts.engine_control import PauseMode
from miles.common.jobspec.trainer import Section, TrainConfig
from miles.common.settings import ServiceSettings, service_config


class MegatronSettings(Section):
    """Megatron-core backend parallelism: world_size = tp_size x pp_size x data-parallel size; expert parallelism
    splits the experts over ep_size of the data-parallel ranks (backends/megatron_parallel.py)."""

    tp_size: int = Field(default=1, ge=1)
    """Tensor-parallel size: attention heads, MLP columns/rows and the (padded) vocabulary split over this many
    consecutive ranks. Must divide the attention heads, key/value heads and intermediate size (checked at start)."""

    pp_size: int = Field(default=1, ge=1)
    """Pipeline-parallel size: the layers split into this many stages (must divide num_hidden_layers), run by
    megatron-core's 1F1B schedule over the micro-batches of each minibatch; the loss is computed on the last."""

    ep_size: int = Field(default=1, ge=1)
    """Expert-parallel size (MoE models only): the experts of every MoE layer split over this many data-parallel
    ranks (must divide the expert count and the data-parallel size)."""


class PublishSettings(Section):
    """How each new weight version leaves the trainer (miles.trainer.publish; the controller writes this section
    from the job spec's weight_sync.transport)."""

    kind: Literal["stream", "nccl", "disk", "adapter", "none"] = "stream"
    """`stream`: to the job's weight-sync origin (`weightsync_address`), which stores it and rolls it out.
    `nccl`: broadcast straight into the job's engines (SGLang's update-group endpoints; gloo on the CPU).
    `disk`: an HF directory per version under `dir` (a volume the engines mount), then /update_weights_from_disk.
    `adapter`: a LoRA job on a shared engine pool: each version is a PEFT adapter directory under `dir`, loaded
    into every engine of `pool` as `<job_id>@<version>` (/load_lora_adapter), then made the job's live adapter
    at the session server (`session_url`); the base weights are never published.
    `none`: do not publish (tests, SFT)."""

    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype of published weights (the engines' serving dtype; the trainer keeps float32 master weights). A
    version's weights digest is computed over these bytes."""

    retry_timeout_s: float = Field(default=600.0, gt=0)
    """How long a publish that fails retryably (receiver restarting or unreachable) is retried before the trainer
    fails (and its restart resumes publishing from the checkpoint)."""

    weightsync_address: str = ""
    """stream: gRPC host:port of the job's weight-sync origin (on Kubernetes its Service)."""

    router_url: str = ""
    """nccl, disk: the rollout router; the job's engines are its pool `pool`, and `drain` goes through it."""

    pool: str = ""
    """nccl, disk: the router pool of the job's engines ("" = the job id)."""

    engine_urls: list[str] = Field(default_factory=list)
    """nccl, disk: engines updated besides the router pool's (base URLs, e.g. http://127.0.0.1:30000)."""

    pause_mode: PauseMode = "drain"
    """nccl, disk: how an engine is quiesced for its update (drain needs router_url; without a router, retract)."""

    max_engines_updating: int = Field(default=1, ge=1)
    """nccl, disk: engines updated at once, so generation never stops as a whole."""

    engine_timeout_s: float = Field(default=300.0, gt=0)
    """nccl, disk: limit of one engine's quiesce + load + resume, seconds (also the update group's timeout)."""

    nccl_master_address: str = ""
    """nccl: the address engines reach this trainer rank at for the update groups ("" = master_addr)."""

    nccl_master_port: int = Field(default=29600, ge=0, le=65535)
    """nccl: rendezvous port of the first engine's update group; each new group takes the next port. 0: each group
    takes a port free on this host when it is created (local backend)."""

    nccl_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """nccl: torch.distributed backend of the update groups; auto: nccl when CUDA is available, else gloo."""

    nccl_bucket_bytes: int = Field(default=512 << 20, ge=1 << 20)
    """nccl: most tensor bytes broadcast per /update_weights_from_distributed call."""

    dir: Path | None = None
    """disk: root of the published versions (`<dir>/weights-v000003/`); default `<checkpoint_dir>/published`."""

    keep_last: int = Field(default=3, ge=1)
    """disk, adapter: published versions kept on disk (an engine may still be loading an older one)."""

    session_url: str = ""
    """adapter: the session server, told each new live adapter version (PUT /v1/jobs/{job_id}/adapter)."""

    adapter_reconcile_interval_s: float = Field(default=5.0, gt=0)
    """adapter: how often the live version is loaded again where it is missing (an engine that joined the pool or
    restarted since the last publish; a load of a name already loaded is a no-op)."""

    adapters_loaded: int = Field(default=VERSIONS_LOADED_PER_JOB, ge=2)
    """adapter: versions of this job's adapter kept loaded on each engine (the live one and the one before,
    which requests sent just before the switch still name); older ones are unloaded, freeing their slots."""

    @property
    def resolved_nccl_backend(self) -> str:
        if self.nccl_backend != "auto":
            return self.nccl_backend
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"


class TrainerSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("TRAINER")

    port: int = 50052
    """gRPC listening port (control API: Status, Checkpoint, Stop, WatchEvents)."""

    metrics_port: int = 51052
    """HTTP port for /healthz, /readyz and /metrics."""

    job_id: str = ""
    """Job whose groups are trained; empty: the trainer serves its API but does not train (idle)."""

    buffer_address: str = "127.0.0.1:50051"
    """host:port of the buffer service."""

    model_path: Path | None = None
    """Hugging Face checkpoint directory (config.json + safetensors) of the initial policy and the reference."""

    checkpoint_dir: Path | None = None
    """Directory of this job's durable checkpoints; the trainer resumes from the newest one found here."""

    backend: Literal["torch", "megatron"] = "torch"
    """`torch`: miles.model (the engine's own model code), CPU or GPU, FSDP2 when world_size > 1. `megatron`:
    megatron-core GPTModel built from the HF config, laid out by `megatron` (TP, PP, DP, EP)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs; auto: CUDA when available."""

    initial_weight_version: int = Field(default=0, ge=0)
    """Weight version of the weights in model_path; each trainer step adds one."""

    consumer_id: str = ""
    """Buffer consumer id (stable across restarts so a restart can release its predecessor's leases); default
    `trainer-<job_id>`."""

    rank: int = Field(default_factory=lambda: int(os.environ.get("RANK", "0")), ge=0)
    """This process's rank (default: torchrun's RANK). Rank 0 serves the API, talks to the buffer and writes
    checkpoints; the others follow its commands."""

    world_size: int = Field(default_factory=lambda: int(os.environ.get("WORLD_SIZE", "1")), ge=1)
    """Number of trainer processes (default: torchrun's WORLD_SIZE)."""

    master_addr: str = Field(default_factory=lambda: os.environ.get("MASTER_ADDR", "127.0.0.1"))
    """Rendezvous address of torch.distributed (default: torchrun's MASTER_ADDR)."""

    master_port: int = Field(default_factory=lambda: int(os.environ.get("MASTER_PORT", "29500")), ge=1)
    """Rendezvous port of torch.distributed (default: torchrun's MASTER_PORT)."""

    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto: nccl on CUDA, gloo on the CPU."""

    peer_timeout_s: float = Field(default=60.0, gt=0)
    """world_size > 1: a rank whose heartbeat (through the rendezvous store, every min(1 s, timeout / 10)) has not
    moved for this long is taken as gone, and every other rank exits with status 75 so that all restart from the
    last checkpoint. A replaced rank or a failing one is noticed within about a second (rank_health.py)."""

    collective_timeout_s: float = Field(default=1800.0, gt=0)
    """world_size > 1: limit of one collective of a step (FSDP, statistics, gathering state for a publish or a
    checkpoint) on the default process group; NCCL's watchdog then aborts the process. Rank 0's operations reach
    the other ranks on a separate control group without this limit (they wait as long as rank 0 waits for data)."""

    checkpoint_format: Literal["full", "sharded"] = "full"
    """`full`: rank 0 gathers the whole model and optimizer state and writes them (works with a directory per
    rank). `sharded`: every rank writes its own shards with torch.distributed.checkpoint (no optimizer state is
    gathered anywhere), which needs one checkpoint_dir that every rank mounts. Either resumes at any world size;
    both keep the Hugging Face export of the weights in `model/` (checkpoint.py)."""

    num_threads: int = Field(default=0, ge=0)
    """torch intra-op threads (0: torch's default)."""

    train: TrainConfig = TrainConfig()
    """The training recipe (see miles.common.jobspec.trainer)."""

    publish: PublishSettings = PublishSettings()
    """Weight publishing."""

    megatron: MegatronSettings = MegatronSettings()
    """Megatron-core backend parallelism (tp_size, pp_size, ep_size; the rest of world_size is data-parallel)."""

    checkpoint_on_sigterm: bool = True
    """On SIGTERM, finish the current step and write a checkpoint before exiting (within the pod's grace
    period); otherwise uncommitted groups are handed back and retrained after the restart."""

    events_kept: int = Field(default=1000, ge=1)
    """Events kept in memory for WatchEvents replay."""

    # --- auth ---------------------------------------------------------------------------------------------------
    auth_token: SecretStr = SecretStr("")
    """Bearer token of the control API (every TrainerService method: Status, Checkpoint, Stop, WatchEvents), held
    by the controller. 32+ characters; required unless `host` is a loopback address. Probes and /metrics stay
    open."""

    weightsync_auth_token: SecretStr = SecretStr("")
    """publish.kind stream: sent as `authorization: Bearer <token>` with every call to the job's weight-sync origin
    (GetVersion, OpenPublishChannel, CommitPublish, PublishWeights): weight-sync's auth_token. "" = it is open."""

    engine_admin_api_key: SecretStr = SecretStr("")
    """publish.kind nccl, disk: sent as `Authorization: Bearer <key>` with every request to an engine (pause and
    continue, the weight loads and update groups, /update_weight_version, and /model_info unless engine_api_key is
    set): the engines' admin_api_key. "" = open engines."""

    engine_api_key: SecretStr = SecretStr("")
    """publish.kind nccl, disk: sent in place of engine_admin_api_key with the version reads (/model_info, an info
    route that SGLang opens to the api key alone): the engines' api_key, needed when they have one. "" = none."""

    session_operator_token: SecretStr = SecretStr("")
    """adapter publishing: bearer token of the session server's operator API ("" = open, loopback only)."""

    router_admin_token: SecretStr = SecretStr("")
    """publish.kind nccl, disk: sent as `Authorization: Bearer <token>` to the rollout router's admin API (listing
    the pool's engines, drain, undrain): the router's admin_token. "" = the router's admin API is open."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        check_token_setting(self.auth_token.get_secret_value(), host=self.host, field="auth_token")
        if self.job_id:
            if self.model_path is None:
                raise ValueError("model_path is required when job_id is set")
            if self.checkpoint_dir is None:
                raise ValueError("checkpoint_dir is required when job_id is set")
            if self.publish.kind == "stream" and not self.publish.weightsync_address:
                raise ValueError(
                    "publish.kind 'stream' needs publish.weightsync_address (the job's weight-sync origin)"
                )
            if self.publish.kind == "adapter" and not (self.publish.router_url or self.publish.engine_urls):
                raise ValueError("publish.kind 'adapter' needs publish.router_url or publish.engine_urls (the pool)")
            if self.publish.kind == "adapter" and not self.publish.session_url:
                raise ValueError("publish.kind 'adapter' needs publish.session_url (it makes each version live there)")
            if self.publish.kind == "nccl" and not (self.publish.router_url or self.publish.engine_urls):
                raise ValueError("publish.kind 'nccl' needs publish.router_url or publish.engine_urls (the engines)")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be < world_size {self.world_size}")
        self._check_parallel_layout()
        self._check_lora()
        problems = self.train.recipe_problems()
        if problems:
            raise ValueError("refused recipe: " + "; ".join(f"{field}: {why}" for field, why in problems))
        return self

    def _check_parallel_layout(self) -> None:
        """The model-independent part of the Megatron layout (backends/megatron_parallel.py checks the rest against
        the model at start-up: heads, layers, experts)."""
        sizes = self.megatron
        if self.backend != "megatron":
            if (sizes.tp_size, sizes.pp_size, sizes.ep_size) != (1, 1, 1):
                raise ValueError(
                    f"megatron.tp_size/pp_size/ep_size ({sizes.tp_size}/{sizes.pp_size}/{sizes.ep_size}) apply to "
                    f"the megatron backend only; the {self.backend} backend shards with FSDP2 over world_size"
                )
            return
        from miles.trainer.backends.megatron_parallel import ParallelSizes, check_world

        problems = check_world(ParallelSizes(sizes.tp_size, sizes.pp_size, sizes.ep_size), self.world_size)
        if problems:
            raise ValueError("megatron parallel layout: " + "; ".join(problems))

    def _check_lora(self) -> None:
        """LoRA (train.lora) is implemented by the torch backend, in one process, with `full` checkpoints (the
        adapter and its optimizer state only); the model-dependent checks (target names) run when it loads."""
        if self.train.lora is None:
            return
        if self.backend != "torch":
            raise ValueError(
                f"train.lora: LoRA is implemented by the torch backend only; the {self.backend} backend trains "
                "every weight (use backend 'torch' or remove train.lora)"
            )
        if self.world_size > 1:
            raise ValueError(f"train.lora: LoRA runs in a single trainer process (world_size is {self.world_size})")
        if self.checkpoint_format != "full":
            raise ValueError("train.lora: LoRA checkpoints hold the adapter only and need checkpoint_format 'full'")

    @property
    def resolved_consumer_id(self) -> str:
        return self.consumer_id or f"trainer-{self.job_id}"

    @property
    def resolved_publish_dir(self) -> Path:
        if self.publish.dir is not None:
            return self.publish.dir
        assert self.checkpoint_dir is not None
        return self.checkpoint_dir / "published"
