"""The latency parts of make bench-session (session.py runs them): time to first token of a streamed turn, and turn
latency while a ~100 MB session GET is being answered.

TTFT: a fresh session's first turn (a system prompt and a ~TTFT_USER_WORDS-word user message, another each round),
`stream: true`, through a session server in front of a real `miles-engine` (the tiny Qwen3 model on CPU, torch),
against the very /generate the session server sent (its prompt ids, `stream: true`, `return_logprob`) sent straight
to that engine. The engine's prefix cache is flushed before each of the two, so both prefill the whole prompt.
The session figure is the arrival of the first chunk carrying model text (content or reasoning), the direct one the
first chunk carrying a token. Medians of TTFT_ROUNDS rounds.

Head-of-line: a session of BIG_TURNS turns of BIG_TURN_TOKENS tokens each (the zero-latency engine answers them;
realistic 17-digit logprobs) whose `GET /v1/sessions/{id}` is ~100 MB of JSON. Turns of small agent episodes (the
session_overhead_ratio workload) are timed idle and while a second client, in its own process, GETs the big
session over and over; the two conditions alternate in blocks (machine noise hits both alike), and the p99 of each
is compared. The server answers the big session from its export process (exports.py; 3M token ids is over the
default `export_min_tokens`). Everything (bench client, getter, session server and its helper, Redis, engine)
shares this machine's cores: the GET's CPU competes with the turns here.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

TTFT_ROUNDS = 25
TTFT_USER_WORDS = 600
TTFT_MAX_TOKENS = 32
BIG_TURNS = 6
BIG_TURN_TOKENS = 500_000
HOL_BLOCKS = 4
HOL_TURNS_PER_BLOCK = 64
_WORDS = ("the", "build", "failed", "on", "step", "seven:", "check", "the", "cache", "key,", "the", "lock", "file")


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _first_text_s(lines: Iterator[str], started_s: float) -> float | None:
    """Seconds to the first chunk with model text (the stream is read to its end)."""
    first = None
    for line in lines:
        if first is None and line.startswith("data: {"):
            chunk = json.loads(line[len("data: ") :])
            delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
            if delta.get("content") or delta.get("reasoning_content"):
                first = time.perf_counter() - started_s
    return first


def _first_token_s(lines: Iterator[str], started_s: float) -> float | None:
    first = None
    for line in lines:
        is_data = first is None and line.startswith("data: {")
        if is_data and json.loads(line[len("data: ") :])["meta_info"]["completion_tokens"] > 0:
            first = time.perf_counter() - started_s
    return first


def _create(client: httpx.Client, op: dict[str, str], **body: Any) -> tuple[str, dict[str, str]]:
    created = client.post("/v1/sessions", json=body, headers=op).json()
    return created["session_id"], {"authorization": f"Bearer {created['token']}"}


def ttft(session: httpx.Client, engine: httpx.Client, op: dict[str, str]) -> dict[str, Any]:
    """Median TTFT through the session server and direct to the engine, and their ratio."""
    through, direct, num_prompt = [], [], []
    for round_index in range(TTFT_ROUNDS + 1):  # round 0 warms up
        sid, auth = _create(session, op)
        words = " ".join(_WORDS[(round_index + i) % len(_WORDS)] for i in range(TTFT_USER_WORDS))
        messages = [{"role": "system", "content": "You are a build assistant."}, {"role": "user", "content": words}]
        body = {"messages": messages, "max_tokens": TTFT_MAX_TOKENS, "temperature": 0, "stream": True}
        engine.post("/flush_cache").raise_for_status()
        started_s = time.perf_counter()
        with session.stream("POST", f"/v1/sessions/{sid}/v1/chat/completions", json=body, headers=auth) as reply:
            reply.raise_for_status()
            session_s = _first_text_s(reply.iter_lines(), started_s)
        view = session.get(f"/v1/sessions/{sid}", headers=auth).json()
        prompt = view["accumulated_token_ids"][: view["records"][0]["prompt_len"]]
        params = {"max_new_tokens": TTFT_MAX_TOKENS, "temperature": 0, "stop_token_ids": [151645]}
        generate = {"input_ids": prompt, "sampling_params": params, "return_logprob": True, "stream": True}
        engine.post("/flush_cache").raise_for_status()
        started_s = time.perf_counter()
        with engine.stream("POST", "/generate", json=generate) as reply:
            reply.raise_for_status()
            direct_s = _first_token_s(reply.iter_lines(), started_s)
        session.delete(f"/v1/sessions/{sid}", headers=auth)
        if round_index and session_s is not None and direct_s is not None:
            through.append(session_s)
            direct.append(direct_s)
            num_prompt.append(len(prompt))
    through_ms, direct_ms = statistics.median(through) * 1e3, statistics.median(direct) * 1e3
    return {
        "ttft_ratio": round(through_ms / direct_ms, 3),
        "ttft_session_median_ms": round(through_ms, 3),
        "ttft_direct_median_ms": round(direct_ms, 3),
        "ttft_rounds": len(through),
        "ttft_prompt_tokens_median": statistics.median(num_prompt),
        "ttft_engine": "miles-engine, tiny Qwen3 (4 layers, torch CPU), prefix cache flushed before each request",
    }


def build_big_session(client: httpx.Client, op: dict[str, str], model_dir: str) -> tuple[str, dict[str, str], int]:
    """(session id, auth, GET size in bytes) of a session of BIG_TURNS x BIG_TURN_TOKENS sampled tokens."""
    config = {"model_path": model_dir, "model_family": "qwen3", "max_context_tokens": 64_000_000}
    client.put("/v1/jobs/big/config", json=config, headers=op).raise_for_status()
    sid, auth = _create(client, op, job_id="big")
    history: list[dict[str, Any]] = []
    for turn in range(BIG_TURNS):
        history.append({"role": "user", "content": f"Write part {turn} of the log."})
        body = {"messages": history, "max_tokens": BIG_TURN_TOKENS, "temperature": 0}
        reply = client.post(f"/v1/sessions/{sid}/v1/chat/completions", json=body, headers=auth, timeout=600)
        reply.raise_for_status()
        history.append(reply.json()["choices"][0]["message"])
    size = len(client.get(f"/v1/sessions/{sid}", headers=auth, timeout=600).content)
    return sid, auth, size


class _Getter:
    """GETs one session over and over, in its own process, until stopped; keeps each GET's seconds.

    A separate process because an exporter is a separate client: a reader thread in the bench's own process would
    share the timed turn client's GIL, and every GIL hand-off between them (up to the 5 ms switch interval per
    socket read of the turn) would be charged to the server.
    """

    def __init__(self, base_url: str, path: str, auth: dict[str, str]) -> None:
        argv = [sys.executable, __file__, "--get", base_url, path, auth["authorization"]]
        self._process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.seconds: list[float] = []

    def stop_and_join(self) -> None:
        assert self._process.stdin is not None
        out, _ = self._process.communicate("stop\n", timeout=900)
        if self._process.returncode != 0:
            raise RuntimeError(f"the GET loop exited {self._process.returncode}")
        self.seconds = json.loads(out)


def _get_loop(base_url: str, path: str, authorization: str) -> None:
    """The getter process: GET until a line arrives on stdin, then print the seconds of each GET as JSON."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    seconds = []
    with httpx.Client(base_url=base_url, timeout=600) as client:
        while not stop.is_set():
            started_s = time.perf_counter()
            with client.stream("GET", path, headers={"authorization": authorization}) as reply:
                reply.raise_for_status()
                for _ in reply.iter_bytes():
                    pass
            seconds.append(time.perf_counter() - started_s)
    print(json.dumps(seconds))


