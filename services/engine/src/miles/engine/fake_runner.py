"""`--fake-model`: a deterministic stand-in for the transformer, for load tests and benchmarks of the layers above.

Everything around it is real (protocol, scheduler, continuous batching, radix-cache accounting with token budget,
LRU eviction and exact cached_tokens); only the numbers are made up:
- the next token is a hash of (weights generation, position, the last three tokens), mixed with the request's
  random stream when temperature > 0, mapped onto the tokenizer's regular vocabulary (so text decodes), and is
  the end-of-sequence token with probability `fake_eos_probability`;
- logprobs are hash-derived values in [-5, 0); top-k lists are plausible but made up;
- for a Qwen3-MoE config (model_type qwen3_moe), routed experts are made up too: at each MoE layer a position
  goes to `num_experts_per_tok` consecutive experts (mod num_experts), starting at a hash of (weights generation,
  position, the tokens up to it (at most four), layer). They are computed when the request ends, so they equal a
  cold run's for cached prefixes as well (unless the weights changed while a prefix stayed cached: a real model would
  report the routing computed under the old weights then);
- a forward sleeps `fake_forward_cost_s` (whatever its batch, as a memory-bound GPU decode step) plus
  `fake_prefill_token_cost_s` per prompt token computed plus `fake_decode_token_cost_s` per generated token, so
  cache hits are faster exactly as with a real model.
No KV is stored (cache nodes hold None) and torch is never imported: start-up is fast and memory small.
Weight updates are validated (directory / safetensors headers) and bump the generation, so outputs change.
Distributed updates really receive every tensor (torch is imported when a weight-update group is created) and
accept any names, at most `FAKE_MAX_UPDATE_BYTES` per update. There are no weights to check: /weights_checker
answers 400.
"""

from __future__ import annotations

import array
import json
import sys
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from miles.engine.adapters import AdapterLimits, LoraError
from miles.engine.errors import WeightsCheckError, WeightUpdateError
from miles.engine.requests import Sequence, TokenLogprobs
from miles.engine.runner import Checksum, ForwardItem, ForwardResult, ModelInfo
from miles.engine.settings import EngineSettings
from miles.engine.weights import check_checkpoint_dir, parse_safetensors_header

_MASK = (1 << 64) - 1
FAKE_MAX_UPDATE_BYTES = 1 << 30
"""The fake model has no weights to size a distributed update by; this bounds the memory one may take."""


def _mix(*values: int) -> int:
    """splitmix64 over the values: a fast, well-spread, platform-independent hash."""
    h = 0x9E3779B97F4A7C15
    for value in values:
        h = (h ^ (value & _MASK)) & _MASK
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK
        h ^= h >> 31
    return h


def _logprob_of(h: int) -> float:
    return -0.01 - ((h >> 24) % 1000) / 200.0


