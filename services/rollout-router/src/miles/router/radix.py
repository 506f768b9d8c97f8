"""An approximate multi-tenant radix tree of token sequences: which engine (tenant) probably caches which prefix.

Like the SGLang router's tree (docs/sglang-protocol.md §6.4) but over token ids instead of characters: a compressed
trie whose nodes record, per tenant, the tick of its last use. A tenant present on a node is present on every
ancestor, so walking down a key gives each tenant's matched length at once. Eviction is LRU per tenant by a token
budget: the tenant's least recently used leaves go first, down to `evict_to_fraction` of the budget (hysteresis,
so the scan that finds leaves runs rarely).

Keys are `bytes` of 4-byte little-endian units (`encode_token_ids`), which keeps memory at 4 bytes per token
and makes prefix comparison run in C. Text prompts are keyed as one marker unit followed by their code points
(`encode_text`), so text never matches token ids. A LoRA adapter's prompts are keyed behind a header naming the
adapter (`encode_namespace`): engines never share KV across adapters or with the base model (SGLang folds the
adapter into the radix cache's extra key), so neither does the tree. Lengths and budgets are in units (tokens, or
characters; a header's units count too).

Limits: an approximation of the engine's real cache (it cannot see evictions the engine makes); no locking
(one event loop).
"""

from __future__ import annotations

import array
import heapq
import itertools
from collections.abc import Iterable, Iterator, Sequence

UNIT_BYTES = 4
_TEXT_MARKER = b"\xff\xff\xff\xff"
_NAMESPACE_MARKER = b"\xfe\xff\xff\xff"
_MARKER_IDS = (0xFFFFFFFF, 0xFFFFFFFE)
if array.array("I").itemsize != UNIT_BYTES:  # pragma: no cover - true on every platform we build for
    raise ImportError("miles.router.radix needs a 4-byte array('I')")


def encode_token_ids(token_ids: Sequence[int]) -> bytes | None:
    """Token ids as a tree key, or None when an id is not an integer in [0, 2**32 - 2) (the two highest values
    are the markers of text and of adapter namespaces)."""
    try:
        encoded = array.array("I", token_ids).tobytes()
    except (OverflowError, TypeError):
        return None
    if any(marker in token_ids for marker in _MARKER_IDS):
        return None
    return encoded


def encode_text(text: str) -> bytes:
    """A text prompt as a tree key: a marker unit, then one unit per code point."""
    return _TEXT_MARKER + encode_code_points(text)


def encode_code_points(text: str) -> bytes:
    """One unit per code point (a lone surrogate, which JSON text may carry, is a unit like any other)."""
    return text.encode("utf-32-le", "surrogatepass")


def encode_namespace(lora_path: str) -> bytes:
    """The header of an adapter's keys: the namespace marker, the adapter name's code points, the marker again.
    A name's code points never equal the marker, so one header is never a prefix of another's, and keys without a
    header (the base model's) start with a token id or the text marker, never with it."""
    return _NAMESPACE_MARKER + encode_code_points(lora_path) + _NAMESPACE_MARKER


def num_units(key: bytes) -> int:
    return len(key) // UNIT_BYTES


def common_prefix_bytes(a: bytes, b: bytes, b_start: int) -> int:
    """Length in bytes (a multiple of UNIT_BYTES) of the common prefix of `a` and `b[b_start:]`."""
    limit = min(len(a), len(b) - b_start)
    if limit <= 0:
        return 0
    if a[:limit] == b[b_start : b_start + limit]:
        return limit
    diff = int.from_bytes(a[:limit], "little") ^ int.from_bytes(b[b_start : b_start + limit], "little")
    first_diff_byte = ((diff & -diff).bit_length() - 1) // 8
    return first_diff_byte - first_diff_byte % UNIT_BYTES


