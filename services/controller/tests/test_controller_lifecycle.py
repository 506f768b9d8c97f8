"""Event streams, controller restarts and job isolation, over a real controller app and Redis (fake backend)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.integration


async def read_sse(client: httpx.AsyncClient, job_id: str, **kwargs: Any) -> list[dict[str, Any]]:
    """`_read_sse`, bounded (a bound against a hang, not a speed check: the stream ends when the job does)."""
    return await asyncio.wait_for(_read_sse(client, job_id, **kwargs), timeout=120)


async def _read_sse(
    client: httpx.AsyncClient, job_id: str, *, last_event_id: str | None = None, max_events: int = 1000
) -> list[dict[str, Any]]:
    """Every event of the stream until the server closes it (the job ended) or max_events arrived."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    async with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("id: "):
                current["id"] = line[4:]
            elif line.startswith("event: "):
                current["event"] = line[7:]
            elif line.startswith("data: "):
                current["data"] = json.loads(line[6:])
            elif line == "" and "id" in current:
                events.append(current)
                current = {}
                if len(events) >= max_events:
                    break
    return events


async def test_event_stream_follows_the_job_to_its_end_and_resumes_after_last_event_id(
    redis_url: str, controller_kit: Any
) -> None:
    kit = controller_kit
    async with kit.running(kit.make_settings(redis_url), kit.FakeBackend()) as client:
        job_id = (await client.post("/v1/jobs", json=kit.job_spec_body(num_steps=4))).json()["job_id"]
        events = await read_sse(client, job_id)
        states = [event["data"]["state"] for event in events if event["event"] == "state"]
        assert states == ["PENDING", "RUNNING", "SUCCEEDED"]
        steps = [event["data"]["step"] for event in events if event["event"] == "progress"]
        assert steps == sorted(steps) and steps[-1] == 4
        assert events[-1]["event"] == "state" and events[-1]["data"]["state"] == "SUCCEEDED"
        ids = [event["id"] for event in events]
        assert len(set(ids)) == len(ids)

        resumed = await read_sse(client, job_id, last_event_id=ids[2])
        assert [event["id"] for event in resumed] == ids[3:]
        assert (await client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "bogus"})).status_code == 400
        assert (await client.get("/v1/jobs/jnothere0000/events")).status_code == 404


async def test_a_live_stream_sees_cancellation(redis_url: str, controller_kit: Any) -> None:
    kit = controller_kit
    async with kit.running(kit.make_settings(redis_url), kit.FakeBackend(auto_step=False)) as client:
        job_id = (await client.post("/v1/jobs", json=kit.job_spec_body())).json()["job_id"]
        await kit.wait_for_state(client, job_id, "RUNNING")
        first = await read_sse(client, job_id, max_events=2)
        await client.post(f"/v1/jobs/{job_id}/cancel")
        rest = await read_sse(client, job_id, last_event_id=first[-1]["id"])
        kinds = [event["event"] for event in rest]
        assert "cancel_requested" in kinds
        assert rest[-1]["data"]["state"] == "CANCELLED"


async def test_restarted_controller_adopts_the_running_job_and_carries_on(redis_url: str, controller_kit: Any) -> None:
    kit = controller_kit
    backend = kit.FakeBackend(auto_step=False)  # the fake's jobs outlive the controller, like real processes
    settings = kit.make_settings(redis_url)
    async with kit.running(settings, backend) as client:
        job_id = (await client.post("/v1/jobs", json=kit.job_spec_body(num_steps=5))).json()["job_id"]
        await kit.wait_for_state(client, job_id, "RUNNING")
        backend.jobs[job_id].step = 2
        await kit.wait_until(lambda: backend.jobs[job_id].starts == 1)
    assert backend.closed == 1
    assert ("stop", job_id) not in backend.calls  # a controller shutdown leaves jobs running

    backend.jobs[job_id].auto_step = True
    async with kit.running(settings, backend) as client:
        job = await kit.wait_for_state(client, job_id, "SUCCEEDED", "FAILED")
        assert job["state"] == "SUCCEEDED" and job["step"] == 5
        started = [call for call in backend.calls if call == ("start", job_id)]
        assert len(started) == 2  # adopted by the second instance, not submitted again
        assert (await client.get("/v1/jobs")).json()["jobs"][0]["job_id"] == job_id


