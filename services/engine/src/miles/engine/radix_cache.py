"""A radix tree of token-id sequences whose nodes hold the KV of their tokens, with SGLang's semantics.

- Keys are token ids (page size 1), namespaced by `extra_key` (sequences of different namespaces never share).
- `match(tokens, limit)` returns the longest cached prefix of tokens[:limit]; a partial match inside a node
  splits it, so the match ends on a node boundary; every node on the path is marked as just used.
- `lock(node)` protects a matched path from eviction while a request uses it (reference counts on the node and
  its ancestors); `unlock` releases it.
- `insert(tokens, kv_of)` adds a finished request's tokens; only the part not yet cached asks `kv_of(start, end)`
  for its KV (a `KVBlock`, or None in fake-model mode).
- `evict(num_tokens)` removes least-recently-used unlocked leaves (whole nodes) until enough tokens are freed.
- `flush()` empties the tree. Locked nodes cannot be freed while their request runs: they are detached (never
  matched again) and their tokens stay counted in `num_detached_tokens` until unlocked. `drop_namespaces(keep)`
  does the same to the namespaces `keep` rejects (an unloaded LoRA adapter's entries).
- Namespaces are `CacheNamespace` values: a request's `extra_key` (str or None) for the base model, a tuple
  (adapters.lora_namespace) for a LoRA adapter, so that no extra_key can name an adapter's namespace.

`cached_tokens_limit` is SGLang's cap on the match (§7.2 of the protocol reference). Not thread-safe: only the
scheduler thread calls it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Splittable(Protocol):
    def split_at(self, num_tokens: int) -> tuple[Any, Any]: ...


KVOf = Callable[[int, int], Any]
CacheNamespace = str | tuple[str | None, ...] | None
"""Sequences of different namespaces never share cached prefixes."""


def cached_tokens_limit(num_prompt_tokens: int, return_logprob: bool, logprob_start_len: int) -> int:
    """How many leading prompt tokens may come from the cache: at least one token is computed, and input
    logprobs from logprob_start_len on need recomputation."""
    limit = num_prompt_tokens - 1
    if return_logprob and logprob_start_len >= 0:
        limit = min(limit, logprob_start_len)
    return max(limit, 0)


class _Node:
    __slots__ = ("attached", "children", "key", "kv", "last_access", "lock_ref", "parent")

    def __init__(self, key: tuple[int, ...], kv: Any, parent: _Node | None, last_access: int) -> None:
        self.key = key
        self.kv = kv
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.lock_ref = 0
        self.last_access = last_access
        self.attached = True


@dataclass(frozen=True)
class PrefixMatch:
    """`length` cached tokens; `node` is the deepest matched node (None for an empty match); `kv_blocks` are the
    KV payloads of the path in order."""

    length: int
    node: _Node | None
    kv_blocks: tuple[Any, ...]


class RadixCache:
    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._clock = itertools.count(1)
        self._roots: dict[CacheNamespace, _Node] = {}
        self.num_tokens = 0
        self.num_locked_tokens = 0
        self.num_detached_tokens = 0
        self.num_evicted_tokens = 0

    @property
    def num_evictable_tokens(self) -> int:
        return self.num_tokens - self.num_locked_tokens

    def _root(self, namespace: CacheNamespace) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node((), None, None, 0)
        return root

    def match(self, tokens: Sequence[int], limit: int, namespace: CacheNamespace = None) -> PrefixMatch:
        if not self.enabled or limit <= 0:
            return PrefixMatch(0, None, ())
        key = tuple(tokens[:limit])
        node = self._root(namespace)
        position = 0
        blocks: list[Any] = []
        now = next(self._clock)
        while position < len(key):
            child = node.children.get(key[position])
            if child is None:
                break
            shared = _shared_prefix_len(child.key, key, position)
            if shared < len(child.key):
                child = self._split(child, shared)
            child.last_access = now
            blocks.append(child.kv)
            position += shared
            node = child
        return PrefixMatch(position, None if position == 0 else node, tuple(blocks))

    def lock(self, node: _Node | None) -> None:
        while node is not None and node.parent is not None:
            if node.lock_ref == 0 and node.attached:
                self.num_locked_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: _Node | None) -> None:
        while node is not None and node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                if node.attached:
                    self.num_locked_tokens -= len(node.key)
                else:
                    self.num_detached_tokens -= len(node.key)
            node = node.parent

    def insert(self, tokens: Sequence[int], kv_of: KVOf, namespace: CacheNamespace = None) -> int:
        """Cache `tokens`; returns how many leading tokens were already cached."""
        if not self.enabled or not tokens:
            return 0
        key = tuple(tokens)
        node = self._root(namespace)
        position = 0
        now = next(self._clock)
        while position < len(key):
            child = node.children.get(key[position])
            if child is None:
                new = _Node(key[position:], kv_of(position, len(key)), node, now)
                node.children[key[position]] = new
                self.num_tokens += len(new.key)
                return position
            shared = _shared_prefix_len(child.key, key, position)
            if shared < len(child.key):
                child = self._split(child, shared)
            child.last_access = now
            position += shared
            node = child
        return position

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens (if that many are evictable) from least recently used leaves."""
        leaves = [(n.last_access, id(n), n) for n in self._all_nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.num_tokens -= len(leaf.key)
            freed += len(leaf.key)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        self.num_evicted_tokens += freed
        return freed

    def flush(self) -> None:
        self.drop_namespaces(lambda namespace: False)

    def drop_namespaces(self, keep: Callable[[CacheNamespace], bool]) -> int:
        """Remove every namespace for which `keep` is false (locked nodes are detached, as by flush); returns the
        number of tokens removed."""
        dropped = [namespace for namespace in self._roots if not keep(namespace)]
        removed = 0
        for node in self._all_nodes(dropped):
            node.attached = False
            removed += len(node.key)
            if node.lock_ref > 0:
                self.num_detached_tokens += len(node.key)
                self.num_locked_tokens -= len(node.key)
        for namespace in dropped:
            del self._roots[namespace]
        self.num_tokens -= removed
        return removed

    def _all_nodes(self, namespaces: Sequence[CacheNamespace] | None = None) -> list[_Node]:
        nodes: list[_Node] = []
        roots = self._roots.values() if namespaces is None else [self._roots[n] for n in namespaces]
        stack = [child for root in roots for child in root.children.values()]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut child's key at `at`: a new node takes key[:at] and becomes child's parent; returns it."""
        parent = child.parent
        assert parent is not None
        head_kv, tail_kv = (None, None) if child.kv is None else child.kv.split_at(at)
        head = _Node(child.key[:at], head_kv, parent, child.last_access)
        head.lock_ref = child.lock_ref
        parent.children[child.key[0]] = head
        child.key = child.key[at:]
        child.kv = tail_kv
        child.parent = head
        head.children[child.key[0]] = child
        return head


def _shared_prefix_len(node_key: tuple[int, ...], key: tuple[int, ...], start: int) -> int:
    limit = min(len(node_key), len(key) - start)
    i = 0
    while i < limit and node_key[i] == key[start + i]:
        i += 1
    return i
