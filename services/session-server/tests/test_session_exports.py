"""Export processes (exports.py): a long session's GET and samples are built by a helper interpreter reading the
same Redis, and the client cannot tell: the same bytes, the same errors, the same counters as the in-process answer.

`export_min_tokens=0` makes every linear session "long" here; a second app on the same Redis with
`export_processes=0` builds every answer in process and is the reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
from google.protobuf import json_format

from miles.proto.session.v1 import session_pb2
from miles.session.views import ViewRequest

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def _two_apps(make_session_app: Any, engine_url: str, redis_url: str) -> AsyncIterator[tuple[Any, Any]]:
    shared = {"store_backend": "redis", "redis_url": redis_url, "key_prefix": "exports"}
    async with (
        make_session_app(engine_url, export_min_tokens=0, **shared) as exporting,
        make_session_app(engine_url, export_processes=0, **shared) as in_process,
    ):
        yield exporting, in_process


async def _session(client: Any, operator_token: str, turns: int) -> tuple[str, dict[str, str]]:
    op = {"authorization": f"Bearer {operator_token}"}
    created = (await client.post("/v1/sessions", json={"episode_id": "ep-x"}, headers=op)).json()
    sid, auth = created["session_id"], {"authorization": f"Bearer {created['token']}"}
    history: list[Any] = []
    for turn in range(turns):
        history.append({"role": "user", "content": f"question {turn}"})
        reply = await client.post(f"/v1/sessions/{sid}/v1/chat/completions", json={"messages": history}, headers=auth)
        reply.raise_for_status()
        history.append(reply.json()["choices"][0]["message"])
    return sid, auth


def _samples(response: Any) -> Any:
    """The samples message (its metadata is a protobuf map: its order differs between processes, not its content)."""
    if response.headers["content-type"] == "application/x-protobuf":
        return session_pb2.SessionSamples.FromString(response.content)
    return json_format.Parse(response.text, session_pb2.SessionSamples())


def _counter(client: Any, line_start: str) -> float:
    text = client.app.state.exports._metrics.registry.exposition().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)]
    return sum(values)


async def test_a_helper_answers_with_the_in_process_bytes_and_counts_in_the_server(
    make_session_app: Any, scripted_engine: Any, redis_url: str, operator_token: str
) -> None:
    scripted_engine.script = ["First answer.", "Second answer.", "Third."]
    async with _two_apps(make_session_app, scripted_engine.url, redis_url) as (exporting, in_process):
        sid, auth = await _session(exporting, operator_token, turns=3)
        assert exporting.app.state.exports.pids == []  # started on first use
        exported = await exporting.get(f"/v1/sessions/{sid}", headers=auth)
        (pid,) = exporting.app.state.exports.pids
        assert pid != os.getpid()
        reference = await in_process.get(f"/v1/sessions/{sid}", headers=auth)
        assert exported.status_code == reference.status_code == 200
        assert exported.content == reference.content
        assert exported.json()["num_turns"] == 3
        body = {"mode": "per_turn", "reward": 0.5, "group_id": "g"}
        for accept in ("application/json", "application/x-protobuf"):
            headers = {**auth, "accept": accept}
            exported = await exporting.post(f"/v1/sessions/{sid}/samples", json=body, headers=headers)
            reference = await in_process.post(f"/v1/sessions/{sid}/samples", json=body, headers=headers)
            assert exported.status_code == reference.status_code == 200
            assert exported.headers["content-type"] == reference.headers["content-type"]
            assert _samples(exported) == _samples(reference)
        assert exporting.app.state.exports.pids == [pid]  # one helper, reused
        # What the helper counted is the server's: 2 samples calls x 3 per-turn samples, one TITO check per call.
        assert _counter(exporting, 'miles_session_samples_total{status="COMPLETED"}') == 6
        for result in ("clean", "non_critical", "critical"):
            line = f'miles_session_tito_comparisons_total{{result="{result}"}}'
            assert _counter(exporting, line) == _counter(in_process, line)
        assert _counter(exporting, "miles_session_tito_comparisons_total{") == 2


async def test_errors_pass_through_and_a_dead_helper_is_replaced(
    make_session_app: Any, scripted_engine: Any, redis_url: str, operator_token: str
) -> None:
    async with _two_apps(make_session_app, scripted_engine.url, redis_url) as (exporting, _):
        sid, auth = await _session(exporting, operator_token, turns=1)
        exports = exporting.app.state.exports
        meta = await exports._views.store.get_meta(sid)
        assert (await exporting.get(f"/v1/sessions/{sid}", headers=auth)).status_code == 200
        (first_pid,) = exports.pids
        os.kill(first_pid, signal.SIGKILL)
        for _ in range(200):  # until the server's child watcher has seen it exit
            if not exports.pids:
                break
            await asyncio.sleep(0.01)
        again = await exporting.get(f"/v1/sessions/{sid}", headers=auth)
        assert again.status_code == 200 and again.json()["session_id"] == sid
        (second_pid,) = exports.pids
        assert second_pid != first_pid
        # A body never read (its client left before the head went out) kills its helper and frees its slot.
        abandoned = await exports._through_helper(ViewRequest("describe", meta))
        del abandoned
        gc.collect()
        replaced = await asyncio.wait_for(exporting.get(f"/v1/sessions/{sid}", headers=auth), timeout=60)
        assert replaced.status_code == 200
        (third_pid,) = exports.pids
        assert third_pid != second_pid
        await exporting.delete(f"/v1/sessions/{sid}", headers=auth)
        # Deleted after the server authorized it: the helper's 404 is the answer, as built in process.
        answer = await exports._through_helper(ViewRequest("describe", meta))
        body = b"".join([piece async for piece in answer.body])
        assert answer.status == 404 and b'"code":"session_not_found"' in body
        assert exports.pids == [third_pid]  # an error answer leaves the helper usable


async def test_the_memory_store_is_answered_in_process(
    make_session_app: Any, scripted_engine: Any, operator_token: str
) -> None:
    async with make_session_app(scripted_engine.url, export_min_tokens=0) as client:
        sid, auth = await _session(client, operator_token, turns=1)
        assert (await client.get(f"/v1/sessions/{sid}", headers=auth)).status_code == 200
        assert client.app.state.exports.pids == []
