"""The prefix tree: per-tenant matches, node splits, LRU eviction by token budget, text/ids namespaces."""

from __future__ import annotations

from miles.router.radix import RadixTree, common_prefix_bytes, encode_text, encode_token_ids, num_units


def ids(*values: int) -> bytes:
    encoded = encode_token_ids(list(values))
    assert encoded is not None
    return encoded


def test_common_prefix_is_counted_in_whole_tokens() -> None:
    a, b = ids(1, 2, 3, 4), ids(1, 2, 3, 0x0104)  # last tokens share their low byte
    assert common_prefix_bytes(a, b, 0) == 12
    assert common_prefix_bytes(a, ids(9, 1, 2), 4) == 8
    assert common_prefix_bytes(a, a, 0) == 16
    assert common_prefix_bytes(b"", a, 0) == 0


def test_match_reports_each_tenants_longest_prefix() -> None:
    tree = RadixTree()
    tree.insert(ids(1, 2, 3, 4, 5), "a")
    tree.insert(ids(1, 2, 3, 9), "b")
    assert tree.match(ids(1, 2, 3, 4, 5, 6)) == {"a": 5, "b": 3}
    assert tree.match(ids(1, 2, 3, 9, 9)) == {"a": 3, "b": 4}
    assert tree.match(ids(1, 2)) == {"a": 2, "b": 2}
    assert tree.match(ids(7)) == {}
    assert tree.tenant_units("a") == 5
    assert tree.tenant_units("b") == 4  # shares 3 units with a, owns its own copy of the count


def test_key_ending_inside_a_node_splits_it() -> None:
    tree = RadixTree()
    tree.insert(ids(1, 2, 3, 4), "a")
    tree.insert(ids(1, 2), "b")
    assert tree.match(ids(1, 2, 3, 4)) == {"a": 4, "b": 2}
    assert tree.tenant_units("a") == 4
    assert tree.tenant_units("b") == 2


def test_text_keys_never_match_token_ids() -> None:
    tree = RadixTree()
    tree.insert(encode_text("hello"), "a")
    assert tree.match(ids(ord("h"), ord("e"))) == {}
    assert tree.match(encode_text("help")) == {"a": 4}  # marker + "hel"
    assert num_units(encode_text("hello")) == 6


def test_invalid_token_ids_are_not_encoded() -> None:
    assert encode_token_ids([-1]) is None
    assert encode_token_ids([2**32]) is None
    assert encode_token_ids([0xFFFFFFFF]) is None  # reserved for the text marker
    assert encode_token_ids(["a"]) is None  # type: ignore[list-item]


def test_eviction_drops_least_recently_used_leaves_down_to_budget() -> None:
    tree = RadixTree()
    tree.insert(ids(1, 1, 1, 1), "a")  # oldest
    tree.insert(ids(2, 2, 2, 2), "a")
    tree.insert(ids(3, 3, 3, 3), "a")  # newest
    tree.insert(ids(1, 1, 1, 1), "b")
    freed = tree.evict("a", max_units=10, evict_to_fraction=0.9)
    assert freed == 4
    assert tree.tenant_units("a") == 8
    assert "a" not in tree.match(ids(1, 1, 1, 1))
    assert tree.match(ids(1, 1, 1, 1)) == {"b": 4}  # another tenant's entry survives
    assert tree.match(ids(3, 3, 3, 3)) == {"a": 4}


def test_eviction_walks_up_from_leaves_and_refreshes_on_insert() -> None:
    tree = RadixTree()
    tree.insert(ids(1, 2, 3, 4), "a")
    tree.insert(ids(1, 2, 5, 6), "a")
    tree.insert(ids(1, 2, 3, 4), "a")  # refresh: 1-2-5-6 is now the least recently used
    tree.evict("a", max_units=5, evict_to_fraction=1.0)
    assert tree.match(ids(1, 2, 3, 4)) == {"a": 4}
    assert tree.match(ids(1, 2, 5, 6)) == {"a": 2}
    tree.evict("a", max_units=1, evict_to_fraction=0.0)
    assert tree.tenant_units("a") == 0
    assert tree.match(ids(1, 2, 3, 4)) == {}


def test_remove_tenant_keeps_other_tenants() -> None:
    tree = RadixTree()
    tree.insert(ids(1, 2, 3), "a")
    tree.insert(ids(1, 2, 4), "b")
    tree.remove_tenant("a")
    assert tree.match(ids(1, 2, 3)) == {"b": 2}
    assert tree.tenant_units("a") == 0
    assert tree.tenants() == ["b"]
