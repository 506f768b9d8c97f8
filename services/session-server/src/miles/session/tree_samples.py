"""A tree session's samples, TITO checks and GET view (tree.py). Pure functions, run in a worker thread.

Each path is handled exactly like a linear session's whole history: its records (root first) and its buffer go
through samples.build_samples, and its messages through TITO's end-of-session comparison. `merge` gives one
sample per leaf path, `per_turn` one per node (a node's path ends at it, so its turn is the path's last): a node
shared by several paths is trained once per leaf in merge mode, once in per-turn mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from miles.session.model_assets import SessionModel
from miles.session.records import Json
from miles.session.routing import assemble as assemble_routing
from miles.session.samples import SampleData, SampleMode, aborted_placeholder, build_samples
from miles.session.tito import ComparisonResult
from miles.session.tree import SessionTree, TreeNode, TreeStats, path_buffer


@dataclass
class TreeSamples:
    samples: list[SampleData]
    empty_reason: str
    stats: TreeStats
    comparisons: dict[str, ComparisonResult] = field(default_factory=dict)
    """TITO's check of every leaf path, by leaf node id."""

    @property
    def worst(self) -> ComparisonResult | None:
        return max(self.comparisons.values(), key=lambda c: c.num_critical, default=None)


def compare_path(model: SessionModel, tree: SessionTree, leaf: TreeNode, buffer: list[int]) -> ComparisonResult:
    """TITO's end-of-session check on one path: its buffer against a fresh render of its messages."""
    path = tree.path(leaf.node_id)
    expected = model.tito.encode_messages(tree.history(leaf.node_id), tools=leaf.tools)
    sampled = [(n.record.prompt_len, n.record.prompt_len + len(n.record.completion_ids)) for n in path]
    return model.tito.comparator().compare(
        expected=expected, actual=buffer, trim_ids=model.tito.stop_token_ids, sampled_spans=sampled
    )


def _path_samples(
    model: SessionModel,
    tree: SessionTree,
    node: TreeNode,
    buffer: list[int],
    routing_chunks: Mapping[str, bytes] | None,
    *,
    mode: SampleMode,
    max_seq_len: int | None,
    sample_id: str,
) -> list[SampleData]:
    path = tree.path(node.node_id)
    records = [n.record for n in path]
    routing = None
    if model.routing is not None and routing_chunks is not None:
        chunks = [routing_chunks.get(n.node_id, b"") for n in path]
        routing = assemble_routing(records, chunks, model.routing, len(buffer))
    samples, _ = build_samples(
        records,
        buffer,
        max_trim_tokens=model.tito.max_trim_tokens,
        mode=mode,
        max_seq_len=max_seq_len,
        episode_id=sample_id,
        placeholder_token_id=model.eos_token_id or 0,
        routing=routing,
    )
    if mode == "per_turn":  # only this node's own turn: its ancestors have samples of their own
        samples = [s for s in samples if s.metadata.get("turn_indices") == [node.record.turn_index]]
        for sample in samples:
            sample.sample_id = sample_id
    for sample in samples:
        sample.metadata.update({"tree_node_id": node.node_id, "tree_depth": node.depth})
    return samples


def tree_samples(
    model: SessionModel,
    tree: SessionTree,
    deltas: Mapping[str, list[int]],
    routing_chunks: Mapping[str, bytes] | None,
    *,
    episode_id: str,
    mode: SampleMode,
    max_seq_len: int | None,
) -> TreeSamples:
    """Every sample of the tree (module docstring) and each leaf path's TITO check."""
    stats = tree.stats()
    result = TreeSamples([], "", stats)
    leaves = tree.leaves()
    leaf_ids = {leaf.node_id for leaf in leaves}
    targets = leaves if mode == "merge" else list(tree.nodes.values())
    for node in targets:
        buffer = path_buffer(tree.path(node.node_id), deltas)
        if node.node_id in leaf_ids:
            result.comparisons[node.node_id] = compare_path(model, tree, node, buffer)
        sample_id = episode_id if mode == "merge" and len(leaves) == 1 else f"{episode_id}/node-{node.node_id}"
        samples = _path_samples(
            model, tree, node, buffer, routing_chunks, mode=mode, max_seq_len=max_seq_len, sample_id=sample_id
        )
        if node.node_id in result.comparisons:
            for sample in samples:
                sample.metadata["tito_num_critical"] = result.comparisons[node.node_id].num_critical
        result.samples.extend(samples)
    if not result.samples:
        result.empty_reason = "all_truncated" if len(tree) else "no_records"
        result.samples = [aborted_placeholder(episode_id, model.eos_token_id or 0, result.empty_reason)]
    return result


def tree_view(tree: SessionTree) -> Json:
    """GET's view of a tree: its shape and every node's record, without ids or a render of any path."""
    leaf_ids = {leaf.node_id for leaf in tree.leaves()}
    nodes = [
        {
            "node_id": node.node_id,
            "parent_id": node.parent_id,
            "depth": node.depth,
            "is_leaf": node.node_id in leaf_ids,
            "compaction": node.compaction,
            "num_tokens": node.num_tokens,
            "num_stored_tokens": node.num_delta_tokens,
            "messages": node.messages,
            "record": node.record.to_json(),
        }
        for node in tree.nodes.values()
    ]
    return {"stats": tree.stats().to_json(), "nodes": nodes}
