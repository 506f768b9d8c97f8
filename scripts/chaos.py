"""`make chaos`: the kill matrix. A short job under `miles up`, and kill -9 of every service once while it runs.

    python scripts/chaos.py [--home /tmp/miles-chaos] [--stall-bound-s 60] [--num-steps 16]

Starts the platform (the calculator demo's model and job, shortened: checkpoints every 2 steps), submits the job,
and once it has trained a step kills, one at a time, each shared service (redis, buffer, router, session server,
sandbox gateway, controller: the platform keeper restarts them) and each per-job process (engine, weight-sync,
rollout worker, trainer: the controller restarts them). The next kill waits until the job has trained another step
since the last one, so every failure is recovered from before the next. No human action anywhere.

Pass (exit 0) when: the job SUCCEEDED; no gap between two trained steps (or between a kill and the next step) was
longer than --stall-bound-s; every killed process came back (a new pid); the buffer acked exactly num_steps x
batch_size_groups groups (each trained group acked once: none lost, none trained twice) and holds no lease at
the end. Aborted episodes are reported with their reasons
(the workers' `miles_rollout_episodes_total{status="ABORTED"}`, summed over every worker process seen).
Writes bench/results/chaos.json.

Limits: one job, one kill per service, on one machine; the stall bound is for this 2-core machine (a trainer
restart reloads the model and replays the steps since its last checkpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO_ROOT / "examples"))

from demo import ensure_model  # noqa: E402

from miles.buffer.client import BufferClient  # noqa: E402
from miles.cli.launcher import Layout, load_state, start_platform, stop_platform  # noqa: E402
from miles.common.testing.machine import describe_machine  # noqa: E402

SHARED_TARGETS = ("redis", "buffer", "router", "session", "sandbox", "controller")
JOB_TARGETS = ("engine", "weightsync", "worker", "trainer")
ABORTED_LINE = re.compile(r'^miles_rollout_episodes_total\{reason="([^"]+)",status="ABORTED"\} ([0-9.e+]+)$', re.M)


@dataclass
class Watch:
    """What the poller saw: step times, the job's last view, aborted episodes per worker pid."""

    job_id: str
    step: int = 0
    state: str = "PENDING"
    step_times_s: list[float] = field(default_factory=list)
    aborted_by_pid: dict[str, dict[str, float]] = field(default_factory=dict)
    job: dict[str, Any] = field(default_factory=dict)


def job_processes(layout: Layout, job_id: str) -> list[dict[str, Any]]:
    path = layout.controller_state_dir / "jobs" / job_id / "state.json"
    try:
        return list(json.loads(path.read_text())["processes"])
    except (OSError, ValueError, KeyError):
        return []


def poll(client: httpx.Client, layout: Layout, watch: Watch) -> None:
    """One look at the job (the controller may be down: then nothing changes) and at its workers' metrics."""
    try:
        response = client.get(f"/v1/jobs/{watch.job_id}")
        if response.status_code == 200:
            watch.job = response.json()
            watch.state = watch.job["state"]
            if watch.job["step"] > watch.step:
                watch.step = watch.job["step"]
                watch.step_times_s.append(time.monotonic())
    except httpx.HTTPError:
        pass
    for process in job_processes(layout, watch.job_id):
        if process["role"] != "worker" or not process.get("url"):
            continue
        try:
            text = httpx.get(f"{process['url']}/metrics", timeout=2.0, trust_env=False).text
        except httpx.HTTPError:
            continue
        counts = {reason: float(value) for reason, value in ABORTED_LINE.findall(text)}
        watch.aborted_by_pid[str(process["pid"])] = counts


def pid_of(layout: Layout, job_id: str, target: str) -> int:
    if target in SHARED_TARGETS:
        state = load_state(layout)
        assert state is not None, "the platform is gone"
        return state.services[target].pid
    records = [p for p in job_processes(layout, job_id) if p["role"] == target and p.get("pid")]
    if not records:
        raise RuntimeError(f"no {target} process in the job's state")
    return int(records[0]["pid"])


def replaced_within(layout: Layout, job_id: str, target: str, pid: int, timeout_s: float) -> bool:
    """Whether a new process of `target` takes over from `pid` within timeout_s. Polled, not sampled once at the
    next step: a trainer with data buffered trains the next step before a killed engine's restart (its backoff)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(RuntimeError):  # between the death and the restart the job may list none
            if pid_of(layout, job_id, target) != pid:
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def wait_for_next_step(
    client: httpx.Client, layout: Layout, watch: Watch, after_step: int, timeout_s: float
) -> float | None:
    """Seconds until the job trains a step past `after_step` (None: it ended or the timeout passed first)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        poll(client, layout, watch)
        if watch.step > after_step:
            return time.monotonic() - started
        if watch.state in ("SUCCEEDED", "FAILED", "CANCELLED"):
            return None
        time.sleep(1.0)
    return None


