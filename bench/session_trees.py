"""make bench-session_trees: what a large tree session costs its live turns when it is read, and how many training
tokens a packed tree sample would save, measured in one run.

Both parts run a real `miles-session-server` (Redis store, real Qwen3 tokenizer, qwen3 family) in front of
bench/session.py's zero-latency engine (a subprocess answering /generate at once with a fixed 4-token completion),
so that what is measured is the session server.

(a) GET during turns. A tree session grows to TREE_NODES nodes: a first turn whose prompt is ~2K tokens, then
NUM_BRANCHES branches forked from it, each a chain of BRANCH_DEPTH turns (built by BUILD_THREADS threads at once);
a second session of the same shape is built beside it. Live turns then fork the first session's first turn (one new
leaf each: the same work per turn), timed from this process, in ROUNDS rounds of three phases (their order rotated
each round, so machine noise hits all alike):
- quiet: the turns alone;
- get_same: the turns while a separate process GETs the same session's whole tree back to back (every node's
  messages and record, ~0.6 MB of JSON);
- get_other: the same stream of GETs, of the other session (as large as the live one is halfway through).
A GET takes no session lock. get_same / quiet is what a stream of GETs costs the turns on this machine, where the
server, Redis and both clients share two cores: it includes the GETs' CPU in the one server process. get_same /
get_other isolates blocking: a GET that held up turns of its own session would make it well above 1; the same
CPU spent on another session's GET leaves it at ~1.

(b) Packed tree samples. For K in FORK_COUNTS, a fresh tree session: the same ~2K-token first turn, then K forks
(one short follow-up each). One sample per leaf trains the shared prefix K times; a packed tree sample would train
each token once: `num_path_tokens / num_tree_tokens` from the samples' session_metadata.tree is the saving.

Prints the ratios and writes bench/results/session_trees.json.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import httpx

from miles.common.testing import RedisServer, ServiceProcess, free_port
from miles.common.testing.machine import describe_machine
from miles.common.testing.smoke import console_script

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import session as session_bench  # noqa: E402  bench/session.py: its model directory and zero-latency engine

NUM_BRANCHES, BRANCH_DEPTH = 50, 10
TREE_NODES = 1 + NUM_BRANCHES * BRANCH_DEPTH
BUILD_THREADS = 8
ROUNDS = 8
TURNS_PER_PHASE = 15
"""Live turns add (3 x ROUNDS + 1) x TURNS_PER_PHASE leaves: 876 nodes in all, below max_tree_nodes (1024)."""
MID_RUN_LIVE_LEAVES = (1 + 3 * ROUNDS // 2) * TURNS_PER_PHASE
"""The other session's extra leaves: its GETs read as many nodes as the live session's do halfway through."""
FORK_COUNTS = (2, 4, 8, 16, 32)
PREFIX_SENTENCES = 75
"""Sentences of the first turn's system message: ~2,000 tokens with the chat template."""
MAX_TOKENS = 16
OPERATOR = {"authorization": f"Bearer {session_bench.OPERATOR_TOKEN}"}
RESULTS = BENCH_DIR / "results" / "session_trees.json"
_WORDS = ("cache", "worker", "shard", "lock", "router", "replica", "batch", "prompt", "weights", "queue", "audit",
          "metrics", "timeout", "retry", "checkpoint", "region")  # fmt: skip


def _text(rng: random.Random, num_sentences: int) -> str:
    """Varied text with numbers, ~27 Qwen3 tokens a sentence."""
    return " ".join(
        f"{i + 1}. The {rng.choice(_WORDS)} {rng.choice(_WORDS)} saw {rng.randint(2, 9999)} {rng.choice(_WORDS)} "
        f"events on node-{rng.randint(1, 99)} at step {rng.randint(1, 999)}."
        for i in range(num_sentences)
    )


FIRST_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You triage incidents. Log:\n" + _text(random.Random(7), PREFIX_SENTENCES)},
    {"role": "user", "content": "Which component failed first?"},
]


@contextlib.contextmanager
def _session_server(scratch: Path) -> Iterator[str]:
    """Redis, the zero-latency engine and a session server in front of it; yields the session server's URL."""
    redis_server = RedisServer(scratch / "redis", free_port())
    redis_server.start()
    engine_port, session_port = free_port(), free_port()
    engine_url, session_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{session_port}"
    env = {
        "MILES_SESSION_PORT": str(session_port),
        "MILES_SESSION_REDIS_URL": redis_server.url,
        "MILES_SESSION_UPSTREAM_URL": engine_url,
        "MILES_SESSION_OPERATOR_TOKEN": session_bench.OPERATOR_TOKEN,
        "MILES_SESSION_DEFAULT_MODEL_PATH": str(session_bench._model_dir(scratch)),
        "MILES_SESSION_DEFAULT_MODEL_FAMILY": "qwen3",
        "MILES_SESSION_LOG_LEVEL": "WARNING",
    }
    engine_argv = [sys.executable, str(BENCH_DIR / "session.py"), "--serve", "engine", str(engine_port), ""]
    try:
        with (
            ServiceProcess(engine_argv, ready_url=f"{engine_url}/readyz", log_path=scratch / "engine.log"),
            ServiceProcess(
                [console_script("miles-session-server")],
                ready_url=f"{session_url}/readyz",
                env=env,
                log_path=scratch / "session.log",
            ),
        ):
            yield session_url
    finally:
        redis_server.stop()


