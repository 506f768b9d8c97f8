"""Routing policies on engines without sockets: session_affinity, cache_aware, least_load, round_robin."""

from __future__ import annotations

from collections import Counter
from typing import Any

from miles.router.policies import StickyOutcome


def test_session_affinity_sticks_and_places_new_keys_on_least_loaded(make_pool: Any, make_routing: Any) -> None:
    _, pool, engines = make_pool(3)
    engines[0].slots.num_in_flight = 5
    engines[1].slots.num_in_flight = 1
    first = pool.select(make_routing("s1"))
    assert first.sticky is StickyOutcome.NEW and first.engine is engines[2]
    engines[2].slots.num_in_flight = 9  # the sticky engine is now the busiest: the session still sticks
    again = pool.select(make_routing("s1"))
    assert again.sticky is StickyOutcome.HIT and again.engine is engines[2]
    assert pool.select(make_routing("s2")).engine is engines[1]
    assert pool.policy.num_sticky_keys(engines[2].url) == 1


def test_new_keys_spread_when_loads_are_equal(make_pool: Any, make_routing: Any) -> None:
    _, pool, engines = make_pool(4)
    counts = Counter(pool.select(make_routing(f"s{i}")).engine.url for i in range(400))
    assert set(counts) == {engine.url for engine in engines}


def test_dead_sticky_engine_moves_its_sessions_as_misses(make_pool: Any, make_routing: Any) -> None:
    _, pool, engines = make_pool(3)
    homes = {f"s{i}": pool.select(make_routing(f"s{i}")).engine for i in range(60)}
    dead = engines[0]
    dead.health.force(False)
    outcomes: Counter[StickyOutcome | None] = Counter()
    for key, home in homes.items():
        selection = pool.select(make_routing(key))
        outcomes[selection.sticky] += 1
        assert selection.engine is not dead
        if home is not dead:
            assert selection.engine is home
    moved = sum(1 for home in homes.values() if home is dead)
    assert moved > 0
    assert outcomes[StickyOutcome.MISS] == moved
    assert outcomes[StickyOutcome.HIT] == len(homes) - moved
    dead.health.force(True)  # it comes back: moved sessions stay where they re-prefilled
    assert all(pool.select(make_routing(key)).engine is not dead for key, home in homes.items() if home is dead)


def test_rehoming_spreads_a_lost_engines_sessions(make_pool: Any, make_routing: Any) -> None:
    _, pool, engines = make_pool(4)
    keys = [f"s{i}" for i in range(200)]
    for key in keys:
        pool.select(make_routing(key))
    lost = [key for key in keys if pool.policy.sticky_engine_url(key) == engines[0].url]
    pool.remove(engines[0].url)
    for key in lost:
        lease_engine = pool.select(make_routing(key)).engine
        lease_engine.slots.num_in_flight += 1  # they stay in flight: the bound must spread them
    new_homes = Counter(pool.policy.sticky_engine_url(key) for key in lost)
    assert len(new_homes) == 3


def test_sticky_keys_expire_when_idle_and_beyond_max(make_pool: Any, make_routing: Any, clock: Any) -> None:
    _, pool, _ = make_pool(2, clock=clock, sticky_idle_s=10.0, sticky_max_keys=2)
    assert pool.select(make_routing("a")).sticky is StickyOutcome.NEW
    clock.now_s += 11
    assert pool.select(make_routing("a")).sticky is StickyOutcome.NEW
    pool.select(make_routing("b"))
    pool.select(make_routing("c"))  # 3 keys > max 2: "a" (least recently used) is forgotten
    assert pool.policy.sticky_engine_url("a") is None
    assert pool.select(make_routing("c")).sticky is StickyOutcome.HIT


def test_hash_placement_is_deterministic_across_pools(make_pool: Any, make_routing: Any) -> None:
    _, pool_a, _ = make_pool(4, new_key_placement="hash")
    _, pool_b, _ = make_pool(4, new_key_placement="hash")
    for i in range(50):
        assert pool_a.select(make_routing(f"s{i}")).engine.url == pool_b.select(make_routing(f"s{i}")).engine.url


def test_prefix_placement_groups_episodes_of_one_prompt(make_pool: Any, make_routing: Any) -> None:
    _, pool, _engines = make_pool(4, new_key_placement="prefix")
    prompt = list(range(100))
    first = pool.select(make_routing("episode-0", [*prompt, 1000])).engine
    for i in range(1, 4):
        selection = pool.select(make_routing(f"episode-{i}", [*prompt, 1000 + i]))
        assert selection.sticky is StickyOutcome.NEW and selection.branch == "prefix"
        assert selection.engine is first
    assert pool.policy.cache_tree_units(first.url) > 100


