"""make bench-async: samples/s of the same job in sync and fully-async mode (max staleness 2), long-tail episodes.

The platform is the real one (`miles up` in a scratch home: redis, buffer, sandbox gateway, router, session
server, controller with the local backend) and each job runs its real per-job processes (engine, weight-sync,
rollout worker, trainer). What is simulated is the engine's speed: `miles-engine --fake-model` with a GPU-like
cost model — a fixed time per forward whatever its batch (decode is memory-bound: a lone long-tail request keeps
the engine as busy as a full batch) plus a time per prefilled token; a new turn's prefill shares the running
requests' decode forward (the engine's default `--enable-mixed-chunk`) — in place of the real CPU engine, which
would measure this machine's two cores, not the scheduling. It runs over the demo model's small vocabulary so that the
real trainer trains on what it samples. The task is long-tailed: each episode makes `turns` model calls with
`turns` drawn per episode from a Pareto distribution (alpha 1.1, capped at 24; see _async_agent.py), so a few
episodes are much longer than the rest.

`sync` is barrier-synchronous (the rollout workers start exactly one batch per weight version and wait for the
next: miles.rollout.barrier), the baseline users compare asynchronous training against; `async` has no barrier:
its workers admit groups into the batches of the live version and the 2 after it (the staleness window), and the
trainer takes groups up to 2 versions old. A long-tail episode runs on across weight updates (each turn is a span
with its own version): with the default `stale_policy: mask` (partial rollout) the trainer masks its turns older
than 2 versions out of the loss and trains the rest; only a group with no turn that fresh is dropped, counted.

Per mode: one job of NUM_STEPS steps; samples/s = trained samples between step TIMED_FROM_STEP and the last step
over the time between them (start-up and its backlog excluded); engine idle fraction = share of 0.25 s polls of
the engine's `num_running_reqs` gauge that read 0 over the same window; loss tokens trained per second and the
share masked as stale (samples/s counts a sample whose early turns were masked as one: the token rate is the check
that async's lead is not only in that count); the buffer's count of groups dropped as stale and the staleness
distribution of the groups trained; the worker's mean episodes in flight; the trainer's
mean wait for data, forward-backward, optimizer and publish seconds per step (its step metrics); and the mean time
from a step's progress event to the router answering its version as live. Prints `async_vs_sync=<ratio>` (and
the loss-token ratio) and writes bench/results/async.json.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "examples"))

from _async_agent import ALPHA, MAX_TURNS, num_turns  # noqa: E402

from miles.cli.follow import iter_events  # noqa: E402
from miles.cli.launcher import Layout, start_platform, stop_platform  # noqa: E402
from miles.common.testing.machine import describe_machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "async.json"
NUM_STEPS = 16
TIMED_FROM_STEP = 4
"""Steps before this one are not timed: the trainer starts after the rollout worker, so the first steps of an
async job eat a backlog generated during start-up (a sync job drops it as stale)."""
GROUPS_PER_STEP = 2
SAMPLES_PER_PROMPT = 4
FORWARD_COST_S = 0.025
"""Per engine step (prefill or decode), whatever the batch. A training step of the demo model takes ~0.15 s here
(forward-backward) plus ~0.08 s to publish, so both modes are bound by generation: sync by the longest episode of
its batch, async by how many episodes its staleness window keeps in flight."""
PREFILL_COST_S = 0.0002
MAX_TOKENS_PER_TURN = 32
EOS_PROBABILITY = 0.03
"""About 21 tokens per reply: a turn is one prefill and ~21 decode steps."""
MAX_LIVE_EPISODES = {"sync": 8, "async": 32}
"""Episodes in flight per mode. The sync job's barrier admits exactly one step's worth (2 groups x 4 = 8 episodes)
per weight version whatever this limit, so its step waits for the longest of its 8 (the long tail). The async
job keeps 32 in flight, enough to keep the engine busy (idle ~5 %) while the trainer steps; at 8 it measured
1.40 samples/s with ~4.8 requests running on average (the rollout side's CPU on this 2-core box is the limit)."""
NUM_ROWS = 200
MODES = ("sync", "async")
ASYNC_MAX_LIVE_EPISODES_ENV = "MILES_BENCH_ASYNC_MAX_LIVE_EPISODES"
"""Optional override of the async job's episodes in flight (the sync job's barrier admits one step's worth)."""


def write_dataset(path: Path, *, num_rows: int = NUM_ROWS) -> None:
    with path.open("w") as handle:
        for index in range(num_rows):
            messages = [{"role": "user", "content": f"Task {index}: think it through step by step."}]
            handle.write(json.dumps({"prompt": messages, "label": "0"}) + "\n")


def max_live_episodes(mode: str) -> int:
    import os

    override = os.environ.get(ASYNC_MAX_LIVE_EPISODES_ENV) if mode == "async" else None
    return int(override) if override else MAX_LIVE_EPISODES[mode]


def job_spec(model_dir: Path, dataset: Path, mode: str) -> dict[str, Any]:
    return {
        "name": f"bench-async-{mode}",
        "model": {"path": str(model_dir), "chat_template_kwargs": {"enable_thinking": False}},
        "rollout": {
            "dataset": {"path": str(dataset), "num_epochs": None},
            "agent": {"function": "_async_agent:agent", "python_path": [str(REPO_ROOT / "bench")], "timeout_s": 600},
            "reward": {
                "type": "function",
                "function": "_async_agent:reward",
                "python_path": [str(REPO_ROOT / "bench")],
            },
            "n_samples_per_prompt": SAMPLES_PER_PROMPT,
            "request_kwargs": {"temperature": 1.0, "max_tokens": MAX_TOKENS_PER_TURN},
            "max_seq_len": 2048,
            "concurrency": {"max_live_episodes": max_live_episodes(mode)},
        },
        "train": {
            "mode": mode,
            "max_staleness": 2,
            "batch_size_groups": GROUPS_PER_STEP,
            "num_steps": NUM_STEPS,
            "checkpoint_interval_steps": NUM_STEPS,
            "pull_wait_s": 0.5,
            "optimizer": {"lr": 1e-4},
        },
        "resources": {
            "engines": {
                "replicas": 1,
                "extra_args": [
                    "--fake-model",
                    "--fake-forward-cost-s",
                    str(FORWARD_COST_S),
                    "--fake-prefill-token-cost-s",
                    str(PREFILL_COST_S),
                    "--fake-eos-probability",
                    str(EOS_PROBABILITY),
                ],
            }
        },
    }


class IdlePoller:
    """Polls the job's engine `num_running_reqs` every 0.25 s (engine URL from the local backend's state file), and
    the buffer's per-job staleness counters (the last values seen: the buffer forgets a job when it ends)."""

    def __init__(self, job_dir: Path, buffer_metrics_url: str, job_id: str, router_url: str) -> None:
        self.job_dir = job_dir
        self.buffer_metrics_url = buffer_metrics_url
        self.job_id = job_id
        self.router_url = router_url
        self.live_since: dict[int, float] = {}
        """weight version -> when the router first answered it as the pool's live (lowest available) version."""
        self.buffer: dict[str, float] = {}
        """Last seen buffer series of the job: dropped stale groups, pulled groups per staleness bucket."""
        self.samples: list[tuple[float, float]] = []
        """(monotonic time, the engine's num_running_reqs)."""
        self.live_episodes: list[tuple[float, float]] = []
        """(monotonic time, the worker's episodes in flight)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> IdlePoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _process_url(self, role: str) -> str | None:
        state_file = self.job_dir / "state.json"
        if not state_file.is_file():
            return None
        try:
            processes = json.loads(state_file.read_text())["processes"]
        except (ValueError, KeyError):
            return None
        urls = [p.get("url") for p in processes if p.get("role") == role]
        return urls[0] if urls else None

    def _run(self) -> None:
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while not self._stop.wait(0.25):
                url = self._process_url("engine")
                if url is None:
                    continue
                try:
                    text = client.get(f"{url}/metrics").text
                except httpx.HTTPError:
                    continue
                match = re.search(r"^\S*num_running_reqs(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
                if match:
                    self.samples.append((time.monotonic(), float(match.group(1))))
                self._read_buffer(client)
                self._read_live_version(client)
                self._read_worker(client)

    def _read_worker(self, client: httpx.Client) -> None:
        url = self._process_url("worker")
        try:
            text = client.get(f"{url}/metrics").text if url else ""
        except httpx.HTTPError:
            return
        match = re.search(r"^miles_rollout_live_episodes(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
        if match:
            self.live_episodes.append((time.monotonic(), float(match.group(1))))

    def _read_live_version(self, client: httpx.Client) -> None:
        try:
            answer = client.get(f"{self.router_url}/v1/weight_version", params={"pool": self.job_id}).json()
        except (httpx.HTTPError, ValueError):
            return
        if answer.get("min_weight_version") is not None:
            self.live_since.setdefault(int(answer["min_weight_version"]), time.monotonic())

    def _read_buffer(self, client: httpx.Client) -> None:
        try:
            text = client.get(self.buffer_metrics_url).text
        except httpx.HTTPError:
            return
        job = re.escape(self.job_id)
        for name in ("dropped_stale_groups_total", "pulled_groups_total"):
            match = re.search(rf"^miles_buffer_{name}\{{job_id=\"{job}\"\}} (\S+)$", text, re.MULTILINE)
            if match:
                self.buffer[name] = float(match.group(1))
        bucket = rf'^miles_buffer_pulled_group_staleness_steps_bucket\{{job_id="{job}",le="([^"]+)"\}} (\S+)$'
        for le, count in re.findall(bucket, text, re.MULTILINE):
            self.buffer[f"staleness_le_{le}"] = float(count)

    def staleness(self) -> dict[str, Any]:
        """Groups dropped as stale and the staleness distribution of the groups trained (cumulative buckets)."""
        buckets = {k.removeprefix("staleness_le_"): int(v) for k, v in self.buffer.items() if k.startswith("staleness")}
        return {
            "dropped_stale_groups": int(self.buffer.get("dropped_stale_groups_total", 0)),
            "pulled_groups": int(self.buffer.get("pulled_groups_total", 0)),
            "pulled_staleness_cumulative": buckets,
        }

    def idle_fraction(self, start: float, end: float) -> float | None:
        window = [running == 0.0 for at, running in self.samples if start <= at <= end]
        return round(sum(window) / len(window), 3) if window else None

    def mean_running(self, start: float, end: float) -> float | None:
        return _mean([running for at, running in self.samples if start <= at <= end])

    def mean_live_episodes(self, start: float, end: float) -> float | None:
        return _mean([live for at, live in self.live_episodes if start <= at <= end])


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 2) if values else None


def run_job(
    client: httpx.Client, layout: Layout, spec: dict[str, Any], buffer_metrics_url: str, router_url: str
) -> dict[str, Any]:
    job = client.post("/v1/jobs", json=spec)
    job.raise_for_status()
    job_id = job.json()["job_id"]
    job_dir = layout.controller_state_dir / "jobs" / job_id
    poller = IdlePoller(job_dir, buffer_metrics_url, job_id, router_url).start()
    step_seen_at: dict[int, float] = {}
    step_metrics: dict[int, dict[str, float]] = {}
    final = "?"
    try:
        for event in iter_events(client, job_id):
            if event.type == "progress" and event.data.get("step", 0) > 0:
                step_seen_at.setdefault(int(event.data["step"]), time.monotonic())
                step_metrics.setdefault(int(event.data["step"]), dict(event.data.get("metrics") or {}))
                print(f"  {spec['train']['mode']}: step {event.data['step']}", flush=True)
            if event.type == "state":
                final = str(event.data.get("state"))
    finally:
        poller.stop()
    steps = sorted(s for s in step_seen_at if s >= TIMED_FROM_STEP)
    if final != "SUCCEEDED" or len(steps) < 2:
        raise RuntimeError(f"job {job_id} ended {final} after steps {steps}: {client.get(f'/v1/jobs/{job_id}').text}")
    first, last = steps[0], steps[-1]
    window_s = step_seen_at[last] - step_seen_at[first]
    samples = (last - first) * GROUPS_PER_STEP * SAMPLES_PER_PROMPT
    timed_metrics = [step_metrics[s] for s in steps[1:] if s in step_metrics]
    return {
        "job_id": job_id,
        "steps_timed": [first, last],
        "window_s": round(window_s, 2),
        "samples_per_s": round(samples / window_s, 3),
        "engine_idle_fraction": poller.idle_fraction(step_seen_at[first], step_seen_at[last]),
        "engine_mean_running_requests": poller.mean_running(step_seen_at[first], step_seen_at[last]),
        "worker_mean_live_episodes": poller.mean_live_episodes(step_seen_at[first], step_seen_at[last]),
        **loss_tokens(timed_metrics, window_s),
        "trainer_mean_s": trainer_phases(timed_metrics),
        "version_live_lag_s": live_lag(step_seen_at, poller.live_since, steps),
        **poller.staleness(),
    }


def loss_tokens(metrics: list[dict[str, float]], window_s: float) -> dict[str, float]:
    """Tokens the timed steps trained on (their loss tokens) per second, and the share of the loss tokens of their
    samples masked as older than max_staleness (partial rollout): samples/s counts a sample whose early turns were
    masked as one, this counts only what was trained."""
    kept = sum(float(m.get("num_loss_tokens", 0.0)) for m in metrics)
    masked = sum(float(m.get("stale_masked_tokens", 0.0)) for m in metrics)
    return {
        "loss_tokens_per_s": round(kept / window_s, 1),
        "stale_masked_token_fraction": round(masked / max(kept + masked, 1.0), 3),
    }


def live_lag(step_seen_at: dict[int, float], live_since: dict[int, float], steps: list[int]) -> float | None:
    """Mean time from a step's progress event to the router answering its version as live (publish, weight-sync's
    update of the engine, the router learning it): how long the staleness window waits to slide."""
    lags = [live_since[s] - step_seen_at[s] for s in steps if s in live_since]
    return round(sum(lags) / len(lags), 3) if lags else None


TRAINER_PHASES = ("wait_data_s", "forward_backward_s", "optimizer_s", "publish_s")
"""The trainer's own per-step timings (its step metrics, as the job's progress events carry them): where a step's
time goes (waiting for groups, computing, publishing the new version)."""


def trainer_phases(metrics: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each of TRAINER_PHASES over the timed steps that report it."""
    means = {}
    for name in TRAINER_PHASES:
        values = [float(m[name]) for m in metrics if name in m]
        if values:
            means[name] = round(sum(values) / len(values), 3)
    return means


