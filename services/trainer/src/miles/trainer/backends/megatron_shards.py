"""Each rank's shards of the global Megatron tensors: how they are cut, loaded, gathered and scattered.

A `ShardSpec` ties a local parameter to its *global* name (the TP = PP = EP = 1 name `megatron_mapping.py`
maps): pipeline stages hold a run of layers (local `decoder.layers.j` is global layer `layer_number - 1`), EP
ranks a run of experts (local expert e of EP rank r is global `r * num_local + e`), and TP ranks a slice:

- column-parallel (`partition_dim` 0): linear_qkv (rows grouped by key/value head, so a contiguous slice is whole
  kv groups), fc1 ([gate; up]: each rank holds [gate_r; up_r], megatron's gated-linear-unit split), the
  vocab-parallel embedding and output layer (rows padded with zeros up to a multiple of TP; padding rows never
  produce a logit that is used: the backend cuts logits back to the real vocabulary);
- row-parallel (`partition_dim` 1): linear_proj, fc2;
- replicated: norms (incl. q/k norms), the router.

Tied embeddings with PP > 1: the last stage holds its own copy of the embedding as output layer (megatron's
`shared_embedding` scheme); it is loaded from the embedding, kept equal by summing the two gradients, and never
exported.

Gather (`gather_full`): every rank sends its *primary* shards (the first data-parallel / expert-data-parallel
replica; TP-replicated tensors from TP rank 0) to rank 0 one tensor at a time (gloo/nccl point-to-point), and
rank 0 concatenates them: the result is bit-identical to what a TP = PP = EP = 1 model holding the same values
exports. Scatter (`scatter_full`): rank 0 builds each global tensor once and sends every rank its shard. Both
hold at most the whole model (plus one global tensor) on rank 0 and only a rank's own shards elsewhere.
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles.model import ModelConfig
from miles.trainer.backends.megatron_parallel import RankLayout, comm_device

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")


@dataclass(frozen=True)
class ShardSpec:
    """How one local tensor relates to its global tensor (picklable: it travels in gather/scatter manifests)."""

    global_name: str
    source_name: str
    """The global tensor its values come from (the tied output-layer copy reads the embedding)."""
    dim: int | None
    """Dimension split over `group_size` ranks (None: the whole tensor on every rank)."""
    group_rank: int
    group_size: int
    glu: bool
    """fc1 of a gated MLP: each rank holds [gate_r; up_r]."""
    vocab_size: int | None
    """Embedding and output layer: rows from here on are padding."""
    expert: bool
    primary: bool
    """This copy is the one gathered: the first (expert-)data-parallel replica, and TP rank 0 when replicated."""
    exported: bool
    """False for the tied output-layer copy of PP > 1 (the embedding is exported instead)."""
    counted: bool
    """Counted in the global gradient norm on this rank (each distinct element once per model replica)."""


def shard_specs(model: Any, layout: RankLayout, config: ModelConfig) -> dict[str, ShardSpec]:
    """Specs of every parameter of this rank's model, by local name."""
    from megatron.core import parallel_state  # type: ignore[import-untyped]

    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    etp_size = parallel_state.get_expert_tensor_parallel_world_size()
    specs = {}
    for local_name, param in model.named_parameters():
        global_name = _global_name(model, local_name, layout)
        expert = ".mlp.experts." in local_name
        group_rank, group_size = (etp_rank, etp_size) if expert else (layout.tp_rank, layout.sizes.tp)
        split = bool(getattr(param, "tensor_model_parallel", False)) and group_size > 1
        replica = layout.expert_dp_rank if expert else layout.dp_rank
        tied_copy = global_name == OUTPUT_LAYER and config.tie_word_embeddings
        specs[local_name] = ShardSpec(
            global_name=global_name,
            source_name=EMBEDDING if tied_copy else global_name,
            dim=int(param.partition_dim) if split else None,
            group_rank=group_rank if split else 0,
            group_size=group_size if split else 1,
            glu=split and global_name.endswith("linear_fc1.weight"),
            vocab_size=config.vocab_size if global_name in (EMBEDDING, OUTPUT_LAYER) else None,
            expert=expert,
            primary=replica == 0 and (split or group_rank == 0),
            exported=not tied_copy,
            counted=not tied_copy and (split or group_rank == 0),
        )
    return specs


def _global_name(model: Any, local_name: str, layout: RankLayout) -> str:
    match = _LAYER.fullmatch(local_name)
    if match is None:
        return local_name
    layer = model.decoder.layers[int(match.group(1))]
    rest = match.group(2)
    expert = _EXPERT.fullmatch(rest)
    if expert is not None:
        num_local = len(layer.mlp.experts.local_experts)
        rest = f"mlp.experts.local_experts.{layout.ep_rank * num_local + int(expert.group(1))}.{expert.group(2)}"
    return f"decoder.layers.{layer.layer_number - 1}.{rest}"


