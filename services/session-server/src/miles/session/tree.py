"""Tree sessions: agents that fork, retry at any depth and compact their context, in one session. Pure functions.

A tree session stores one `TreeNode` per committed model call. A node's token buffer is its parent's buffer, less
the junction trim, plus its own ids (the prompt's appended ids and the sampled ids): `keep_len` tokens of the
parent's buffer are kept, and only the rest (`delta`) is stored, so a shared prefix is stored once. A node's
history is its parent's history plus `messages` (the messages the request appended, then the assistant's).

Placement (phase 1 of a turn): a request goes under the deepest node whose history is a strict prefix of the
request's messages (TITO extends that node's buffer with only the new messages, so every root-to-node path keeps
the TITO invariant); ties go to the newest node. A request that extends no node starts a new root with its own
full render: the agent compacted or rewrote its context (`compaction` is set when the tree had nodes already).
`parent_node_id` places a request explicitly; the node must be this session's and its history a prefix.
Concurrent requests are never fenced against each other: each adds its own node, so they branch.

Samples: one per leaf path (`merge`) or one per node (`per_turn`), each built from its path's records and buffer
exactly as a linear session's are (samples.py): a shared prefix appears in every path's samples with the same
ids and logprobs. `TreeStats` says how many tokens a packed tree sample (each token once) would save.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from miles.session.errors import InvalidRequestError, ToolsChangedError
from miles.session.records import Json, TurnRecord, dumps
from miles.session.tito import TitoPrompt, TitoTokenizer, split_appended
from miles.session.tito.messages import canonical_tools, first_difference


@dataclass(frozen=True)
class TreeNode:
    """One committed model call of a tree session (its ids are stored beside it, `delta`)."""

    node_id: str
    parent_id: str | None
    depth: int
    """1 for a root; the record's turn_index is depth - 1."""
    keep_len: int
    """Tokens of the parent's buffer this node's buffer starts with (the parent's length less the junction trim)."""
    num_delta_tokens: int
    messages: list[Json]
    """The messages after the parent's history: the request's appended messages, then the assistant message."""
    tools: list[Json] | None
    """The tools of the node's root (every node of a path renders with them)."""
    record: TurnRecord
    compaction: bool = False
    """A root started while the session had nodes already (the agent rewrote its context)."""

    @property
    def num_tokens(self) -> int:
        return self.keep_len + self.num_delta_tokens

    def to_json(self) -> Json:
        return {
            "node_id": self.node_id,
            "parent_id": self.parent_id,
            "depth": self.depth,
            "keep_len": self.keep_len,
            "num_delta_tokens": self.num_delta_tokens,
            "messages": self.messages,
            "tools": self.tools,
            "record": self.record.to_json(),
            "compaction": self.compaction,
        }

    @classmethod
    def from_json(cls, data: Json) -> TreeNode:
        return cls(
            node_id=str(data["node_id"]),
            parent_id=None if data.get("parent_id") is None else str(data["parent_id"]),
            depth=int(data["depth"]),
            keep_len=int(data["keep_len"]),
            num_delta_tokens=int(data["num_delta_tokens"]),
            messages=list(data["messages"]),
            tools=data.get("tools"),
            record=TurnRecord.from_json(data["record"]),
            compaction=bool(data.get("compaction", False)),
        )


@dataclass(frozen=True)
class TreeStats:
    num_nodes: int
    num_roots: int
    num_leaves: int
    num_path_tokens: int
    """Tokens of every leaf path's buffer, summed: what one sample per leaf trains on."""
    num_tree_tokens: int
    """Tokens of the tree, each once: what a packed tree sample would train on."""

    def to_json(self) -> Json:
        return dict(self.__dict__)


class SessionTree:
    """A tree session's nodes (without their ids), indexed for placement and paths."""

    def __init__(self, nodes: Sequence[TreeNode]) -> None:
        ordered = sorted(nodes, key=lambda n: (n.depth, n.record.created_at_unix_ms, n.node_id))
        self.nodes: dict[str, TreeNode] = {node.node_id: node for node in ordered}
        self.children: dict[str | None, list[TreeNode]] = {}
        for node in ordered:
            self.children.setdefault(node.parent_id, []).append(node)

    def __len__(self) -> int:
        return len(self.nodes)

    def path(self, node_id: str) -> list[TreeNode]:
        """Root first, `node_id` last."""
        path: list[TreeNode] = []
        node: TreeNode | None = self.nodes[node_id]
        while node is not None:
            path.append(node)
            node = self.nodes.get(node.parent_id) if node.parent_id is not None else None
        return path[::-1]

    def history(self, node_id: str) -> list[Json]:
        return [message for node in self.path(node_id) for message in node.messages]

    def leaves(self) -> list[TreeNode]:
        return [node for node in self.nodes.values() if node.node_id not in self.children]

    def place(self, messages: Sequence[Json]) -> TreeNode | None:
        """The deepest node whose history is a strict prefix of `messages` (the newest among equals), or None."""
        best: TreeNode | None = None
        frontier: list[tuple[TreeNode, int]] = [(root, 0) for root in self.children.get(None, [])]
        while frontier:
            node, start = frontier.pop()
            end = start + len(node.messages)
            if end >= len(messages) or not _same(node.messages, messages[start:end]):
                continue
            if best is None or (node.depth, node.record.created_at_unix_ms) >= (
                best.depth,
                best.record.created_at_unix_ms,
            ):
                best = node
            frontier.extend((child, end) for child in self.children.get(node.node_id, []))
        return best

    def stats(self) -> TreeStats:
        leaves = self.leaves()
        return TreeStats(
            num_nodes=len(self.nodes),
            num_roots=len(self.children.get(None, [])),
            num_leaves=len(leaves),
            num_path_tokens=sum(leaf.num_tokens for leaf in leaves),
            num_tree_tokens=sum(node.num_delta_tokens for node in self.nodes.values()),
        )