def _create_tree(client: httpx.Client) -> tuple[str, dict[str, str]]:
    created = client.post("/v1/sessions", json={"tree": True}, headers=OPERATOR)
    created.raise_for_status()
    return created.json()["session_id"], {"authorization": f"Bearer {created.json()['token']}"}


def _turn(client: httpx.Client, sid: str, auth: dict[str, str], messages: list[Any]) -> tuple[float, dict[str, Any]]:
    """One chat turn: its seconds and the response."""
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    started = time.perf_counter()
    response = client.post(f"/v1/sessions/{sid}/v1/chat/completions", json=body, headers=auth)
    seconds = time.perf_counter() - started
    response.raise_for_status()
    return seconds, response.json()


def _first_turn(client: httpx.Client, sid: str, auth: dict[str, str]) -> tuple[list[dict[str, Any]], int]:
    """The ~2K-token first turn: its history (the first messages and the reply) and its number of tokens."""
    _, first = _turn(client, sid, auth, FIRST_MESSAGES)
    return [*FIRST_MESSAGES, first["choices"][0]["message"]], int(first["usage"]["total_tokens"])


def _grow_branch(url: str, sid: str, auth: dict[str, str], root: list[dict[str, Any]], branch: int) -> None:
    rng = random.Random(branch)
    history = list(root)
    with httpx.Client(base_url=url, timeout=120) as client:
        for step in range(BRANCH_DEPTH):
            history.append({"role": "user", "content": f"Branch {branch} step {step}: {_text(rng, 2)}"})
            _, reply = _turn(client, sid, auth, history)
            history.append(reply["choices"][0]["message"])


def _get_stream(url: str, sid: str, auth: dict[str, str], active: Event, done: Event, out: Any) -> None:
    """Separate process: GET the whole tree back to back while `active` is set; sends (seconds, bytes) per GET."""
    seconds: list[float] = []
    num_bytes = 0
    with httpx.Client(base_url=url, timeout=120) as client:
        while not done.is_set():
            if not active.wait(0.05):
                continue
            started = time.perf_counter()
            response = client.get(f"/v1/sessions/{sid}", headers=auth)
            response.raise_for_status()
            num_bytes = len(response.content)
            seconds.append(time.perf_counter() - started)
    out.put((seconds, num_bytes))


@dataclass
class GetStream:
    """A `_get_stream` process on one session, paused until `active` is set."""

    process: Any
    active: Event
    done: Event
    out: Any

    @classmethod
    def start(cls, url: str, sid: str, auth: dict[str, str]) -> GetStream:
        context = multiprocessing.get_context("spawn")
        active, done, out = context.Event(), context.Event(), context.Queue()
        process = context.Process(target=_get_stream, args=(url, sid, auth, active, done, out))
        process.start()
        return cls(process, active, done, out)

    def stop(self) -> tuple[list[float], int]:
        self.done.set()
        seconds, num_bytes = self.out.get(timeout=120)
        self.process.join(timeout=60)
        return seconds, num_bytes


def _percentiles_ms(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered) * 1e3, 3), "p99": round(p99 * 1e3, 3), "n": len(ordered)}


def _live_turns(client: httpx.Client, sid: str, auth: dict[str, str], root: list[Any], start: int) -> list[float]:
    """TURNS_PER_PHASE forks of the first turn, each with its own follow-up: seconds per turn."""
    return [
        _turn(client, sid, auth, [*root, {"role": "user", "content": f"Live follow-up {start + i}: next step?"}])[0]
        for i in range(TURNS_PER_PHASE)
    ]


def _big_tree(url: str, num_extra_leaves: int = 0) -> tuple[str, dict[str, str], list[dict[str, Any]]]:
    """A tree session of TREE_NODES nodes (module docstring) and `num_extra_leaves` forks of its first turn;
    returns its id, auth and first turn's history."""
    with httpx.Client(base_url=url, timeout=120) as client:
        sid, auth = _create_tree(client)
        root, _ = _first_turn(client, sid, auth)
        with ThreadPoolExecutor(BUILD_THREADS) as pool:
            list(pool.map(lambda branch: _grow_branch(url, sid, auth, root, branch), range(NUM_BRANCHES)))
        for index in range(num_extra_leaves):
            _turn(client, sid, auth, [*root, {"role": "user", "content": f"Earlier follow-up {index}: next step?"}])
    return sid, auth, root


