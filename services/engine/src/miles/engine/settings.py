"""Settings of the engine (environment prefix MILES_ENGINE_, or the same names as --flags), validated at start-up.

Field names follow SGLang's server arguments where one exists (model_path, served_model_name, context_length,
max_total_tokens, max_running_requests, weight_version ...), so an operator reads them the same way.

Key rule (SGLang's --api-key / --admin-api-key, see miles.engine.auth): `api_key` guards generation and info
routes, `admin_api_key` the control routes (weight updates, pause, abort, cache and memory control), which fall
back to `api_key` when no admin key is set. A key has 32+ characters. An engine bound to a non-loopback interface
refuses to start unless its control routes are guarded, i.e. unless `admin_api_key` or `api_key` is set; on
127.0.0.1 / ::1 / localhost it may run without keys (every route open to local callers: development only).
/health, /health_generate, /healthz, /readyz and /metrics never need a key.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, model_validator

from miles.common.auth import check_token_length, check_token_setting
from miles.common.settings import ServiceSettings, service_config
from miles.engine.adapters import SUPPORTED_TARGET_MODULES, AdapterLimits


class EngineSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("ENGINE")

    port: int = 30000
    """HTTP listening port."""

    model_path: Path
    """Hugging Face checkpoint directory: config.json, *.safetensors and the tokenizer files (tokenizer.json,
    tokenizer_config.json). With fake_model only config.json and the tokenizer are read."""

    tokenizer_path: Path | None = None
    """Directory of tokenizer.json / tokenizer_config.json when not in model_path."""

    served_model_name: str | None = None
    """Name reported by /v1/models, /model_info and the metrics' model_name label (default: model_path)."""

    context_length: int | None = Field(default=None, ge=2)
    """Longest sequence (prompt + output) in tokens (default: the config's max_position_embeddings)."""

    max_total_tokens: int = Field(default=65536, ge=16)
    """KV-cache capacity in tokens, shared by running requests and the radix prefix cache (LRU-evicted)."""

    max_running_requests: int = Field(default=256, ge=1)
    """Most requests decoded together in one batch."""

    max_prefill_tokens: int = Field(default=16384, ge=1)
    """Most uncached prompt tokens prefilled in one step (a longer single prompt still runs alone)."""

    enable_mixed_chunk: bool = True
    """SGLang's --enable-mixed-chunk (on by default here, off in SGLang): a step that prefills newly admitted
    sequences also decodes the next token of every running sequence, in the same forward. Off, a prefill is a
    forward of its own and every running sequence waits for it; in a multi-turn agent job each turn starts with a
    short prefill, so every new turn of one episode stalls the decoding of all others for a forward
    (`make bench-async`: inter-token latency 36.5 ms off, 31.5 ms on, at a 25 ms forward)."""

    weight_version: str = "default"
    """Weight version reported before the first update (SGLang's --weight-version)."""

    deterministic: bool = False
    """Shape-invariant computation: a sequence gets bit-identical logprobs whatever it is batched with and
    whether it is decoded incrementally or scored in one prefill (slower; see miles.model.kernels)."""

    disable_radix_cache: bool = False
    """Never reuse cached prefixes (cached_tokens is then always 0)."""

    enable_return_routed_experts: bool = False
    """SGLang's --enable-return-routed-experts (MoE routing replay, R3): a /generate with `return_routed_experts`
    gets, in its final meta_info, the experts every token was routed to (`routed_experts`). Off: such requests are
    served without them, as SGLang serves them. On with a model that has no MoE layers: the engine refuses to
    start."""

    device: str = Field(default="cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$")
    """Where the model, its KV cache, sampling and weight updates live: `cpu`, `cuda` (the current CUDA device) or
    `cuda:N`. A CUDA device that torch cannot see (no CUDA build, no GPU, N out of range) stops the start-up with
    an error. Responses (token ids, logprobs, routed experts) are computed there and returned through the CPU.
    With `deterministic` on CUDA the engine also sets CUBLAS_WORKSPACE_CONFIG (if unset) and
    torch.use_deterministic_algorithms (miles.engine.device)."""

    num_threads: int = Field(default=0, ge=0)
    """torch intra-op threads for the fast path (0: torch's default)."""

    fake_model: bool = False
    """Replace the transformer by a cheap deterministic sampler over the tokenizer's vocabulary (same protocol,
    scheduler and radix-cache accounting; torch is never imported). For load tests of the layers above."""

    fake_prefill_token_cost_s: float = Field(default=0.0, ge=0.0)
    """fake_model: seconds spent per prompt token that is not served from the cache."""

    fake_decode_token_cost_s: float = Field(default=0.0, ge=0.0)
    """fake_model: seconds spent per generated token (a decode step of 8 requests costs 8 times this)."""

    fake_forward_cost_s: float = Field(default=0.0, ge=0.0)
    """fake_model: seconds spent per forward (one scheduler step), whatever its batch. A GPU decode step is
    memory-bound, so its time barely grows with the batch: this cost models that (a lone long-tail request then
    keeps the engine as busy as a full batch), the per-token costs model the compute-bound part."""

    fake_eos_probability: float = Field(default=0.0, ge=0.0, le=1.0)
    """fake_model: chance that a sampled token is the end-of-sequence token."""

    health_generate_timeout_s: float = Field(default=20.0, gt=0.0)
    """/health_generate answers 503 when its one-token generation takes longer than this."""

    weight_update_group_timeout_s: float = Field(default=600.0, gt=0.0)
    """How long /init_weights_update_group waits for every rank to join, and each broadcast of
    /update_weights_from_distributed for the trainer to send (then the call answers 400)."""

    enable_lora: bool = False
    """SGLang's --enable-lora: serve LoRA adapters of the base model (/load_lora_adapter, /unload_lora_adapter,
    /generate's `lora_path`). Set by lora_paths too. Needs the real model. Each loaded adapter holds a merged copy
    of every weight it targets (miles.engine.lora): memory grows with every adapter loaded."""

    lora_paths: list[str] = []
    """SGLang's --lora-paths: adapters loaded at start, each `NAME=PATH` or `PATH` (then named by its path)."""

    max_loras_per_batch: int = Field(default=8, ge=1)
    """SGLang's --max-loras-per-batch: distinct adapters in one forward step (sequences of other adapters wait)."""

    max_loaded_loras: int | None = Field(default=None, ge=1)
    """SGLang's --max-loaded-loras: adapters resident at once (default: max_loras_per_batch, since every loaded
    adapter is resident here). At least max_loras_per_batch. Loading another while that many are loaded is a 400;
    while some of them are only unloading (their requests still running), the load waits for them."""

    max_lora_rank: int | None = Field(default=None, ge=1)
    """SGLang's --max-lora-rank: adapters of a higher rank `r` are refused (default: any rank)."""

    lora_target_modules: list[str] | None = None
    """SGLang's --lora-target-modules: the modules adapters may target, among q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj, or `all` (default: all of them)."""

    api_key: SecretStr = SecretStr("")
    """Bearer token of the generation and info routes (SGLang's --api-key), and of the control routes too when
    admin_api_key is empty; "" = generation and info routes are open."""

    admin_api_key: SecretStr = SecretStr("")
    """Bearer token of the control routes (SGLang's --admin-api-key), held by weight-sync and the trainer; "" = they
    take api_key instead. One of the two is required unless `host` is a loopback address."""

    @model_validator(mode="after")
    def _check_device(self) -> EngineSettings:
        if self.fake_model and self.device != "cpu":
            # The fake sampler computes nothing: a GPU setting would be silently ignored.
            raise ValueError(f"device {self.device!r} needs the real model: fake_model runs on the CPU only")
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> EngineSettings:
        if self.lora_paths:
            self.enable_lora = True  # as SGLang: --lora-paths implies --enable-lora
        if self.enable_lora and self.fake_model:
            raise ValueError("enable_lora needs the real model: fake_model has no weights to apply adapters to")
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError("max_loaded_loras must be at least max_loras_per_batch")
        unknown = set(self.lora_target_modules or ()) - {"all", *SUPPORTED_TARGET_MODULES}
        if unknown:
            raise ValueError(f"lora_target_modules {sorted(unknown)} are not supported: {SUPPORTED_TARGET_MODULES}")
        return self

    @property
    def effective_max_loaded_loras(self) -> int:
        """max_loaded_loras, or its default max_loras_per_batch."""
        return self.max_loaded_loras or self.max_loras_per_batch

    @property
    def lora_limits(self) -> AdapterLimits:
        targets = self.lora_target_modules
        if not targets or "all" in targets:
            return AdapterLimits(self.max_lora_rank)
        return AdapterLimits(self.max_lora_rank, frozenset(targets))

    @model_validator(mode="after")
    def _check_keys(self) -> EngineSettings:
        api_key = self.api_key.get_secret_value()
        admin_key = self.admin_api_key.get_secret_value()
        check_token_length(api_key, field="api_key")  # "" is allowed: it leaves the generation routes open
        # The key the control routes really need: SGLang falls back to the api key when no admin key is set.
        check_token_setting(admin_key or api_key, host=self.host, field="admin_api_key (or api_key)")
        return self

    @property
    def resolved_tokenizer_path(self) -> Path:
        return self.tokenizer_path or self.model_path

    @property
    def resolved_served_model_name(self) -> str:
        return self.served_model_name or str(self.model_path)
