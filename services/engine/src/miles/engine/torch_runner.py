"""The real model runner: miles.model's transformer on the CPU or a GPU, sampling, logprobs and weight swaps.

One `forward` runs every sequence of the step in one batched call (`CausalLM.forward_segments`) per LoRA adapter
(the base model's sequences are one group, each adapter's run with its merged weights swapped in: lora.py), then
reads logprobs block by block (the vocabulary is large): the rows asked for are the last position of sequences
that sample, and prompt positions whose logprobs were requested. Sampling follows SGLang: temperature 0 is
greedy; otherwise softmax(logits / T), filtered by top_k, top_p and min_p, sampled with the request's own random
stream (seeded by sampling_seed when given). Reported logprobs are log_softmax(logits / T) before filtering
(T = 1 for greedy), as SGLang reports them by default. In deterministic mode the same numbers come out for a
token whatever it is batched with (miles.model.kernels).

KV caches are `SequenceKV.for_config`: for a MoE model they also record the experts every fed token was routed
to, and their exported blocks carry that routing into the radix cache and back into sequences that hit it, so
`routed_experts` answers for cached prefixes exactly what a cold prefill computed.

Device (`settings.device`, resolved by device.py): the model, every KV buffer (so the radix cache's blocks too),
the logits, sampling and swapped-in weights live there; token ids, logprobs and routed experts come back to the
CPU as Python numbers or bytes. Weight payloads are decoded and checked on the CPU and copied to the device when
they are swapped in. CUDA kernels run under a device guard, because the scheduler thread's current CUDA device
is not the one the runner was built on (torch keeps it per thread).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from miles.engine.adapters import AdapterLimits
from miles.engine.checksum import named_tensors_checksum
from miles.engine.device import configure_cuda_determinism, resolve_device
from miles.engine.errors import WeightUpdateError
from miles.engine.lora import MergedAdapters, PreparedAdapter, read_adapter
from miles.engine.requests import Sequence, TokenLogprobs
from miles.engine.runner import Checksum, ForwardItem, ForwardResult, ModelInfo
from miles.engine.settings import EngineSettings
from miles.engine.weights import check_checkpoint_dir
from miles.model import (
    KVBlock,
    ModelConfig,
    ModelError,
    Segment,
    SequenceKV,
    block_logprobs,
    check_named_tensors,
    decode_safetensors_bytes,
    load_model,
    read_safetensors_dir,
    row_blocks,
)


@dataclass(frozen=True)
class _Row:
    """One hidden row to read logprobs from: `item` index, and `target` (a prompt token) or None (sample)."""

    item: int
    hidden_row: int
    target: int | None


class TorchRunner:
    def __init__(self, settings: EngineSettings) -> None:
        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        self.torch_device = resolve_device(settings.device)  # ConfigError before any weight is read
        self.device = str(self.torch_device)
        self.deterministic = settings.deterministic
        if self.deterministic and self.torch_device.type == "cuda":
            configure_cuda_determinism()  # before the first cuBLAS call: it reads its workspace setting once
        self.model = load_model(settings.model_path).to(self.torch_device)
        config = self.model.config
        self.info = ModelInfo(
            model_type=config.model_type,
            architectures=config.architectures,
            vocab_size=config.vocab_size,
            max_position_embeddings=config.max_position_embeddings,
            eos_token_ids=config.eos_token_ids,
            num_moe_layers=config.num_moe_layers,
            num_experts_per_tok=config.num_experts_per_tok,
            num_experts=config.num_experts,
        )
        self.max_update_bytes = 8 * sum(p.numel() for p in self.model.parameters())
        self.adapters = MergedAdapters(self.model)

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        """A guard making the runner's GPU current in the calling thread (nothing on the CPU)."""
        if self.torch_device.type == "cuda":
            return torch.cuda.device(self.torch_device)
        return contextlib.nullcontext()

    def warmup(self) -> None:
        """One prefill, one prefill on top of a cache and one decode, in this runner's mode."""
        device = self.torch_device
        with torch.inference_mode(), self._on_device():
            kv = self.new_kv(8, [])
            for ids, start in (([1, 2, 3], 0), ([4, 5], 3), ([6], 5)):
                hidden = self.model.forward_segments(
                    [Segment(torch.tensor(ids, device=device), start, kv)], deterministic=self.deterministic
                )
                ones = torch.ones(1, device=device)
                block_logprobs(self.model, hidden[-1:], ones, deterministic=self.deterministic)

    def new_kv(self, capacity: int, prefix_blocks: Seq[Any]) -> SequenceKV:
        with self._on_device():
            kv = SequenceKV.for_config(self.model.config, capacity, device=self.torch_device)
            kv.load_prefix(prefix_blocks)
        return kv

    def export_kv(self, kv: Any, start: int, end: int) -> KVBlock:
        assert isinstance(kv, SequenceKV)
        with self._on_device():
            return kv.export(start, end)

    def routed_experts(self, seq: Sequence, start: int, end: int) -> bytes:
        kv = seq.kv
        assert isinstance(kv, SequenceKV)
        return kv.routed_experts(start, end).cpu().numpy().astype("<i4", copy=False).tobytes()

    def forward(self, items: list[ForwardItem]) -> list[ForwardResult]:
        """One batched forward per adapter among the items (results in item order)."""
        groups: dict[str | None, list[int]] = {}
        for index, item in enumerate(items):
            groups.setdefault(item.seq.lora_id, []).append(index)
        if len(groups) == 1:
            (lora_id,) = groups
            with self.adapters.swapped(lora_id):
                return self._forward_group(items)
        results: list[ForwardResult | None] = [None] * len(items)
        for lora_id, indices in groups.items():
            with self.adapters.swapped(lora_id):
                group_results = self._forward_group([items[i] for i in indices])
            for index, result in zip(indices, group_results, strict=True):
                results[index] = result
        return [r for r in results if r is not None]

    def _forward_group(self, items: list[ForwardItem]) -> list[ForwardResult]:
        device = self.torch_device
        with torch.inference_mode(), self._on_device():
            segments = [
                Segment(torch.tensor(i.token_ids, dtype=torch.long, device=device), i.start_pos, i.seq.kv)
                for i in items
            ]
            hidden = self.model.forward_segments(segments, deterministic=self.deterministic)
            rows = _plan_rows(items)
            picked: list[TokenLogprobs | None] = [None] * len(rows)
            if rows:
                selected = hidden[torch.tensor([r.hidden_row for r in rows], device=device)]
                temperatures = torch.tensor(
                    [items[r.item].seq.sampling.logprob_temperature for r in rows], dtype=torch.float32, device=device
                )
                for block in row_blocks(len(rows), deterministic=self.deterministic):
                    logprobs = block_logprobs(
                        self.model, selected[block], temperatures[block], deterministic=self.deterministic
                    )
                    picked[block] = self._read_block(logprobs, rows[block], items)
        inputs: list[list[TokenLogprobs]] = [[] for _ in items]
        next_tokens: list[TokenLogprobs | None] = [None] * len(items)
        for row, entry in zip(rows, picked, strict=True):
            assert entry is not None
            if row.target is None:
                next_tokens[row.item] = entry
            else:
                inputs[row.item].append(entry)
        return [ForwardResult(next_tokens[i], tuple(inputs[i])) for i in range(len(items))]

    def _read_block(self, logprobs: torch.Tensor, rows: list[_Row], items: list[ForwardItem]) -> list[TokenLogprobs]:
        seqs = [items[r.item].seq for r in rows]
        token_ids = _choose_tokens(logprobs, rows, seqs)
        ids = torch.tensor(token_ids, device=logprobs.device)
        token_logprobs = logprobs.gather(1, ids[:, None])[:, 0].tolist()
        top_num = [s.logprobs.top_logprobs_num for s in seqs]
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if max(top_num) > 0:
            values, indices = logprobs.topk(min(max(top_num), logprobs.shape[1]), dim=1)
            top_values, top_ids = values.tolist(), indices.tolist()
        entries = []
        for i, seq in enumerate(seqs):
            top = None
            if top_num[i] > 0:
                top = tuple(zip(top_values[i][: top_num[i]], top_ids[i][: top_num[i]], strict=True))
            by_id = None
            wanted = seq.logprobs.token_ids_logprob
            if wanted is not None:
                by_id = tuple(zip(logprobs[i, list(wanted)].tolist(), wanted, strict=True))
            entries.append(TokenLogprobs(token_ids[i], _finite(token_logprobs[i]), top, by_id))
        return entries

    def prepare_weights_from_disk(self, model_path: str) -> dict[str, torch.Tensor]:
        path = check_checkpoint_dir(model_path)
        try:
            if not _same_computation(ModelConfig.from_dir(path), self.model.config):
                raise WeightUpdateError(f"{model_path} has a different architecture or shape than the served model")
            return check_named_tensors(self.model, read_safetensors_dir(path), require_all=True)
        except ModelError as exc:
            raise WeightUpdateError(str(exc)) from exc

    def prepare_weights_from_tensors(self, payloads: list[bytes]) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        try:
            for payload in payloads:
                tensors = decode_safetensors_bytes(payload)
                if merged.keys() & tensors.keys():
                    raise WeightUpdateError(f"tensor {sorted(merged.keys() & tensors.keys())[0]!r} sent twice")
                merged.update(tensors)
            if not merged:
                raise WeightUpdateError("no tensors in the payload")
            return check_named_tensors(self.model, merged, require_all=False)
        except ModelError as exc:
            raise WeightUpdateError(str(exc)) from exc

    def prepare_weights_from_named(self, tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
        try:
            return check_named_tensors(self.model, tensors, require_all=False)
        except ModelError as exc:
            raise WeightUpdateError(str(exc)) from exc

    def apply_weights(self, prepared: Any) -> None:
        """Copy the prepared tensors (CPU, or this device for a distributed update) into the parameters."""
        params = dict(self.model.named_parameters())
        with torch.no_grad(), self._on_device():
            for name, tensor in prepared.items():
                params[name].copy_(tensor)
            self.adapters.refresh(set(prepared))

    def prepare_adapter(self, lora_path: str, limits: AdapterLimits) -> PreparedAdapter:
        return read_adapter(lora_path, self.adapters.shapes(), limits)

    def add_adapter(self, lora_id: str, prepared: Any) -> None:
        with self._on_device():
            self.adapters.add(lora_id, prepared)

    def remove_adapter(self, lora_id: str) -> None:
        self.adapters.remove(lora_id)

    def snapshot_weights(self) -> dict[str, torch.Tensor]:
        """CPU copies (the checksum hashes host bytes off the scheduler thread)."""
        with self._on_device():
            return {name: p.detach().to("cpu", copy=True) for name, p in self.model.named_parameters()}

    def weights_checksum(self, snapshot: Any, dtype: str | None) -> Checksum:
        target = getattr(torch, dtype) if dtype is not None else next(iter(snapshot.values())).dtype
        digest, exact = named_tensors_checksum(snapshot, target)
        return Checksum(str(target).removeprefix("torch."), digest, exact, len(snapshot))


def _same_computation(a: ModelConfig, b: ModelConfig) -> bool:
    """Whether two configs describe the same computation (special-token ids and context may differ)."""
    ignored = {"eos_token_ids": (), "bos_token_id": None, "architectures": (), "max_position_embeddings": 0}
    return dataclasses.replace(a, **ignored) == dataclasses.replace(b, **ignored)  # type: ignore[arg-type]


def _plan_rows(items: list[ForwardItem]) -> list[_Row]:
    rows: list[_Row] = []
    offset = 0
    for index, item in enumerate(items):
        n = len(item.token_ids)
        if item.input_logprob_from is not None:
            for position in range(item.input_logprob_from, item.start_pos + n - 1):
                local = position - item.start_pos
                rows.append(_Row(index, offset + local, item.token_ids[local + 1]))
        if item.sample:
            rows.append(_Row(index, offset + n - 1, None))
        offset += n
    return rows


def _choose_tokens(logprobs: torch.Tensor, rows: list[_Row], seqs: list[Sequence]) -> list[int]:
    """Targets for scoring rows; sampled tokens for the others (batched where no filtering is needed)."""
    chosen = [r.target if r.target is not None else -1 for r in rows]
    greedy = [i for i, r in enumerate(rows) if r.target is None and seqs[i].sampling.greedy]
    plain = [
        i
        for i, r in enumerate(rows)
        if r.target is None and not seqs[i].sampling.greedy and not seqs[i].sampling.needs_filtering
    ]
    if greedy:
        for i, token in zip(greedy, logprobs[greedy].argmax(dim=1).tolist(), strict=True):
            chosen[i] = int(token)
    if plain:
        cumulative = logprobs[plain].exp().cumsum(dim=1)
        uniforms = [seqs[i].rng.random() for i in plain]
        draws = torch.tensor(uniforms, dtype=torch.float32, device=logprobs.device) * cumulative[:, -1]
        tokens = torch.searchsorted(cumulative, draws[:, None], right=True)[:, 0].clamp(max=logprobs.shape[1] - 1)
        for i, token in zip(plain, tokens.tolist(), strict=True):
            chosen[i] = int(token)
    for i, row in enumerate(rows):
        if chosen[i] == -1 and row.target is None:
            chosen[i] = _sample_filtered(logprobs[i], seqs[i])
    return [int(c) for c in chosen]


def _sample_filtered(logprobs: torch.Tensor, seq: Sequence) -> int:
    params = seq.sampling
    vocab = logprobs.shape[0]
    scores = logprobs.clone()
    if params.top_k < vocab:
        kth = scores.topk(params.top_k).values[-1]
        scores[scores < kth] = -math.inf
    probs = scores.exp()
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs
        probs[order[before > params.top_p * float(sorted_probs.sum())]] = 0.0
    if params.min_p > 0.0:
        probs[probs < float(probs.max()) * params.min_p] = 0.0
    cumulative = probs.cumsum(0)
    draw = torch.tensor([seq.rng.random() * float(cumulative[-1])], dtype=torch.float32, device=logprobs.device)
    return int(torch.searchsorted(cumulative, draw, right=True)[0].clamp(max=vocab - 1))


def _finite(value: float) -> float | None:
    """NaN and infinities become null, as SGLang's orjson rendering does."""
    return value if math.isfinite(value) else None
