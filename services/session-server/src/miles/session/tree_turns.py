"""Phases 1 and 3 of a turn on a tree session (tree.py); phase 2 (the engine) is the linear turn's (turns.py).

Phase 1 reads the tree without the session lock (a tree turn never rewrites what is stored, so nothing needs
fencing), places the request, loads only its parent's path ids and builds the prompt with TITO. A tree at its
bounds is refused here, before the engine runs (409 session_tree_full), and so is a turn whose node could take
the tree past max_tree_tokens (its new prompt ids and max_tokens: check_tree_room, once the budget is known). Phase
3 adds the node in one atomic step;
concurrent branches that together cross a bound make the later one not recorded (`tree_full`), never a loss of
what is stored.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

from miles.session.api_models import ChatCompletionRequest
from miles.session.errors import SessionNotFoundError, TreeFullError
from miles.session.model_assets import SessionModel
from miles.session.records import CommitOutcome, Json, SessionMeta
from miles.session.store import SessionStore
from miles.session.tree import SessionTree, TreeCommit, TreeNode, TreeTurnPlan, find_parent, path_buffer, plan_tree_turn
from miles.session.upstream import Completion


@dataclass(frozen=True)
class TreeLimits:
    max_nodes: int
    max_tokens: int


async def prepare_tree_turn(
    store: SessionStore, meta: SessionMeta, model: SessionModel, request: ChatCompletionRequest, limits: TreeLimits
) -> TreeTurnPlan:
    """Phase 1 of a tree turn (module docstring)."""
    if await store.get_meta(meta.session_id) is None:
        raise SessionNotFoundError(f"session {meta.session_id} does not exist (deleted or expired)")
    tree = SessionTree(await store.load_tree(meta.session_id))
    stats = tree.stats()
    if stats.num_nodes >= limits.max_nodes or stats.num_tree_tokens >= limits.max_tokens:
        raise TreeFullError(
            f"session {meta.session_id} holds {stats.num_nodes} nodes and {stats.num_tree_tokens} token ids; the "
            f"server's bounds are max_tree_nodes={limits.max_nodes} and max_tree_tokens={limits.max_tokens}: start a "
            "new session",
            details={"num_nodes": stats.num_nodes, "num_tree_tokens": stats.num_tree_tokens},
        )
    parent = find_parent(tree, meta.session_id, request.messages, request.parent_node_id)
    parent_ids: list[int] = []
    if parent is not None:
        path = tree.path(parent.node_id)
        parent_ids = path_buffer(path, await store.load_tree_ids(meta.session_id, [n.node_id for n in path]))
    plan = plan_tree_turn(
        model.tito,
        tree,
        parent,
        parent_ids,
        request.messages,
        request_tools=request.tools,
        chat_template_kwargs=request.chat_template_kwargs,
    )
    return dataclasses.replace(plan, num_tree_tokens=stats.num_tree_tokens)


def check_tree_room(
    session_id: str, plan: TreeTurnPlan, num_prompt_tokens: int, max_new_tokens: int | None, limits: TreeLimits
) -> None:
    """Refuse, before the engine runs, a turn whose node could take the tree past max_tree_tokens: its new prompt
    ids plus the most it may generate (1 when nothing limits the completion). Without this a tree a few hundred
    ids below the bound would answer every later turn unrecorded (`tree_full` at commit), generating for nothing,
    and never 409."""
    num_new_ids = num_prompt_tokens - plan.keep_len + (max_new_tokens if max_new_tokens is not None else 1)
    if plan.num_tree_tokens + num_new_ids > limits.max_tokens:
        raise TreeFullError(
            f"session {session_id} holds {plan.num_tree_tokens} token ids and this turn could add {num_new_ids} "
            f"(its new prompt ids and max_tokens); the server's bound is max_tree_tokens={limits.max_tokens}: "
            "start a new session, or ask for fewer tokens",
            details={"num_tree_tokens": plan.num_tree_tokens, "num_new_token_ids": num_new_ids},
        )


def tree_commit(
    meta: SessionMeta,
    plan: TreeTurnPlan,
    prompt_ids: list[int],
    completion: Completion,
    message: Json,
    *,
    limits: TreeLimits,
    routing_start_row: int | None,
    routing_chunk: bytes | None,
) -> TreeCommit:
    """The node phase 3 adds: its record (turn_index = depth - 1, lengths along its path) and its own ids."""
    record = completion.record(
        turn_index=plan.depth - 1,
        prompt_len=len(prompt_ids),
        num_trimmed_tokens=plan.prompt.num_trimmed_tokens,
        messages_end=len(plan.base_messages) + len(plan.appended) + 1,
        routing_start_row=routing_start_row,
    )
    delta_ids = prompt_ids[plan.keep_len :] + completion.output_ids
    node = TreeNode(
        node_id=uuid.uuid4().hex[:16],
        parent_id=plan.parent.node_id if plan.parent is not None else None,
        depth=plan.depth,
        keep_len=plan.keep_len,
        num_delta_tokens=len(delta_ids),
        messages=[*plan.appended, message],
        tools=plan.tools,
        record=record,
        compaction=plan.compaction,
    )
    return TreeCommit(node, delta_ids, meta.ttl_s, limits.max_nodes, limits.max_tokens, routing_chunk)


def tree_fields(plan: TreeTurnPlan, commit: TreeCommit, outcome: CommitOutcome) -> Json:
    """What the response's `miles` object says about the turn's place in the tree."""
    return {
        "node_id": commit.node.node_id if outcome is CommitOutcome.COMMITTED else None,
        "parent_node_id": commit.node.parent_id,
        "tree_depth": plan.depth,
        "new_root": plan.parent is None,
        "compaction": plan.compaction,
    }