class _Node:
    __slots__ = ("children", "key", "parent", "tenants")

    def __init__(self, key: bytes, parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[bytes, _Node] = {}
        self.tenants: dict[str, int] = {}


class RadixTree:
    """Prefix tree of token-unit keys with per-tenant LRU accounting."""

    def __init__(self) -> None:
        self._root = _Node(b"", None)
        self._tick = itertools.count(1)
        self._tenant_units: dict[str, int] = {}

    def tenant_units(self, tenant: str) -> int:
        """Units (tokens or characters) the tree attributes to a tenant."""
        return self._tenant_units.get(tenant, 0)

    def tenants(self) -> list[str]:
        return list(self._tenant_units)

    def match(self, key: bytes) -> dict[str, int]:
        """Matched length in units of `key` for every tenant that shares at least one unit of it."""
        matched: dict[str, int] = {}
        node, pos = self._root, 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + UNIT_BYTES])
            if child is None:
                break
            shared = common_prefix_bytes(child.key, key, pos)
            for tenant in child.tenants:
                matched[tenant] = (pos + shared) // UNIT_BYTES
            if shared < len(child.key):
                break
            pos += shared
            node = child
        return matched

    def insert(self, key: bytes, tenant: str) -> None:
        """Record that `tenant` caches `key` (and so each of its prefixes); refreshes the whole path's LRU tick."""
        tick = next(self._tick)
        node, pos = self._root, 0
        while pos < len(key):
            first = key[pos : pos + UNIT_BYTES]
            child = node.children.get(first)
            if child is None:
                child = _Node(key[pos:], node)
                node.children[first] = child
            else:
                shared = common_prefix_bytes(child.key, key, pos)
                if shared < len(child.key):
                    child = self._split(child, shared)
            if tenant not in child.tenants:
                self._tenant_units[tenant] = self._tenant_units.get(tenant, 0) + num_units(child.key)
            child.tenants[tenant] = tick
            pos += len(child.key)
            node = child

    def evict(self, tenant: str, max_units: int, evict_to_fraction: float = 0.9) -> int:
        """When the tenant holds more than max_units, drop its LRU leaves down to the fraction; returns units freed."""
        size = self._tenant_units.get(tenant, 0)
        if size <= max_units:
            return 0
        target = int(max_units * evict_to_fraction)
        heap = [(node.tenants[tenant], id(node), node) for node in self._leaves_of(tenant)]
        heapq.heapify(heap)
        freed = 0
        while heap and size - freed > target:
            _, _, node = heapq.heappop(heap)
            freed += self._detach(node, tenant)
            parent = node.parent
            if parent is not None and parent is not self._root and self._is_leaf_of(parent, tenant):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))
        return freed

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything about a tenant (engine removed, restarted or reloaded weights)."""
        for node in sorted(self._nodes_of(tenant), key=self._depth, reverse=True):
            self._detach(node, tenant)
        self._tenant_units.pop(tenant, None)

    def _split(self, child: _Node, shared: int) -> _Node:
        """Cut `child` after `shared` bytes; the upper part (returned) inherits its tenants."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.key[:shared], parent)
        upper.tenants = dict(child.tenants)
        parent.children[child.key[:UNIT_BYTES]] = upper
        child.key = child.key[shared:]
        child.parent = upper
        upper.children[child.key[:UNIT_BYTES]] = child
        return upper

    def _detach(self, node: _Node, tenant: str) -> int:
        """Remove a tenant from a node (a leaf for it); deletes the node once no tenant uses it."""
        if node.tenants.pop(tenant, None) is None:
            return 0
        units = num_units(node.key)
        self._tenant_units[tenant] = self._tenant_units.get(tenant, 0) - units
        if not node.tenants and not node.children and node.parent is not None:
            del node.parent.children[node.key[:UNIT_BYTES]]
        return units

    def _nodes_of(self, tenant: str) -> Iterator[_Node]:
        stack = [child for child in self._root.children.values() if tenant in child.tenants]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(child for child in node.children.values() if tenant in child.tenants)

    def _leaves_of(self, tenant: str) -> Iterable[_Node]:
        return [node for node in self._nodes_of(tenant) if self._is_leaf_of(node, tenant)]

    @staticmethod
    def _is_leaf_of(node: _Node, tenant: str) -> bool:
        return tenant in node.tenants and not any(tenant in child.tenants for child in node.children.values())

    @staticmethod
    def _depth(node: _Node) -> int:
        depth = 0
        while node.parent is not None:
            node = node.parent
            depth += 1
        return depth