def _phase_turns(
    url: str, sid: str, auth: dict[str, str], root: list[Any], streams: dict[str, GetStream | None]
) -> dict[str, list[float]]:
    """ROUNDS rounds of every phase (the order rotated each round): per phase, the seconds of its turns."""
    seconds: dict[str, list[float]] = {phase: [] for phase in streams}
    phases = list(streams)
    with httpx.Client(base_url=url, timeout=120) as client:
        _live_turns(client, sid, auth, root, -TURNS_PER_PHASE)  # warm-up
        for round_index in range(ROUNDS):
            for offset in range(len(phases)):
                phase = phases[(round_index + offset) % len(phases)]
                stream = streams[phase]
                if stream is not None:
                    stream.active.set()
                    time.sleep(0.2)  # the stream is under way before the first timed turn
                start = (round_index * len(phases) + offset) * TURNS_PER_PHASE
                seconds[phase] += _live_turns(client, sid, auth, root, start)
                if stream is not None:
                    stream.active.clear()
    return seconds


def get_during_turns(url: str) -> dict[str, Any]:
    """Part (a) of the module docstring."""
    sid, auth, root = _big_tree(url)
    other_sid, other_auth, _ = _big_tree(url, MID_RUN_LIVE_LEAVES)
    same, other = GetStream.start(url, sid, auth), GetStream.start(url, other_sid, other_auth)
    try:
        turns = _phase_turns(url, sid, auth, root, {"quiet": None, "get_same": same, "get_other": other})
    finally:
        get_seconds, get_bytes = same.stop()
        other.stop()
    stats = httpx.get(f"{url}/v1/sessions/{sid}", headers=auth, timeout=120).json()["tree"]["stats"]
    ms = {phase: _percentiles_ms(values) for phase, values in turns.items()}
    return {
        "same_over_quiet_p50_ratio": round(ms["get_same"]["p50"] / ms["quiet"]["p50"], 3),
        "same_over_quiet_p99_ratio": round(ms["get_same"]["p99"] / ms["quiet"]["p99"], 3),
        "same_over_other_p50_ratio": round(ms["get_same"]["p50"] / ms["get_other"]["p50"], 3),
        "same_over_other_p99_ratio": round(ms["get_same"]["p99"] / ms["get_other"]["p99"], 3),
        "turn_ms": ms,
        "get_ms": _percentiles_ms(get_seconds),
        "get_response_bytes": get_bytes,
        "tree_nodes_built": TREE_NODES,
        "tree_stats_at_end": stats,
    }


def packed_tree_savings(url: str) -> dict[str, Any]:
    """Part (b) of the module docstring: per K, num_path_tokens / num_tree_tokens of K forks of one prefix."""
    by_forks: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=120) as client:
        for num_forks in FORK_COUNTS:
            sid, auth = _create_tree(client)
            root, num_shared = _first_turn(client, sid, auth)
            for fork in range(num_forks):
                _turn(client, sid, auth, [*root, {"role": "user", "content": f"Option {fork}: is it safe to retry?"}])
            merged = client.post(f"/v1/sessions/{sid}/samples", json={}, headers=auth).json()
            tree = merged["session_metadata"]["tree"]
            assert len(merged["samples"]) == num_forks == tree["num_leaves"], tree
            by_forks[str(num_forks)] = {
                "num_shared_prefix_tokens": num_shared,
                "num_path_tokens": int(tree["num_path_tokens"]),
                "num_tree_tokens": int(tree["num_tree_tokens"]),
                "path_over_tree_ratio": round(tree["num_path_tokens"] / tree["num_tree_tokens"], 3),
            }
            client.delete(f"/v1/sessions/{sid}", headers=auth)
    return by_forks


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="bench-session-trees-"))
    try:
        with _session_server(scratch) as url:
            savings = packed_tree_savings(url)
            reads = get_during_turns(url)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = {
        "get_during_turns": reads,
        "packed_tree_savings_by_num_forks": savings,
        "prefix_sentences": PREFIX_SENTENCES,
        "machine": describe_machine(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    get, num_bytes = reads["get_ms"], reads["get_response_bytes"]
    num_nodes = reads["tree_stats_at_end"]["num_nodes"]
    print(f"tree of {num_nodes} nodes; GET p50/p99 {get['p50']}/{get['p99']} ms, {num_bytes} bytes")
    for phase, ms in reads["turn_ms"].items():
        print(f"turns {phase}: p50/p99 {ms['p50']}/{ms['p99']} ms")
    for name in ("same_over_quiet", "same_over_other"):
        print(f"{name}_ratio p50={reads[f'{name}_p50_ratio']} p99={reads[f'{name}_p99_ratio']}")
    for num_forks, row in savings.items():
        print(f"packed_tree_savings forks={num_forks} path_over_tree={row['path_over_tree_ratio']}")


if __name__ == "__main__":
    main()