def buffer_stats(layout: Layout, job_id: str) -> dict[str, int]:
    state = load_state(layout)
    assert state is not None

    async def read() -> dict[str, int]:
        async with BufferClient(state.services["buffer"].url) as client:
            stats = await client.stats(job_id)
        names = ("pushed_total", "pulled_total", "acked_total", "nacked_total", "expired_leases_total")
        return {name: int(getattr(stats, name)) for name in (*names, "leased_groups", "queued_groups")}

    return asyncio.run(read())


def run_matrix(args: argparse.Namespace, layout: Layout, spec: dict[str, Any]) -> dict[str, Any]:
    state = load_state(layout)
    assert state is not None
    kills: list[dict[str, Any]] = []
    with httpx.Client(base_url=state.controller_url, timeout=10.0, trust_env=False) as client:
        response = client.post("/v1/jobs", json=spec)
        response.raise_for_status()
        watch = Watch(response.json()["job_id"])
        print(f"job {watch.job_id} submitted ({spec['train']['num_steps']} steps)", flush=True)
        if wait_for_next_step(client, layout, watch, 0, args.first_step_timeout_s) is None:
            raise RuntimeError(f"the job never trained a first step: {watch.job.get('errors')}")
        for target in (*SHARED_TARGETS, *JOB_TARGETS):
            pid = pid_of(layout, watch.job_id, target)
            step_at_kill = watch.step
            os.kill(pid, signal.SIGKILL)
            recovery_s = wait_for_next_step(client, layout, watch, step_at_kill, args.stall_bound_s * 3)
            replaced = replaced_within(layout, watch.job_id, target, pid, args.stall_bound_s)
            kills.append(
                {"target": target, "pid": pid, "step": step_at_kill, "next_step_s": recovery_s, "new_pid": replaced}
            )
            print(
                f"killed {target:<10} at step {step_at_kill}: next step after {recovery_s}s, replaced {replaced}",
                flush=True,
            )
        deadline = time.monotonic() + args.finish_timeout_s
        while watch.state not in ("SUCCEEDED", "FAILED", "CANCELLED") and time.monotonic() < deadline:
            poll(client, layout, watch)
            time.sleep(1.0)
    gaps = [b - a for a, b in zip(watch.step_times_s, watch.step_times_s[1:], strict=False)]
    aborted: dict[str, float] = {}
    for counts in watch.aborted_by_pid.values():
        for reason, value in counts.items():
            aborted[reason] = aborted.get(reason, 0.0) + value
    return {
        "job_id": watch.job_id,
        "state": watch.state,
        "steps": watch.step,
        "errors": watch.job.get("errors", []),
        "kills": kills,
        "max_step_gap_s": round(max(gaps, default=0.0), 1),
        "aborted_episodes_by_reason": aborted,
        "buffer": buffer_stats(layout, watch.job_id),
    }


def verdict(result: dict[str, Any], stall_bound_s: float, groups_trained: int) -> list[str]:
    problems = []
    if result["state"] != "SUCCEEDED":
        problems.append(f"job {result['state']}: {result['errors']}")
    if result["max_step_gap_s"] > stall_bound_s:
        problems.append(f"a stall of {result['max_step_gap_s']}s between steps (bound {stall_bound_s}s)")
    for kill in result["kills"]:
        if not kill["new_pid"]:
            problems.append(f"{kill['target']} was not restarted")
        if kill["next_step_s"] is not None and kill["next_step_s"] > stall_bound_s:
            problems.append(f"after killing {kill['target']} the next step took {kill['next_step_s']:.0f}s")
    buffer = result["buffer"]
    if buffer["acked_total"] != groups_trained or buffer["leased_groups"] != 0:
        problems.append(f"the buffer acked {buffer['acked_total']} groups for {groups_trained} trained: {buffer}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", type=Path, default=Path("/tmp/miles-chaos"))
    parser.add_argument("--spec", type=Path, default=REPO_ROOT / "examples/calculator_tool/job.yaml")
    parser.add_argument("--num-steps", type=int, default=16)
    parser.add_argument("--stall-bound-s", type=float, default=60.0)
    parser.add_argument("--first-step-timeout-s", type=float, default=600.0)
    parser.add_argument("--finish-timeout-s", type=float, default=900.0)
    args = parser.parse_args()
    spec = yaml.safe_load(args.spec.read_text())
    model_path = REPO_ROOT / spec["model"]["path"]
    spec["model"]["path"] = str(model_path)
    spec["rollout"]["dataset"]["path"] = str(REPO_ROOT / spec["rollout"]["dataset"]["path"])
    spec["train"].update(num_steps=args.num_steps, checkpoint_interval_steps=2)
    ensure_model(model_path)
    layout = Layout(args.home)
    stop_platform(layout)
    start_platform(layout)
    try:
        result = run_matrix(args, layout, spec)
    finally:
        stop_platform(layout)
    problems = verdict(result, args.stall_bound_s, args.num_steps * int(spec["train"]["batch_size_groups"]))
    result["problems"] = problems
    result["machine"] = describe_machine()
    out = REPO_ROOT / "bench/results/chaos.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print("chaos: PASS" if not problems else "chaos: FAIL\n  " + "\n  ".join(problems), flush=True)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
