"""Acceptance: a tree session's forks share one engine's prefix cache, and its samples are exact, through the real
stack — two `miles-engine` processes with the tiny Qwen3 model (real Qwen3 tokenizer), the rollout router in front
of them (session_affinity), the session server on Redis — all real subprocesses.

One tree session: a first turn whose prompt is ~2K tokens (a long system message of varied text), then 8 forks
(8 different user follow-ups after the first reply) sent at once. Checked against what the engines and the router
report themselves, not the session server alone:
- every generate request of the session reached one engine (each engine's own finished-request counter, and the
  router's per-engine attempts): the session id is the routing key;
- every fork was served the first turn's prompt from that engine's prefix cache (`cached_tokens`);
- one sample per leaf, each starting with the first turn's prompt + completion ids (the prompt a fresh render of
  the first turn's messages by Hugging Face's Qwen3 chat template), TITO critical 0, and the tree statistics count
  the shared prefix once: num_path_tokens - num_tree_tokens = 7 x the shared prefix.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

NUM_FORKS = 8
NUM_SENTENCES = 106
"""Sentences of the system message: ~2,000 tokens of the Qwen3 tokenizer with the first turn's template."""
FIRST_MAX_TOKENS, FORK_MAX_TOKENS = 16, 8
CHAT_TEMPLATE_KWARGS = {"enable_thinking": False}
_SUBJECTS = ("The build cache", "A worker", "The scheduler", "Our tokenizer", "The nightly job", "A reviewer",
             "The router", "Each replica")  # fmt: skip
_VERBS = ("rejected", "compacted", "retried", "measured", "forwarded", "annotated", "evicted", "replayed")
_OBJECTS = ("the lock file", "three stale shards", "a batch of prompts", "the weight snapshot",
            "every queued request", "the audit log", "a partial checkpoint", "the metrics scrape")  # fmt: skip
_TAILS = ("before noon", "after a timeout of {n} seconds", "on host node-{n}", "in region eu-{n}",
          "while step {n} ran", "at version {n}", "despite {n} warnings", "for ticket #{n}")  # fmt: skip


@pytest.fixture(scope="module")
def stack_options(make_stack_options: Any) -> Any:
    return make_stack_options(engine="tiny", num_engines=2, sandbox=False)


def incident_log(seed: int, num_sentences: int) -> str:
    """Varied English with numbers (no repeated block the tokenizer could compress)."""
    rng = random.Random(seed)
    return " ".join(
        f"{i + 1}. {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
        f"{rng.choice(_TAILS).format(n=rng.randint(2, 9999))}."
        for i in range(num_sentences)
    )


def metric_total(metrics_text: str, sample_name: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name == sample_name
    )


def engine_counters(engine_urls: list[str]) -> dict[str, tuple[float, float]]:
    """Each engine's own (finished requests, prompt tokens served from its prefix cache): SGLang's `num_requests`
    (health probes are not counted) and `cached_tokens`."""
    counters: dict[str, tuple[float, float]] = {}
    for url in engine_urls:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        num_cached = metric_total(text, "sglang:cached_tokens_total")
        counters[url] = (metric_total(text, "sglang:num_requests_total"), num_cached)
    return counters


def router_ok_attempts(router_url: str) -> dict[str, float]:
    """The router's successful attempts per engine URL."""
    text = httpx.get(f"{router_url}/metrics", timeout=30).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "miles_router_engine_requests_total" and sample.labels.get("outcome") == "ok":
                found[sample.labels["engine"]] = found.get(sample.labels["engine"], 0.0) + sample.value
    return found


async def chat(
    client: httpx.AsyncClient, sid: str, auth: dict[str, str], messages: list[Any], max_tokens: int
) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 1.0}
    response = await client.post(f"/v1/sessions/{sid}/v1/chat/completions", json=body, headers=auth)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


async def samples(client: httpx.AsyncClient, sid: str, auth: dict[str, str], mode: str) -> dict[str, Any]:
    response = await client.post(f"/v1/sessions/{sid}/samples", json={"mode": mode}, headers=auth)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