def shard_of(full: torch.Tensor, spec: ShardSpec, shape: Sequence[int]) -> torch.Tensor:
    """This spec's shard (of `shape`) of the global tensor `full` (vocabulary rows zero-padded first)."""
    if spec.vocab_size is not None:
        padded_rows = shape[0] * (spec.group_size if spec.dim == 0 else 1)
        full = torch.cat([full, full.new_zeros(padded_rows - full.shape[0], *full.shape[1:])])
    if spec.dim is None:
        return full
    if spec.glu:
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(spec.group_size)[spec.group_rank], up.chunk(spec.group_size)[spec.group_rank]])
    return full.chunk(spec.group_size, dim=spec.dim)[spec.group_rank]


def merge_shards(shards: Sequence[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The global tensor from its shards in group-rank order (inverse of shard_of)."""
    if spec.dim is None:
        full = shards[0]
    elif spec.glu:
        halves = [shard.chunk(2) for shard in shards]
        full = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    else:
        full = torch.cat(list(shards), dim=spec.dim)
    return full[: spec.vocab_size] if spec.vocab_size is not None else full


def gather_full(entries: Sequence[tuple[ShardSpec, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every exported global tensor, float32, whole and on the CPU, on rank 0 (an empty dict elsewhere).
    Collective."""
    mine = [(spec, tensor.detach().float().contiguous()) for spec, tensor in entries if spec.primary and spec.exported]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return _merge_all([(spec, tensor.cpu().clone()) for spec, tensor in mine])
    manifests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(manifests, [(spec, tuple(tensor.shape)) for spec, tensor in mine])
    device = comm_device()
    if dist.get_rank() != 0:
        for _, tensor in mine:
            dist.send(tensor.to(device), dst=0)
        return {}
    received = [(spec, tensor.cpu().clone()) for spec, tensor in mine]
    for source, manifest in enumerate(manifests[1:], start=1):
        for spec, shape in manifest:
            buffer = torch.empty(shape, dtype=torch.float32, device=device)
            dist.recv(buffer, src=source)
            received.append((spec, buffer.cpu()))
    return _merge_all(received)


def _merge_all(received: Sequence[tuple[ShardSpec, torch.Tensor]]) -> dict[str, torch.Tensor]:
    pieces: dict[str, list[tuple[ShardSpec, torch.Tensor]]] = defaultdict(list)
    for spec, tensor in received:
        pieces[spec.global_name].append((spec, tensor))
    out = {}
    for name, parts in pieces.items():
        parts.sort(key=lambda part: part[0].group_rank)
        out[name] = merge_shards([tensor for _, tensor in parts], parts[0][0])
    return out


@torch.no_grad()
def scatter_full(entries: Sequence[tuple[ShardSpec, torch.Tensor]], full: Callable[[str], torch.Tensor]) -> None:
    """Copy into every rank's tensors their shards of the global tensors `full(source_name)`, which only rank 0
    calls (each global tensor once). Collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        load_local(entries, full)
        return
    ordered = sorted(entries, key=lambda entry: (entry[0].source_name, entry[0].global_name))
    manifests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(manifests, [(spec, tuple(tensor.shape)) for spec, tensor in ordered])
    device = comm_device()
    if dist.get_rank() != 0:
        for _, tensor in ordered:
            buffer = torch.empty(tensor.shape, dtype=torch.float32, device=device)
            dist.recv(buffer, src=0)
            tensor.copy_(buffer)
        return
    receivers: dict[str, list[tuple[int, ShardSpec, tuple[int, ...], torch.Tensor | None]]] = defaultdict(list)
    for rank, manifest in enumerate(manifests):
        for index, (spec, shape) in enumerate(manifest):
            receivers[spec.source_name].append((rank, spec, shape, ordered[index][1] if rank == 0 else None))
    for name in sorted(receivers):
        whole = full(name)
        for rank, spec, shape, own in receivers[name]:
            shard = shard_of(whole, spec, shape).float().contiguous()
            if own is not None:
                own.copy_(shard)
            else:
                dist.send(shard.to(device), dst=rank)


@torch.no_grad()
def load_local(entries: Sequence[tuple[ShardSpec, torch.Tensor]], full: Callable[[str], torch.Tensor]) -> None:
    """Fill this rank's tensors from `full(source_name)` with no communication (every rank reads for itself)."""
    for spec, tensor in entries:
        shard = shard_of(full(spec.source_name), spec, tuple(tensor.shape))
        if tuple(shard.shape) != tuple(tensor.shape):
            raise ValueError(f"{spec.global_name}: shard {tuple(shard.shape)} != local {tuple(tensor.shape)}")
        tensor.copy_(shard.to(tensor.dtype))


class LazyCheckpoint:
    """The tensors of an HF checkpoint directory read one at a time on demand (safetensors' memory-mapped
    `safe_open`), so a rank reads only what its shards are made of and never holds the whole model."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        from miles.model.checkpoint import safetensors_files

        self._stack = contextlib.ExitStack()
        self._files: dict[str, Any] = {}
        for path in safetensors_files(model_dir):
            handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            self._files |= {name: handle for name in handle.keys()}  # noqa: SIM118 (not a dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor: torch.Tensor = self._files[name].get_tensor(name)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def close(self) -> None:
        self._stack.close()
