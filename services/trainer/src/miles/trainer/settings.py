"""Settings of the trainer (environment prefix MILES_TRAINER_), validated at start-up.

Process fields (where the data, model and checkpoints are; which backend; the rank layout) are top-level; the
training recipe is the nested `train` section (`miles.common.jobspec.trainer.TrainConfig`), e.g.
`MILES_TRAINER_TRAIN__LOSS__CLIP_HIGH=0.28` or `{"train": {"loss": {"clip_high": 0.28}}}` in the JSON file named
by `MILES_TRAINER_CONFIG_FILE` (written by the controller from the job spec).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, model_validator

from miles.common.jobspec.trainer import Section, TrainConfig
from miles.common.settings import ServiceSettings, service_config


class MegatronSettings(Section):
    """Megatron-core backend parallelism (passed to parallel_state and the TransformerConfig)."""

    tensor_model_parallel_size: int = Field(default=1, ge=1)
    """Tensor-parallel size passed to megatron's parallel_state and TransformerConfig. This build drives only 1
    (no multi-rank Megatron driver or sharded weight mapping yet): other values are refused at start-up."""

    pipeline_model_parallel_size: int = Field(default=1, ge=1)
    """Pipeline-parallel size, passed like the tensor-parallel size; only 1 in this build (the step calls the
    model directly, not Megatron's pipeline schedules)."""


class PublishSettings(Section):
    """Where new weights go after each step (until weight-sync takes over: a directory per version)."""

    kind: Literal["disk", "none"] = "disk"
    """`disk`: an HF safetensors directory per version under `dir`, then optionally /update_weights_from_disk on
    each engine URL. `none`: do not publish (tests, SFT)."""

    dir: Path | None = None
    """Root of the published versions (`<dir>/weights-v000003/`); default `<checkpoint_dir>/published`."""

    engine_urls: list[str] = Field(default_factory=list)
    """Engine base URLs (http://host:port) told to load each new version with /update_weights_from_disk."""

    interval_steps: int = Field(default=1, ge=1)
    """Publish every this many steps (and the start-up version)."""

    keep_last: int = Field(default=3, ge=1)
    """Published versions kept on disk (an engine may still be loading an older one)."""

    engine_timeout_s: float = Field(default=120.0, gt=0)
    """Timeout of one engine's /update_weights_from_disk call."""


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
    megatron-core GPTModel built from the HF config (world_size 1 on the CPU in this build)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs; auto: CUDA when available."""

    initial_weight_version: int = Field(default=0, ge=0)
    """Weight version of the weights in model_path; each optimizer step adds one."""

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

    num_threads: int = Field(default=0, ge=0)
    """torch intra-op threads (0: torch's default)."""

    train: TrainConfig = TrainConfig()
    """The training recipe (see miles.common.jobspec.trainer)."""

    publish: PublishSettings = PublishSettings()
    """Weight publishing."""

    megatron: MegatronSettings = MegatronSettings()
    """Megatron-core backend parallelism."""

    checkpoint_on_sigterm: bool = True
    """On SIGTERM, finish the current step and write a checkpoint before exiting (within the pod's grace
    period); otherwise uncommitted groups are handed back and retrained after the restart."""

    test_crash_before_ack_at_step: int = Field(default=0, ge=0)
    """Fault injection for tests only: exit abruptly (like kill -9) right after the checkpoint of this step is
    durable and before its groups are acked; 0 (the default) disables."""

    events_kept: int = Field(default=1000, ge=1)
    """Events kept in memory for WatchEvents replay."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.job_id:
            if self.model_path is None:
                raise ValueError("model_path is required when job_id is set")
            if self.checkpoint_dir is None:
                raise ValueError("checkpoint_dir is required when job_id is set")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be < world_size {self.world_size}")
        return self

    @property
    def resolved_consumer_id(self) -> str:
        return self.consumer_id or f"trainer-{self.job_id}"

    @property
    def resolved_publish_dir(self) -> Path:
        if self.publish.dir is not None:
            return self.publish.dir
        assert self.checkpoint_dir is not None
        return self.checkpoint_dir / "published"