async def run_forked_episode(stack: Any) -> dict[str, Any]:
    """The first turn, then NUM_FORKS concurrent follow-ups after its reply; both kinds of samples of the tree."""
    first_messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You triage incidents. Incident log:\n" + incident_log(7, NUM_SENTENCES)},
        {"role": "user", "content": "Which component failed first?"},
    ]
    operator = {"authorization": f"Bearer {stack.operator_token}"}
    async with httpx.AsyncClient(base_url=stack.session_url, timeout=300) as client:
        created = await client.post(
            "/v1/sessions", json={"tree": True, "chat_template_kwargs": CHAT_TEMPLATE_KWARGS}, headers=operator
        )
        assert created.status_code == 201, created.text
        sid, auth = created.json()["session_id"], {"authorization": f"Bearer {created.json()['token']}"}
        first = await chat(client, sid, auth, first_messages, FIRST_MAX_TOKENS)
        history = [*first_messages, first["choices"][0]["message"]]
        follow_ups = [f"Follow-up {i}: what should on-call check about item {10 * i + 3}?" for i in range(NUM_FORKS)]
        forks = await asyncio.gather(
            *(
                chat(client, sid, auth, [*history, {"role": "user", "content": text}], FORK_MAX_TOKENS)
                for text in follow_ups
            )
        )
        per_turn = await samples(client, sid, auth, "per_turn")
        merged = await samples(client, sid, auth, "merge")
    return {"first_messages": first_messages, "first": first, "forks": forks, "per_turn": per_turn, "merged": merged}


def fresh_render(model_dir: Path, messages: list[dict[str, Any]]) -> list[int]:
    """Hugging Face's render of the first turn's prompt (the model's own Qwen3 chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False, enable_thinking=False
    )
    return [int(token) for token in cast(list[int], ids)]


def test_eight_forks_of_a_2k_prefix_hit_one_engine_cache_and_give_exact_leaf_samples(stack: Any) -> None:
    engines_before, router_before = engine_counters(stack.engine_urls), router_ok_attempts(stack.router_url)
    episode = asyncio.run(run_forked_episode(stack))
    engines_after, router_after = engine_counters(stack.engine_urls), router_ok_attempts(stack.router_url)
    first, forks = episode["first"], episode["forks"]

    # (a) one engine served all 9 generate requests (the routing key is the session id).
    served = {url: engines_after[url][0] - engines_before[url][0] for url in stack.engine_urls}
    assert sorted(served.values()) == [0.0, float(1 + NUM_FORKS)], served
    routed = {url: router_after.get(url, 0.0) - router_before.get(url, 0.0) for url in stack.engine_urls}
    assert routed == served

    # (b) every fork was served the first turn (~2K prompt tokens + completion) from that engine's prefix cache:
    # all of it but the last sampled token, which never went through the model.
    num_first_prompt = first["usage"]["prompt_tokens"]
    num_shared = num_first_prompt + first["usage"]["completion_tokens"]
    assert 1_800 <= num_first_prompt <= 2_300, num_first_prompt
    root_id = first["miles"]["tree"]["node_id"]
    for fork in forks:
        assert fork["miles"]["tree"]["parent_node_id"] == root_id and fork["miles"]["tree"]["tree_depth"] == 2
        assert fork["usage"]["prompt_tokens_details"]["cached_tokens"] >= num_shared - 1, fork["usage"]
    num_engine_cached = sum(engines_after[url][1] - engines_before[url][1] for url in stack.engine_urls)
    assert num_engine_cached == sum(turn["usage"]["prompt_tokens_details"]["cached_tokens"] for turn in [first, *forks])
    fork_ids = {fork["miles"]["tree"]["node_id"] for fork in forks}
    assert len(fork_ids) == NUM_FORKS

    # (c) one exact sample per leaf, each starting with the first turn's prompt + completion ids.
    (root_sample,) = (s for s in episode["per_turn"]["samples"] if s["metadata"]["tree_node_id"] == root_id)
    root_tokens = [int(token) for token in root_sample["tokens"]]
    assert len(root_tokens) == num_shared and root_sample["response_start"] == num_first_prompt
    assert root_tokens[:num_first_prompt] == fresh_render(stack.model_dir, episode["first_messages"])
    leaf_samples = episode["merged"]["samples"]
    assert {s["metadata"]["tree_node_id"] for s in leaf_samples} == fork_ids
    for sample in leaf_samples:
        assert [int(token) for token in sample["tokens"][:num_shared]] == root_tokens
        assert sample["rollout_logprobs"][: num_shared - num_first_prompt] == root_sample["rollout_logprobs"]
        assert sample["metadata"]["tito_num_critical"] == 0
    stats = episode["merged"]["session_metadata"]["tree"]
    assert (stats["num_nodes"], stats["num_leaves"]) == (1 + NUM_FORKS, NUM_FORKS)
    assert stats["num_path_tokens"] == sum(len(s["tokens"]) for s in leaf_samples)
    assert stats["num_path_tokens"] - stats["num_tree_tokens"] == (NUM_FORKS - 1) * num_shared
