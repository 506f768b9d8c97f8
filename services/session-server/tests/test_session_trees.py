"""Tree sessions end to end in-process (scripted SGLang-protocol engine, the real Qwen3 tokenizer), on the memory
store and on a real Redis: forks, a retry deep in the history, compaction, concurrent branches, bounds, explicit
parents, roles; every path's samples are exact (TITO critical 0, tokens a prefix of a fresh render of the path)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.session.records import ModelConfig

pytestmark = pytest.mark.integration  # the redis cases start a redis-server


async def create(client: httpx.AsyncClient, operator_token: str, **body: Any) -> tuple[str, dict[str, str]]:
    response = await client.post("/v1/sessions", json=body, headers={"authorization": f"Bearer {operator_token}"})
    assert response.status_code == 201, response.text
    return response.json()["session_id"], {"authorization": f"Bearer {response.json()['token']}"}


async def chat(client: httpx.AsyncClient, sid: str, auth: dict[str, str], messages: list[Any], **kw: Any) -> Any:
    response = await client.post(
        f"/v1/sessions/{sid}/v1/chat/completions", json={"messages": messages, "max_tokens": 32, **kw}, headers=auth
    )
    return response


async def samples(client: httpx.AsyncClient, sid: str, auth: dict[str, str], **body: Any) -> dict[str, Any]:
    response = await client.post(f"/v1/sessions/{sid}/samples", json=body, headers=auth)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def reply(response: Any) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    message: dict[str, Any] = response.json()["choices"][0]["message"]
    return message


@pytest.fixture(params=["memory", "redis"])
def tree_app(request: pytest.FixtureRequest, make_session_app: Any) -> Callable[..., Any]:
    """make_session_app with tree sessions on, on both store backends."""
    overrides: dict[str, Any] = {}
    if request.param == "redis":
        overrides = {"store_backend": "redis", "redis_url": request.getfixturevalue("redis_url")}

    def start(upstream_url: str, **settings: Any) -> Any:
        return make_session_app(upstream_url, **{**overrides, **settings})

    return start


async def test_four_forks_from_one_prefix_give_four_exact_paths_sharing_ids_and_logprobs(
    tree_app: Any, scripted_engine: Any, operator_token: str, qwen3_model_dir: Path, shared_models: Any
) -> None:
    scripted_engine.script = ["Paris is in France.", "A.", "B.", "C.", "D."]
    config = ModelConfig(model_path=str(qwen3_model_dir), model_family="qwen3", engine_pool="pool-a")
    tito = (await shared_models.get(config)).tito
    async with tree_app(scripted_engine.url) as client:
        sid, auth = await create(client, operator_token, tree=True)
        history: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where?"}]
        first = await chat(client, sid, auth, history)
        root_id = first.json()["miles"]["tree"]["node_id"]
        history.append(reply(first))
        forks = [[*history, {"role": "user", "content": f"Option {i}?"}] for i in range(4)]
        answers = [await chat(client, sid, auth, fork) for fork in forks]
        assert {a.json()["miles"]["tree"]["parent_node_id"] for a in answers} == {root_id}
        pairs = zip(answers, forks, strict=True)
        paths = {a.json()["miles"]["tree"]["node_id"]: [*fork, reply(a)] for a, fork in pairs}
        merged = await samples(client, sid, auth, reward=1.0)
        per_turn = await samples(client, sid, auth, mode="per_turn")
        view = (await client.get(f"/v1/sessions/{sid}", headers=auth)).json()
    assert view["kind"] == "tree" and view["tree"]["stats"]["num_leaves"] == 4
    assert merged["session_metadata"]["tree"]["num_nodes"] == 5
    leaf_samples = {s["metadata"]["tree_node_id"]: s for s in merged["samples"]}
    assert set(leaf_samples) == set(paths)
    prompts = [r["body"]["input_ids"] for r in scripted_engine.requests]
    outputs = [r["output_ids"] for r in scripted_engine.responses]
    shared = len(prompts[0]) + len(outputs[0])
    order = [a.json()["miles"]["tree"]["node_id"] for a in answers]
    for node_id, sample in leaf_samples.items():
        tokens = [int(t) for t in sample["tokens"]]
        call = 1 + order.index(node_id)
        assert tokens == prompts[call] + outputs[call]  # exactly what the engine saw and sampled on this path
        assert tokens[:shared] == prompts[0] + outputs[0]  # the shared prefix, with the same ids ...
        first_turn = sample["rollout_logprobs"][: len(outputs[0])]
        assert first_turn == pytest.approx(scripted_engine.responses[0]["logprobs"])  # ... and logprobs
        assert sample["metadata"]["tito_num_critical"] == 0  # TITO's check against a fresh render of the path
        comparison = tito.comparator().compare(
            expected=tito.encode_messages(paths[node_id]), actual=tokens, trim_ids=tito.stop_token_ids
        )
        assert comparison.num_critical == 0
    stats = merged["session_metadata"]["tree"]
    assert stats["num_path_tokens"] == sum(len(s["tokens"]) for s in merged["samples"])
    assert stats["num_tree_tokens"] == stats["num_path_tokens"] - 3 * shared  # the prefix stored and counted once
    assert len(per_turn["samples"]) == 5  # one per node: the shared turn once
    assert len({s["sample_id"] for s in per_turn["samples"]}) == 5


async def test_a_retry_deep_in_the_history_branches_where_a_linear_session_refuses(
    tree_app: Any, scripted_engine: Any, operator_token: str
) -> None:
    scripted_engine.script = ["One.", "Two.", "Three.", "Again."]
    async with tree_app(scripted_engine.url) as client:
        sid, auth = await create(client, operator_token, tree=True)
        h1 = [{"role": "user", "content": "a"}]
        h2 = [*h1, reply(await chat(client, sid, auth, h1)), {"role": "user", "content": "b"}]
        h3 = [*h2, reply(await chat(client, sid, auth, h2)), {"role": "user", "content": "c"}]
        reply(await chat(client, sid, auth, h3))
        edited = [*h1, {"role": "user", "content": "edited"}]  # diverges two generated turns back
        retry = await chat(client, sid, auth, edited)
        assert retry.status_code == 200 and retry.json()["miles"]["turn_index"] == 0
        assert retry.json()["miles"]["tree"]["new_root"] is True  # nothing recorded holds [a, edited]
        b_again = await chat(client, sid, auth, [*h2[:-1], {"role": "user", "content": "b, rephrased"}])
        assert b_again.json()["miles"]["turn_index"] == 1  # under the first turn: a retry of turn 2 of 3
        merged = await samples(client, sid, auth)
        linear_sid, linear_auth = await create(client, operator_token)
        lh2 = [*h1, reply(await chat(client, linear_sid, linear_auth, h1)), {"role": "user", "content": "b"}]
        lh3 = [*lh2, reply(await chat(client, linear_sid, linear_auth, lh2)), {"role": "user", "content": "c"}]
        reply(await chat(client, linear_sid, linear_auth, lh3))
        refused = await chat(client, linear_sid, linear_auth, [*h1, {"role": "user", "content": "edited"}])
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "tito_non_append_history"
    assert merged["session_metadata"]["tree"]["num_leaves"] == 3
    assert all(s["metadata"]["tito_num_critical"] == 0 for s in merged["samples"])


async def test_compaction_starts_a_new_root_recorded_as_such(
    tree_app: Any, scripted_engine: Any, operator_token: str
) -> None:
    scripted_engine.script = ["Long answer.", "More.", "Summary-based answer."]
    async with tree_app(scripted_engine.url) as client:
        sid, auth = await create(client, operator_token, tree=True)
        h1 = [{"role": "user", "content": "Plan a trip."}]
        h2 = [*h1, reply(await chat(client, sid, auth, h1)), {"role": "user", "content": "Add days."}]
        reply(await chat(client, sid, auth, h2))
        compacted = [
            {"role": "system", "content": "Summary: a trip was planned, days were added."},
            {"role": "user", "content": "Continue."},
        ]
        third = await chat(client, sid, auth, compacted)
        after = [*compacted, reply(third), {"role": "user", "content": "And then?"}]
        fourth = await chat(client, sid, auth, after)
        merged = await samples(client, sid, auth)
    assert third.json()["miles"]["tree"] | {"node_id": None} == {
        "node_id": None,
        "parent_node_id": None,
        "tree_depth": 1,
        "new_root": True,
        "compaction": True,
    }
    assert fourth.json()["miles"]["tree"]["parent_node_id"] == third.json()["miles"]["tree"]["node_id"]
    stats = merged["session_metadata"]["tree"]
    assert stats["num_roots"] == 2 and stats["num_leaves"] == 2
    prompts = [r["body"]["input_ids"] for r in scripted_engine.requests]
    assert prompts[3][: len(prompts[2])] == prompts[2]  # the new root's next turn extends its own render
    assert all(s["metadata"]["tito_num_critical"] == 0 for s in merged["samples"])


async def test_concurrent_branches_are_all_recorded(tree_app: Any, scripted_engine: Any, operator_token: str) -> None:
    scripted_engine.script = ["Root.", "x.", "y.", "z.", "w."]
    async with tree_app(scripted_engine.url) as client:
        sid, auth = await create(client, operator_token, tree=True)
        history = [{"role": "user", "content": "go"}]
        history += [reply(await chat(client, sid, auth, history)), {"role": "user", "content": "try"}]
        answers = await asyncio.gather(*(chat(client, sid, auth, history, temperature=1.0) for _ in range(4)))
        merged = await samples(client, sid, auth)
    assert all(a.json()["miles"]["recorded"] for a in answers)
    assert len({a.json()["miles"]["tree"]["node_id"] for a in answers}) == 4
    assert len(merged["samples"]) == 4
    assert all(s["metadata"]["tito_num_critical"] == 0 for s in merged["samples"])


async def test_a_tree_at_its_bounds_is_refused_and_keeps_what_it_recorded(
    tree_app: Any, scripted_engine: Any, operator_token: str
) -> None:
    async with tree_app(scripted_engine.url, max_tree_nodes=3) as client:
        sid, auth = await create(client, operator_token, tree=True)
        for i in range(3):
            reply(await chat(client, sid, auth, [{"role": "user", "content": f"q{i}"}]))
        before = await samples(client, sid, auth)
        refused = await chat(client, sid, auth, [{"role": "user", "content": "q3"}])
        after = await samples(client, sid, auth)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "session_tree_full"
    assert "max_tree_nodes=3" in refused.json()["error"]["message"]
    assert after["samples"] == before["samples"] and len(after["samples"]) == 3
    assert len(scripted_engine.requests) == 3  # refused before the engine ran


async def test_a_tree_at_its_token_bound_is_refused_and_keeps_what_it_recorded(
    tree_app: Any, scripted_engine: Any, operator_token: str
) -> None:
    async with tree_app(scripted_engine.url, max_tree_tokens=60) as client:
        sid, auth = await create(client, operator_token, tree=True)
        accepted: list[Any] = []
        for turn in range(10):  # each turn adds its prompt and completion ids (~15), until one could pass 60
            # max_tokens 8: room for the reply ("Hello." and <|im_end|>) and the bound check's margin
            question = [{"role": "user", "content": f"question number {turn}"}]
            before = await samples(client, sid, auth)
            response = await chat(client, sid, auth, question, max_tokens=8)
            if response.status_code != 200:
                break
            accepted.append(reply(response))
        after = await samples(client, sid, auth)
    assert response.status_code == 409 and response.json()["error"]["code"] == "session_tree_full"
    assert "max_tree_tokens=60" in response.json()["error"]["message"]
    details = response.json()["error"]["details"]  # refused because this turn could pass the bound
    assert details["num_tree_tokens"] <= 60 < details["num_tree_tokens"] + details["num_new_token_ids"]
    assert 1 <= len(accepted) < 10  # it took some turns, and refused before the engine ran again
    assert len(scripted_engine.requests) == len(accepted)
    assert after["samples"] == before["samples"] and len(after["samples"]) == len(accepted)


async def test_explicit_parents_and_roles_are_checked(
    make_session_app: Any, scripted_engine: Any, operator_token: str, qwen3_model_dir: Path
) -> None:
    op = {"authorization": f"Bearer {operator_token}"}
    async with make_session_app(scripted_engine.url) as client:
        config = {"model_path": str(qwen3_model_dir), "model_family": "qwen3", "roles": ["solver", "verifier"]}
        assert (await client.put("/v1/jobs/j1/config", json={**config, "tree_sessions": True}, headers=op)).is_success
        sid, auth = await create(client, operator_token, job_id="j1", role="solver")
        other, other_auth = await create(client, operator_token, job_id="j1", role="verifier")
        linear, linear_auth = await create(client, operator_token, job_id="j1", tree=False)
        history = [{"role": "user", "content": "q"}]
        theirs = (await chat(client, other, other_auth, history)).json()["miles"]["tree"]["node_id"]
        first = await chat(client, sid, auth, history)
        mine, follow_up = (
            first.json()["miles"]["tree"]["node_id"],
            [*history, reply(first), {"role": "user", "content": "x"}],
        )
        foreign = await chat(client, sid, auth, follow_up, parent_node_id=theirs)
        explicit = await chat(client, sid, auth, follow_up, parent_node_id=mine)
        on_linear = await chat(client, linear, linear_auth, history, parent_node_id=mine)
        undeclared = await client.post("/v1/sessions", json={"job_id": "j1", "role": "critic"}, headers=op)
        no_roles = await client.post("/v1/sessions", json={"role": "solver"}, headers=op)
        solver_samples = await samples(client, sid, auth, reward=0.5)
    assert foreign.status_code == 400 and foreign.json()["error"]["field"] == "parent_node_id"
    assert explicit.status_code == 200 and explicit.json()["miles"]["tree"]["parent_node_id"] == mine
    assert on_linear.status_code == 400 and on_linear.json()["error"]["field"] == "parent_node_id"
    for refused in (undeclared, no_roles):
        assert refused.status_code == 400 and refused.json()["error"]["field"] == "role"
    assert "'critic'" in undeclared.json()["error"]["message"]
    assert len(solver_samples["samples"]) == 1  # the refused turn recorded nothing: one path of two turns
    assert solver_samples["samples"][0]["metadata"]["num_turns"] == 2
    assert {s["metadata"]["role"] for s in solver_samples["samples"]} == {"solver"}