class FakeRunner:
    def __init__(self, settings: EngineSettings, num_regular_tokens: int) -> None:
        raw = json.loads((settings.model_path / "config.json").read_text())
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        self.info = ModelInfo(
            model_type=str(raw.get("model_type", "unknown")),
            architectures=tuple(raw.get("architectures") or ()),
            vocab_size=int(raw.get("vocab_size", num_regular_tokens)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            eos_token_ids=eos_ids,
            **_moe_layout(raw),
        )
        self._num_text_tokens = max(1, min(num_regular_tokens, self.info.vocab_size))
        self._eos_id = eos_ids[0] if eos_ids else None
        self._eos_per_million = int(settings.fake_eos_probability * 1_000_000)
        self._prefill_cost_s = settings.fake_prefill_token_cost_s
        self._decode_cost_s = settings.fake_decode_token_cost_s
        self._forward_cost_s = settings.fake_forward_cost_s
        self._generation = 0
        self.max_update_bytes = FAKE_MAX_UPDATE_BYTES
        self.device = "cpu"  # it computes nothing; settings refuse another device with fake_model
        self.sleep: Callable[[float], None] = time.sleep
        """How a forward spends its modelled cost (tests record it instead of waiting)."""

    def warmup(self) -> None:
        """Nothing to warm up."""

    def new_kv(self, capacity: int, prefix_blocks: Seq[Any]) -> Any:
        return None

    def export_kv(self, kv: Any, start: int, end: int) -> Any:
        return None

    def forward(self, items: list[ForwardItem]) -> list[ForwardResult]:
        num_prefill = sum(len(item.token_ids) for item in items if not _is_decode(item))
        num_decode = sum(1 for item in items if _is_decode(item))
        cost_s = self._forward_cost_s + num_prefill * self._prefill_cost_s + num_decode * self._decode_cost_s
        if cost_s > 0:
            self.sleep(cost_s)
        return [self._forward_one(item) for item in items]

    def routed_experts(self, seq: Sequence, start: int, end: int) -> bytes:
        tokens = seq.all_ids
        top_k, num_experts = self.info.num_experts_per_tok, self.info.num_experts
        ids = array.array("i")
        for position in range(start, end):
            h = _mix(self._generation, position, *tokens[max(0, position - 3) : position + 1])
            for layer in range(self.info.num_moe_layers):
                first = _mix(h, layer) % num_experts
                ids.extend((first + slot) % num_experts for slot in range(top_k))
        if sys.byteorder != "little":
            ids.byteswap()
        return ids.tobytes()

    def _forward_one(self, item: ForwardItem) -> ForwardResult:
        seq = item.seq
        tokens = seq.all_ids
        end = item.start_pos + len(item.token_ids)
        inputs: list[TokenLogprobs] = []
        if item.input_logprob_from is not None:
            for position in range(item.input_logprob_from + 1, end):
                h = _mix(self._generation, position, *tokens[max(0, position - 3) : position + 1])
                inputs.append(self._entry(seq, tokens[position], h))
        next_token = self._sample(seq, tokens[:end]) if item.sample else None
        return ForwardResult(next_token=next_token, input_logprobs=tuple(inputs))

    def _sample(self, seq: Sequence, context: list[int]) -> TokenLogprobs:
        h = _mix(self._generation, len(context), *context[-3:])
        if not seq.sampling.greedy:
            h = _mix(h, seq.rng.getrandbits(64))
        token = h % self._num_text_tokens
        if self._eos_id is not None and (h >> 11) % 1_000_000 < self._eos_per_million:
            token = self._eos_id
        return self._entry(seq, token, h)

    def _entry(self, seq: Sequence, token: int, h: int) -> TokenLogprobs:
        logprob = _logprob_of(h)
        options = seq.logprobs
        top = None
        if options.top_logprobs_num > 0:
            others = [(logprob - 0.5 * (i + 1), _mix(h, i) % self._num_text_tokens) for i in range(64)]
            top = tuple(sorted([(logprob, token), *others], reverse=True)[: options.top_logprobs_num])
        by_id = None
        if options.token_ids_logprob is not None:
            by_id = tuple(
                (logprob if t == token else _logprob_of(_mix(h, t)) - 5.0, t) for t in options.token_ids_logprob
            )
        return TokenLogprobs(token_id=token, logprob=logprob, top=top, by_id=by_id)

    def prepare_weights_from_disk(self, model_path: str) -> Any:
        check_checkpoint_dir(model_path)
        return None

    def prepare_weights_from_tensors(self, payloads: list[bytes]) -> Any:
        names: set[str] = set()
        for payload in payloads:
            header = parse_safetensors_header(payload)
            if names & header.keys():
                raise WeightUpdateError(f"tensor {sorted(names & header.keys())[0]!r} sent twice")
            names |= header.keys()
        if not names:
            raise WeightUpdateError("no tensors in the payload")
        return None

    def prepare_weights_from_named(self, tensors: dict[str, Any]) -> Any:
        return None

    def apply_weights(self, prepared: Any) -> None:
        self._generation += 1

    def snapshot_weights(self) -> Any:
        raise WeightsCheckError("the fake model (--fake-model) holds no weights to check")

    def weights_checksum(self, snapshot: Any, dtype: str | None) -> Checksum:
        raise WeightsCheckError("the fake model (--fake-model) holds no weights to check")

    def prepare_adapter(self, lora_path: str, limits: AdapterLimits) -> Any:
        raise LoraError("the fake model (--fake-model) has no weights to apply a LoRA adapter to")

    def add_adapter(self, lora_id: str, prepared: Any) -> None:
        raise LoraError("the fake model (--fake-model) has no weights to apply a LoRA adapter to")

    def remove_adapter(self, lora_id: str) -> None:
        return None


def _moe_layout(raw: dict[str, Any]) -> dict[str, int]:
    """ModelInfo's MoE fields from a config.json, read as miles.model reads Qwen3-MoE (no torch here): layer i is
    sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers. Other types count as dense."""
    if raw.get("model_type") != "qwen3_moe":
        return {}
    num_experts = int(raw.get("num_experts", raw.get("num_local_experts", 128)) or 0)
    step = max(1, int(raw.get("decoder_sparse_step") or 1))
    dense = set(raw.get("mlp_only_layers") or ())
    layers = [i for i in range(int(raw.get("num_hidden_layers", 0))) if i not in dense and (i + 1) % step == 0]
    if num_experts <= 0 or not layers:
        return {}
    top_k = min(int(raw.get("num_experts_per_tok", 8)), num_experts)
    return {"num_moe_layers": len(layers), "num_experts_per_tok": top_k, "num_experts": num_experts}


def _is_decode(item: ForwardItem) -> bool:
    return len(item.token_ids) == 1 and item.start_pos > len(item.seq.prompt_ids) - 1
