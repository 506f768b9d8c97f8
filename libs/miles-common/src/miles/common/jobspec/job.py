"""The top-level job spec: what `POST /v1/jobs` accepts (JSON) and what `miles submit` reads (YAML).

`JobSpec` composes the model to train, the rollout section (`miles.common.jobspec.rollout`), the training recipe
(`miles.common.jobspec.trainer`), the weight transport and the resources of each per-job pool. The controller
validates a whole spec at submit time (a 422 names the field path and the reason) and hands each per-job process
its own section. No torch here, and nothing is imported from a dotted path: agents and rewards are imported by
the rollout workers only.

Limits: the spec says what a job needs, not where the shared services are (those come from the controller's
settings); `resources` counts are per job and only `engines.replicas` and `rollout_workers.replicas` may change
while a job runs (`PATCH /v1/jobs/{id}`).
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from miles.common.jobspec.evaluation import EvaluationSpec
from miles.common.jobspec.pools import InferencePoolSpec
from miles.common.jobspec.rollout import RolloutSpec
from miles.common.jobspec.trainer import TrainConfig

NODE_POOL_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
"""A node pool name is a DNS label (the chart's `nodePools` keys; also the name of a shared engine pool)."""


class _Section(BaseModel):
    """Base of every part of the job spec: unknown keys refused, field docstrings kept, immutable."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class ModelSpec(_Section):
    """The checkpoint the job starts from."""

    path: str = Field(min_length=1)
    """Hugging Face checkpoint directory (local backend: a path on this machine; Kubernetes: a path under the
    chart's model mount, or a Hub id for SGLang)."""

    family: str = Field(default="qwen3", min_length=1)
    """TITO model family (the session server's name for the chat template's boundary rules)."""

    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments of the chat template (e.g. `{"enable_thinking": false}`)."""


class EnginePoolSpec(_Section):
    """The job's engines: its own (a job that trains all its weights never shares them), or, for a LoRA job, a
    shared pool of its base model declared by the platform (each request names the job's adapter)."""

    shared_pool: str | None = Field(default=None, pattern=NODE_POOL_PATTERN)
    """Name of a shared engine pool (the controller's `shared_pools`, the chart's `sharedPools`) to run this LoRA
    job on instead of starting engines: same base model, `train.lora` rank and target modules within the pool's.
    The job then has no engines or weight-sync of its own, so the other engine fields must stay unset and the
    pool's size is the platform's (PATCH of `engines` answers 400)."""

    replicas: int = Field(default=1, ge=1, le=64)
    """Engine processes (local) or SGLang pods (Kubernetes); may change while the job runs."""

    kind: Literal["cpu", "sglang"] = "cpu"
    """`cpu`: the miles CPU engine (`miles-engine`); `sglang`: real SGLang pods (Kubernetes backend)."""

    gpus_per_replica: int = Field(default=0, ge=0, le=8)
    """`nvidia.com/gpu` per engine pod (0 for the CPU engine)."""

    tp_size: int = Field(default=1, ge=1, le=64)
    """Tensor-parallel size of one SGLang engine (`--tp-size`): all its ranks, on every node it spans."""

    nodes_per_replica: int = Field(default=1, ge=1, le=8)
    """Nodes one engine replica spans (Kubernetes, SGLang): above 1, each replica is a group of that many pods, one
    per node, each with `gpus_per_replica` GPUs and `tp_size / nodes_per_replica` of the tensor-parallel ranks
    (SGLang's `--nnodes` / `--node-rank` / `--dist-init-addr`), run as a LeaderWorkerSet whose group restarts
    together when one of its pods does; the release needs `leaderWorkerSet.enabled` (else a 400). `tp_size` must be
    a multiple of it. Only the group's first pod (the leader) serves HTTP and joins the router."""

    node_pool: str | None = Field(default=None, pattern=NODE_POOL_PATTERN)
    """Node pool of the engine pods and their weight-sync daemons (Kubernetes): one of the release's node pools (the
    chart's `nodePools`), whose nodeSelector, tolerations and affinity replace the chart's placement of this job's
    engines; a pool the release does not define is a 400. null: the chart's placement (`rollout` for SGLang, `cpu`
    for the CPU engine). The local backend ignores it."""

    extra_args: list[str] = Field(default_factory=list)
    """Arguments appended to the engine's command line."""

    @model_validator(mode="after")
    def _tp_fits_gpus(self) -> Self:
        nodes = self.nodes_per_replica
        if nodes > 1 and self.kind != "sglang":
            raise ValueError(f"nodes_per_replica ({nodes}) > 1 needs kind 'sglang' (the CPU engine runs on one node)")
        if self.tp_size % nodes:
            raise ValueError(
                f"tp_size ({self.tp_size}) must be a multiple of nodes_per_replica ({nodes}): every node of a "
                "replica runs the same number of tensor-parallel ranks"
            )
        ranks_per_pod = self.tp_size // nodes
        if self.kind == "sglang" and self.gpus_per_replica and ranks_per_pod > self.gpus_per_replica:
            raise ValueError(
                f"tp_size ({self.tp_size}) over nodes_per_replica ({nodes}) exceeds gpus_per_replica "
                f"({self.gpus_per_replica}): each tensor-parallel rank needs its own GPU"
            )
        return self


class RolloutWorkerPoolSpec(_Section):
    """The job's rollout workers (they run the agents and push scored groups to the buffer)."""

    replicas: int = Field(default=1, ge=1, le=256)
    """Rollout-worker processes or pods; may change while the job runs."""

    max_replicas: int | None = Field(default=None, ge=1, le=256)
    """Upper bound of the job's rollout-worker autoscaler (Kubernetes, with the chart's
    `jobTemplates.rolloutWorker.autoscaling.enabled`; `replicas` is its lower bound); at least `replicas`. null: the
    replicas (no room to scale). The local backend ignores it."""

    node_pool: str | None = Field(default=None, pattern=NODE_POOL_PATTERN)
    """Node pool of the rollout-worker pods (Kubernetes): one of the release's node pools (the chart's `nodePools`),
    whose placement replaces the chart's for this job's workers; a pool the release does not define is a 400. null:
    the chart's `jobTemplates.rolloutWorker.nodePool`. The local backend ignores it."""

    @model_validator(mode="after")
    def _max_covers_replicas(self) -> Self:
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be at least replicas ({self.replicas})")
        return self


class TrainerPoolSpec(_Section):
    """The job's trainer ranks."""

    replicas: int = Field(default=1, ge=1, le=1024)
    """Trainer ranks (StatefulSet pods on Kubernetes); fixed for the life of the job."""

    gpus_per_replica: int = Field(default=0, ge=0, le=8)
    """`nvidia.com/gpu` per trainer pod (0 trains on the CPU)."""

    node_pool: str | None = Field(default=None, pattern=NODE_POOL_PATTERN)
    """Node pool of the trainer pods (Kubernetes): one of the release's node pools (the chart's `nodePools`), whose
    placement replaces the chart's for this job's trainer; a pool the release does not define is a 400. null: the
    chart's `trainer` pool. The local backend ignores it."""

    backend: Literal["torch", "megatron"] = "torch"
    """Trainer backend: `torch` (FSDP2) or `megatron`."""


class ResourcesSpec(_Section):
    """Sizes and placement of the job's per-job pools."""

    engines: EnginePoolSpec = EnginePoolSpec()
    """The engine pool."""

    rollout_workers: RolloutWorkerPoolSpec = RolloutWorkerPoolSpec()
    """The rollout-worker pool."""

    trainer: TrainerPoolSpec = TrainerPoolSpec()
    """The trainer pool."""


class WeightSyncSpec(_Section):
    """How new weights travel from the trainer to the job's engines (the same on every backend)."""

    transport: Literal["stream", "nccl", "disk"] = "stream"
    """`stream`: each version goes from the trainer's memory to the job's weight-sync origin, which stores it as a
    lossless delta and rolls it out to the engines (the daemon next to each engine loads only the tensors that
    changed, prepared while the engine keeps serving). `nccl`: the trainer broadcasts each version into the
    engines (SGLang's /init_weights_update_group + /update_weights_from_distributed; NCCL on GPUs, gloo on the
    CPU). `disk`: an HF directory per version on a volume the trainer and the engines share, loaded with
    /update_weights_from_disk (debugging; local backend only). `delta` is accepted as a name of `stream`."""

    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype of the published weights (what the engines serve); the trainer keeps float32 master weights."""

    pause_mode: Literal["drain", "abort", "retract", "in_place"] | None = None
    """How an engine is quiesced for the swap to a new version: `drain` (the router sends it nothing new and its
    requests finish first), or /pause_generation `abort`, `retract` (requests resume on the new weights,
    recomputed) or `in_place` (they resume on the new weights with their old KV). null (the default): `in_place`
    on the miles CPU engine (`resources.engines.kind: cpu`), which reports the weights that sampled each token
    (`meta_info.miles_weight_version_spans`), so a turn an update carried across is recorded as spans of both
    versions and the engine never idles for an update (`make bench-async`: 2.95-3.04 samples/s against 2.61-2.70
    with drain); `drain` on SGLang engines, which report one version per call, so that every turn is one version's."""

    @field_validator("transport", mode="before")
    @classmethod
    def _delta_is_stream(cls, value: Any) -> Any:
        return "stream" if value == "delta" else value


class KueueSpec(_Section):
    """Admission of the job by Kueue (Kubernetes backend, on a release installed with `kueue.enabled`): the job's
    engines, rollout workers and trainer are admitted as one unit, wait QUEUED until then, and are suspended (back
    to QUEUED) when Kueue preempts them."""

    queue_name: str = Field(pattern=NODE_POOL_PATTERN)
    """The Kueue LocalQueue in the release's namespace that admits the job (a DNS label). The job's Workload gets
    no priority class (Kueue's default priority, 0): a priority needs the class's value, which this controller does
    not read."""


class JobSpec(_Section):
    """One training job as a user submits it."""

    name: str = Field(default="", max_length=63)
    """Display name (not unique; the controller assigns the job id)."""

    model: ModelSpec
    """The checkpoint to train."""

    rollout: RolloutSpec
    """Dataset, agent, reward, group size and rollout concurrency."""

    train: TrainConfig = Field(default_factory=TrainConfig, validate_default=True)
    """Algorithm and hyper-parameters; `train.num_steps` (>= 1) ends the job: it SUCCEEDS after that step."""

    weight_sync: WeightSyncSpec = WeightSyncSpec()
    """Weight transport from the trainer to the engines."""

    resources: ResourcesSpec = ResourcesSpec()
    """Per-job pool sizes and node pools."""

    inference_pools: list[InferencePoolSpec] = Field(default_factory=list, max_length=4)
    """Extra inference pools of the job (a judge, a teacher ...): engines of their own model, no weight updates,
    reached by name (`miles.common.jobspec.pools`). At most 4, names unique."""

    evaluation: EvaluationSpec | None = None
    """Held-out evaluation at every N-th weight version on the job's own engines (`miles.common.jobspec.evaluation`);
    null: none."""

    kueue: KueueSpec | None = None
    """Queue the job in Kueue and run it when Kueue admits it (Kubernetes backend only); null: run at once."""

    @field_validator("inference_pools")
    @classmethod
    def _unique_pool_names(cls, pools: list[InferencePoolSpec]) -> list[InferencePoolSpec]:
        names = [pool.name for pool in pools]
        if len(set(names)) != len(names):
            raise ValueError(f"inference pool names must be unique (got {names})")
        return pools

    @property
    def pause_mode(self) -> Literal["drain", "abort", "retract", "in_place"]:
        """weight_sync.pause_mode, with null resolved by the engine kind (see WeightSyncSpec.pause_mode)."""
        if self.weight_sync.pause_mode is not None:
            return self.weight_sync.pause_mode
        return "in_place" if self.resources.engines.kind == "cpu" else "drain"

    def inference_pool(self, name: str) -> InferencePoolSpec | None:
        return next((pool for pool in self.inference_pools if pool.name == name), None)

    @model_validator(mode="after")
    def _teacher_pool_declared(self) -> Self:
        distillation = self.train.distillation
        if distillation is not None and self.inference_pool(distillation.teacher_pool) is None:
            raise ValueError(
                f"train.distillation.teacher_pool {distillation.teacher_pool!r} is not one of the job's "
                f"inference_pools ({[pool.name for pool in self.inference_pools]})"
            )
        return self

    def placement_problems(self) -> list[tuple[str, str]]:
        """(field, why) of choices that are valid on their own but not on these resources (the controller answers
        400 at submission): LoRA trains on one torch-backend trainer replica; a shared engine pool serves only LoRA
        jobs and sizes itself; a critic (PPO's value head) is built by the torch backend only."""
        trainer_backend = self.resources.trainer.backend
        if self.train.critic is not None and trainer_backend != "torch":
            why = f"train.critic (PPO with a value head) needs the torch trainer backend; {trainer_backend} has none"
            return [("train.critic", why)]
        engines = self.resources.engines
        if engines.shared_pool is not None:
            if self.train.lora is None:
                why = "resources.engines.shared_pool serves LoRA adapters only: set train.lora, or drop shared_pool"
                return [("resources.engines.shared_pool", why)]
            own = sorted(engines.model_fields_set - {"shared_pool"})
            if own:
                why = f"resources.engines.{own[0]} describes the job's own engines; a job on a shared pool has none"
                return [(f"resources.engines.{own[0]}", why)]
        if self.train.lora is None:
            return []
        trainer = self.resources.trainer
        if trainer.backend != "torch":
            why = f"train.lora needs the torch trainer backend; the {trainer.backend} backend does not train LoRA"
            return [("train.lora", why)]
        if trainer.replicas > 1:
            why = f"train.lora trains on one trainer replica (multi-rank LoRA is not built); got {trainer.replicas}"
            return [("train.lora", why)]
        return []

    @field_validator("train")
    @classmethod
    def _job_has_an_end(cls, train: TrainConfig) -> TrainConfig:
        if train.num_steps < 1:
            raise ValueError(
                f"num_steps must be >= 1 for a job (got {train.num_steps}): the job succeeds after its last "
                "step, and 0 would train until cancelled"
            )
        return train
