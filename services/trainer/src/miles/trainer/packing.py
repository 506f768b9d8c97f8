"""Token-budget micro-batching: which sequences run together in one forward/backward, on which rank.

Sequences are first spread over ranks (largest first, each to the rank with the fewest tokens so far), then on
each rank packed first-fit-decreasing into micro-batches of at most `max_tokens` tokens (a longer sequence runs
alone). Both are deterministic functions of the token counts, so every rank computes the same plan. A
sequence is never split, so sequence-level statistics (MIS sequence/geometric levels) stay within one
micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence


def _largest_first(num_tokens: Sequence[int], indices: Sequence[int]) -> list[int]:
    return sorted(indices, key=lambda i: (-num_tokens[i], i))


def pack_micro_batches(
    num_tokens: Sequence[int], max_tokens: int, indices: Sequence[int] | None = None
) -> list[list[int]]:
    """First-fit decreasing bins of sequence indices with total tokens <= max_tokens (oversized ones alone).

    Bins come out in creation order; within a bin indices are ascending."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in _largest_first(num_tokens, range(len(num_tokens)) if indices is None else indices):
        size = num_tokens[index]
        for bin_index, load in enumerate(loads):
            if load + size <= max_tokens:
                bins[bin_index].append(index)
                loads[bin_index] += size
                break
        else:
            bins.append([index])
            loads.append(size)
    return [sorted(b) for b in bins]


def shard_over_ranks(num_tokens: Sequence[int], world_size: int) -> list[list[int]]:
    """Sequence indices per rank, balancing tokens (greedy: largest sequence to the least-loaded rank)."""
    shards: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for index in _largest_first(num_tokens, range(len(num_tokens))):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shards[rank].append(index)
        loads[rank] += num_tokens[index]
    return [sorted(shard) for shard in shards]


def plan_micro_batches(num_tokens: Sequence[int], max_tokens: int, world_size: int) -> list[list[list[int]]]:
    """[rank][micro-batch] -> sequence indices."""
    return [pack_micro_batches(num_tokens, max_tokens, shard) for shard in shard_over_ranks(num_tokens, world_size)]