def head_of_line(
    client: httpx.Client, base_url: str, big: tuple[str, dict[str, str]], turns: Callable[[], list[float]]
) -> dict[str, Any]:
    """p99 turn latency idle and during repeated GETs of the big session (alternating blocks)."""
    idle: list[float] = []
    loaded: list[float] = []
    gets: list[float] = []
    sid, auth = big
    for block in range(2 * HOL_BLOCKS):
        getter = _Getter(base_url, f"/v1/sessions/{sid}", auth) if block % 2 else None
        samples: list[float] = []
        if getter is not None:
            time.sleep(1.0)  # the getter process has started and its GET is under way
        while len(samples) < HOL_TURNS_PER_BLOCK:
            samples += turns()
        if getter is not None:
            getter.stop_and_join()
            gets += getter.seconds
        (loaded if getter is not None else idle).extend(samples)
    idle_p99, loaded_p99 = _p(idle, 0.99) * 1e3, _p(loaded, 0.99) * 1e3
    return {
        "hol_p99_ratio": round(loaded_p99 / idle_p99, 3),
        "hol_idle_turn_p99_ms": round(idle_p99, 3),
        "hol_during_get_turn_p99_ms": round(loaded_p99, 3),
        "hol_idle_turn_p50_ms": round(_p(idle, 0.5) * 1e3, 3),
        "hol_during_get_turn_p50_ms": round(_p(loaded, 0.5) * 1e3, 3),
        "hol_turns_per_condition": len(idle),
        "hol_gets": len(gets),
        "hol_get_median_s": round(statistics.median(gets), 3) if gets else None,
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--get"]:
        _get_loop(*sys.argv[2:5])