async def test_two_jobs_are_supervised_independently(redis_url: str, controller_kit: Any) -> None:
    kit = controller_kit
    backend = kit.FakeBackend(auto_step=False)
    async with kit.running(kit.make_settings(redis_url), backend) as client:
        first = (await client.post("/v1/jobs", json=kit.job_spec_body(num_steps=2))).json()["job_id"]
        second = (await client.post("/v1/jobs", json=kit.job_spec_body(num_steps=2))).json()["job_id"]
        assert first != second
        await kit.wait_for_state(client, first, "RUNNING")
        await kit.wait_for_state(client, second, "RUNNING")
        await client.patch(f"/v1/jobs/{second}", json={"engines": 5})
        await client.post(f"/v1/jobs/{first}/cancel")
        await kit.wait_until(lambda: backend.jobs[second].engines == 5)
        backend.jobs[second].auto_step = True
        done = await kit.wait_for_state(client, second, "SUCCEEDED")
        assert done["step"] == 2
        assert (await client.get(f"/v1/jobs/{first}")).json()["state"] == "CANCELLED"
        assert [call for call in backend.calls if call[0] == "resize"] == [("resize", second)]
        assert backend.calls.count(("stop", first)) == 1 and backend.calls.count(("stop", second)) == 1
        first_events = await read_sse(client, first)
        assert all(event["data"].get("job_id") in (first, None) for event in first_events)


async def test_only_the_lease_holder_supervises_when_two_replicas_share_redis(
    redis_url: str, controller_kit: Any
) -> None:
    kit = controller_kit
    first_backend, second_backend = kit.FakeBackend(auto_step=False), kit.FakeBackend(auto_step=False)
    settings = kit.make_settings(redis_url)
    async with kit.running(settings, first_backend) as first:
        job_id = (await first.post("/v1/jobs", json=kit.job_spec_body())).json()["job_id"]
        await kit.wait_for_state(first, job_id, "RUNNING")
        async with kit.running(settings, second_backend) as second:
            other = (await second.post("/v1/jobs", json=kit.job_spec_body())).json()["job_id"]
            await kit.wait_for_state(second, other, "RUNNING")
            cancelled = await second.post(f"/v1/jobs/{job_id}/cancel")  # served by the replica without the lease
            assert cancelled.json()["state"] == "CANCELLED"
        assert [call for call in second_backend.calls if call[0] != "check_spec"] == []  # it only vetted a spec
        assert ("start", other) in first_backend.calls and ("stop", job_id) in first_backend.calls


async def test_a_job_that_trains_nothing_says_it_is_stalled_and_then_that_it_resumed(
    redis_url: str, controller_kit: Any
) -> None:
    kit = controller_kit
    backend = kit.FakeBackend(auto_step=False)
    async with kit.running(kit.make_settings(redis_url, stall_warning_s=0.5), backend) as client:
        job_id = (await client.post("/v1/jobs", json=kit.job_spec_body(num_steps=5))).json()["job_id"]
        await kit.wait_for_state(client, job_id, "RUNNING")
        backend.jobs[job_id].error = "worker-0 exited with code -9; restarting"
        for _ in range(600):
            errors = (await client.get(f"/v1/jobs/{job_id}")).json()["errors"]
            if any(error.startswith("stalled:") for error in errors):
                break
            await asyncio.sleep(0.02)
        (stalled,) = [error for error in errors if error.startswith("stalled:")]
        assert "step 0/5" in stalled and "worker-0 exited" in stalled and "'engines': 2" in stalled

        backend.jobs[job_id].step = 1
        for _ in range(600):
            if (await client.get(f"/v1/jobs/{job_id}")).json()["step"] == 1:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # the resumed event follows the step's progress event in the same observation
        await client.post(f"/v1/jobs/{job_id}/cancel")
        events = await read_sse(client, job_id)
        (resumed,) = [event["data"] for event in events if event["event"] == "resumed"]
        assert resumed["step"] == 1 and resumed["stalled_s"] >= 0
        kinds = [event["event"] for event in events]
        assert kinds.index("error") < kinds.index("resumed")