def test_prefix_placement_does_not_pile_new_sessions_on_a_shared_prefix(make_pool: Any, make_routing: Any) -> None:
    # Every session starts with the same system prompt: its holder is the longest match for every new key, but an
    # engine at or above its bounded-load share (ceil(1.25 * (total + 1) / engines)) takes no new key.
    _, pool, engines = make_pool(4, new_key_placement="prefix")
    system_prompt = list(range(400))
    placed = []
    for i in range(16):
        selection = pool.select(make_routing(f"task-{i}", [*system_prompt, 10_000 + i]))
        selection.engine.slots.num_in_flight += 1  # each session keeps a request in flight
        placed.append(selection.engine)
    counts = Counter(engine.url for engine in placed)
    assert len(counts) == 4 and max(counts.values()) <= 5  # the bound for 16 in flight over 4 engines
    assert all(engine.slots.num_in_flight == counts[engine.url] for engine in engines)


def test_request_without_key_is_not_remembered(make_pool: Any, make_routing: Any) -> None:
    _, pool, engines = make_pool(2)
    selection = pool.select(make_routing(None))
    assert selection.sticky is None
    assert sum(pool.policy.num_sticky_keys(engine.url) for engine in engines) == 0


def test_cache_aware_prefers_longest_prefix_above_threshold(make_pool: Any, make_routing: Any) -> None:
    _, pool, _engines = make_pool(3, policy="cache_aware", cache_threshold=0.5)
    conversation = list(range(1, 200))
    home = pool.select(make_routing(None, conversation)).engine
    # Next turn: the prompt extends the previous one; 199/260 > 0.5 matched.
    turn2 = pool.select(make_routing(None, conversation + list(range(500, 561))))
    assert turn2.engine is home and turn2.branch == "prefix"
    # Mostly new text (199/600 < 0.5): least-loaded, not the prefix holder.
    home.slots.num_in_flight = 3
    other = pool.select(make_routing(None, conversation + list(range(1000, 1401))))
    assert other.branch == "low_match" and other.engine is not home


def test_cache_aware_balances_when_load_is_imbalanced(make_pool: Any, make_routing: Any) -> None:
    _, pool, _engines = make_pool(2, policy="cache_aware", balance_abs_threshold=4, balance_rel_threshold=1.5)
    prompt = list(range(1, 100))
    home = pool.select(make_routing(None, prompt)).engine
    home.slots.num_in_flight = 10
    selection = pool.select(make_routing(None, [*prompt, 7]))
    assert selection.branch == "imbalanced" and selection.engine is not home
    # The prompt was still recorded for the chosen engine, as SGLang does.
    assert pool.policy.cache_tree_units(selection.engine.url) == 100


def test_cache_aware_spills_a_prefix_every_request_shares(make_pool: Any, make_routing: Any) -> None:
    # A system prompt that every task shares matches best on whichever engine saw it first; with 24 requests in
    # flight SGLang's imbalance rule (max - min > 64) never fires, so without the spill gate all would go there.
    _, pool, engines = make_pool(4, policy="cache_aware")
    system_prompt = list(range(400))
    for i in range(24):
        selection = pool.select(make_routing(None, [*system_prompt, 10_000 + i]))
        selection.engine.slots.num_in_flight += 1
    loads = sorted(engine.slots.num_in_flight for engine in engines)
    # A holder takes new work until its load exceeds the mean (6 at the end) by max(4, 2 * sqrt(mean)) and
    # 1.5 x the mean; then the least-loaded engine takes the request (and becomes a holder too).
    assert loads[-1] <= 11 and sum(1 for load in loads if load) >= 3, loads


def test_cache_aware_learns_output_tokens(make_pool: Any, make_routing: Any) -> None:
    from miles.router.radix import encode_token_ids

    _, pool, _engines = make_pool(2, policy="cache_aware", cache_threshold=0.9)
    prompt = list(range(1, 50))
    request = make_routing(None, prompt)
    home = pool.select(request).engine
    output = list(range(900, 960))
    pool.policy.on_response(home, request, encode_token_ids(output[:-1]))
    # Next turn = prompt + output + 5 new tokens: 108/114 matched thanks to the learned output.
    turn2 = pool.select(make_routing(None, prompt + output + [1, 2, 3, 4, 5]))
    assert turn2.branch == "prefix" and turn2.engine is home