def _same(stored: Sequence[Json], request: Sequence[Any]) -> bool:
    return all(
        isinstance(new, Mapping) and first_difference(old, new) is None
        for old, new in zip(stored, request, strict=True)
    )


def path_buffer(path: Sequence[TreeNode], deltas: Mapping[str, list[int]]) -> list[int]:
    """The token buffer of the path's last node from its nodes' stored ids."""
    buffer: list[int] = []
    for node in path:
        del buffer[node.keep_len :]
        buffer.extend(deltas[node.node_id])
    return buffer


@dataclass(frozen=True)
class TreeTurnPlan:
    """Phase 1 of a tree turn: the prompt, where the node goes, and what its record needs."""

    prompt: TitoPrompt
    parent: TreeNode | None
    base_messages: list[Json]
    appended: list[Json]
    tools: list[Json] | None
    compaction: bool
    num_tree_tokens: int = 0
    """The token ids the session's tree held when the turn was planned (for the bound check before generation)."""

    @property
    def depth(self) -> int:
        return 1 if self.parent is None else self.parent.depth + 1

    @property
    def num_kept_records(self) -> int:
        """The turn's index on its path (the records before it), as a linear turn's plan names it."""
        return self.depth - 1

    @property
    def keep_len(self) -> int:
        return len(self.prompt.stored_ids) - self.prompt.num_trimmed_tokens


def find_parent(
    tree: SessionTree, session_id: str, messages: Sequence[Json], parent_node_id: str | None
) -> TreeNode | None:
    """Where a request goes (module docstring); 400 naming parent_node_id for a node this session does not have."""
    if parent_node_id is None:
        return tree.place(messages)
    parent = tree.nodes.get(parent_node_id)
    if parent is None:
        raise InvalidRequestError(
            f"parent_node_id {parent_node_id!r} is not a node of session {session_id} (GET the session for its tree)",
            field="parent_node_id",
        )
    return parent


def plan_tree_turn(
    tito: TitoTokenizer,
    tree: SessionTree,
    parent: TreeNode | None,
    parent_ids: list[int],
    messages: list[Json],
    *,
    request_tools: list[Json] | None,
    chat_template_kwargs: Json | None,
) -> TreeTurnPlan:
    """The prompt of a turn under `parent` (whose buffer is `parent_ids`), or of a new root."""
    requested_tools = canonical_tools(request_tools) or None
    if parent is None:
        prompt = tito.first_prompt(messages, tools=requested_tools, chat_template_kwargs=chat_template_kwargs)
        return TreeTurnPlan(prompt, None, [], list(messages), requested_tools, compaction=len(tree) > 0)
    if requested_tools is not None and dumps(requested_tools) != dumps(parent.tools):
        raise ToolsChangedError(
            "tools differ from the ones this branch's root was rendered with; send the same tools (or none) on "
            "every turn of a branch, or leave out the history to start a new root",
            field="tools",
        )
    base_messages = tree.history(parent.node_id)
    appended = [dict(m) for m in split_appended(base_messages, messages)]
    prompt = tito.extend(
        parent_ids, base_messages, appended, tools=parent.tools, chat_template_kwargs=chat_template_kwargs
    )
    return TreeTurnPlan(prompt, parent, base_messages, appended, parent.tools, compaction=False)


@dataclass(frozen=True)
class TreeCommit:
    """Phase 3 of a tree turn: add `node` (its ids `delta_ids`) unless the tree would pass its bounds."""

    node: TreeNode
    delta_ids: list[int]
    ttl_s: float
    max_nodes: int
    max_tokens: int
    routing: bytes | None = None
    """The node's routing chunk (R3), rows from `node.record.routing_start_row` of its path's buffer."""