def main() -> None:
    from calculator_tool.warmup import build_demo_model

    scratch = Path(tempfile.mkdtemp(prefix="miles-bench-async-"))
    model_dir = build_demo_model(scratch / "model", warm=False)
    write_dataset(scratch / "data.jsonl")
    turns = [num_turns(p, s) for p in range(NUM_ROWS) for s in range(SAMPLES_PER_PROMPT)]
    layout = Layout(scratch / "home")
    state = start_platform(layout)
    buffer_metrics_url = state.services["buffer"].ready_url.removesuffix("/readyz") + "/metrics"
    router_url = state.services["router"].ready_url.removesuffix("/readyz")
    results: dict[str, Any] = {}
    try:
        with httpx.Client(base_url=state.controller_url, timeout=60, trust_env=False) as client:
            for mode in MODES:
                print(f"{mode}: {NUM_STEPS} steps", flush=True)
                spec = job_spec(model_dir, scratch / "data.jsonl", mode)
                results[mode] = run_job(client, layout, spec, buffer_metrics_url, router_url)
    finally:
        stop_platform(layout)
    ratio = results["async"]["samples_per_s"] / results["sync"]["samples_per_s"]
    token_ratio = results["async"]["loss_tokens_per_s"] / results["sync"]["loss_tokens_per_s"]
    mean_turns = sum(turns) / len(turns)
    report = {
        "benchmark": "async vs sync: samples/s of the same long-tail tool-turn job, max staleness 2",
        "engine": f"miles-engine --fake-model, {FORWARD_COST_S}s/forward, {PREFILL_COST_S}s/prefilled token",
        "task": f"turns per episode ~ min({MAX_TURNS}, Pareto({ALPHA})): mean {mean_turns:.2f}, max {max(turns)}",
        "steps": NUM_STEPS,
        "timed_from_step": TIMED_FROM_STEP,
        "max_live_episodes": {mode: max_live_episodes(mode) for mode in MODES},
        "groups_per_step": GROUPS_PER_STEP,
        "samples_per_prompt": SAMPLES_PER_PROMPT,
        **results,
        "async_vs_sync": round(ratio, 2),
        "async_vs_sync_loss_tokens": round(token_ratio, 2),
        "machine": describe_machine(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    for mode in ("sync", "async"):
        r = results[mode]
        print(
            f"{mode}: samples_per_s={r['samples_per_s']} engine_idle_fraction={r['engine_idle_fraction']}"
            f" engine_mean_running_requests={r['engine_mean_running_requests']}"
            f" loss_tokens_per_s={r['loss_tokens_per_s']}"
            f" stale_masked_token_fraction={r['stale_masked_token_fraction']}"
            f" dropped_stale_groups={r['dropped_stale_groups']} of pulled_groups={r['pulled_groups']}"
            f" worker_mean_live_episodes={r['worker_mean_live_episodes']}"
            f" trainer_mean_s={r['trainer_mean_s']} version_live_lag_s={r['version_live_lag_s']}"
        )
    print(f"async_vs_sync={ratio:.2f} async_vs_sync_loss_tokens={token_ratio:.2f}")


if __name__ == "__main__":
    main()