def test_cache_aware_respects_tree_budget(make_pool: Any, make_routing: Any) -> None:
    _, pool, engines = make_pool(1, policy="cache_aware", cache_tree_max_tokens_per_engine=100)
    for i in range(10):
        pool.select(make_routing(None, [i * 1000 + j for j in range(30)]))
    assert pool.policy.cache_tree_units(engines[0].url) <= 100


def test_engine_reset_forgets_its_cache(make_pool: Any, make_routing: Any) -> None:
    _, pool, _engines = make_pool(2, policy="cache_aware")
    prompt = list(range(1, 100))
    home = pool.select(make_routing(None, prompt)).engine
    pool.record_version(home, 1, authoritative=True)  # new weights: the engine flushed its cache
    assert pool.policy.cache_tree_units(home.url) == 0


def test_least_load_and_round_robin(make_pool: Any, make_routing: Any) -> None:
    _, pool, engines = make_pool(3, policy="least_load")
    engines[0].slots.num_in_flight = 2
    engines[1].slots.num_in_flight = 2
    assert pool.select(make_routing()).engine is engines[2]
    engines[2].slots.num_in_flight = 2
    engines[0].slots.num_queued_tokens = 50  # same requests, more tokens
    assert pool.select(make_routing()).engine is not engines[0]
    _, rr_pool, rr_engines = make_pool(3, policy="round_robin")
    picks = [rr_pool.select(make_routing()).engine for _ in range(6)]
    assert picks == rr_engines + rr_engines


def test_cache_aware_never_counts_another_adapters_prefix_as_a_hit(make_pool: Any, make_request: Any) -> None:
    # Engines keep each LoRA adapter's KV apart (and apart from the base model's): the same prompt under another
    # adapter, another version of it, or none, must not be routed as a cache hit.
    _, pool, _engines = make_pool(3, policy="cache_aware", cache_threshold=0.5)
    prompt = list(range(1, 200))
    home = pool.select(make_request({"input_ids": prompt, "lora_path": "job-a@1"})).engine
    home.slots.num_in_flight = 1  # a miss goes to a less loaded engine
    for lora_path in ("job-b@1", "job-a@2", "job-a@10", None):
        selection = pool.select(make_request({"input_ids": prompt, "lora_path": lora_path}))
        assert selection.branch == "low_match" and selection.engine is not home, lora_path
    again = pool.select(make_request({"input_ids": [*prompt, 7], "lora_path": "job-a@1"}))
    assert again.branch == "prefix" and again.engine is home


def test_base_model_prefix_is_no_hit_for_an_adapter(make_pool: Any, make_request: Any) -> None:
    _, pool, _engines = make_pool(2, policy="cache_aware", cache_threshold=0.5)
    prompt = list(range(1, 200))
    home = pool.select(make_request({"input_ids": prompt})).engine
    home.slots.num_in_flight = 1
    adapter = pool.select(make_request({"input_ids": prompt, "lora_path": "job-a@1"}))
    assert adapter.branch == "low_match" and adapter.engine is not home
    assert pool.select(make_request({"input_ids": [*prompt, 7]})).engine is home


def test_an_adapters_other_prompts_are_no_hit(make_pool: Any, make_request: Any) -> None:
    # The adapter's header is shared by all its keys, but only the prompt counts in the match rate.
    _, pool, _engines = make_pool(2, policy="cache_aware", cache_threshold=0.3)
    home = pool.select(make_request({"input_ids": [1, 2, 3], "lora_path": "a-rather-long-job-name@12"})).engine
    home.slots.num_in_flight = 1
    other = pool.select(make_request({"input_ids": [4, 5, 6], "lora_path": "a-rather-long-job-name@12"}))
    assert other.branch == "low_match" and other.engine is not home


def test_prefix_placement_and_sticky_keys_are_per_adapter(make_pool: Any, make_request: Any) -> None:
    _, pool, _engines = make_pool(3, new_key_placement="prefix", cache_threshold=0.5)
    prompt = list(range(1, 200))
    first = pool.select(make_request({"input_ids": prompt, "lora_path": "job-a@1", "session_id": "s"}))
    assert first.sticky is StickyOutcome.NEW
    first.engine.slots.num_in_flight = 1
    for lora_path in ("job-b@1", None):  # the same session id under another adapter: another session
        other = pool.select(make_request({"input_ids": prompt, "lora_path": lora_path, "session_id": "s"}))
        assert other.sticky is StickyOutcome.NEW and other.branch == "low_match", lora_path
    turn2 = pool.select(make_request({"input_ids": [*prompt, 9], "lora_path": "job-a@1", "session_id": "s"}))
    assert turn2.sticky is StickyOutcome.HIT and turn2.engine is first.engine
