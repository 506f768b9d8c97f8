"""The verifiers connector in its real interpreter (`.envs/verifiers`, verifiers==0.4.0, with the example taskset
`miles-vf-arith` of examples/verifiers_env): an environment server started as the worker starts it, a fake OpenAI
endpoint in this process answering what each test chooses, and verifiers' own machinery (its environment's
multi-turn protocol, its chat-program harness, its interception server, the task's rewards) deciding the reward.

The fake serves what verifiers calls: `POST .../chat/completions` (verifiers' chat program streams: server-sent
events) and `GET .../models`; every request is recorded with the session it came for.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.common.spawn import ProcessSpec, spawn, terminate
from miles.common.testing.processes import wait_for_http_ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # heavy interpreters: make test-slow

REPO_ROOT = Path(__file__).resolve().parents[3]
ENV_PYTHON = REPO_ROOT / ".envs" / "verifiers" / "bin" / "python"
ARGS = {"env_id": "miles-vf-arith", "env_args": {"num_tasks": 6, "seed": 1}}
FEEDBACK_START = "That is not correct."
"""The first words of miles_vf_arith's feedback turn after a wrong answer."""
SAMPLING = {"temperature": 0.7, "max_tokens": 64}
_SESSION_PATH = re.compile(r"^/v1/sessions/([^/]+)/v1/(chat/completions|models)$")


def env_python() -> Path:
    """The verifiers interpreter; its absence fails (not skips) the test: it is part of `make setup`."""
    if not ENV_PYTHON.exists():
        pytest.fail(f"{ENV_PYTHON} is missing: run `make env-verifiers` (make setup builds it)")
    return ENV_PYTHON


@dataclass
class FakeOpenAI:
    """OpenAI endpoints per session (`{root}/v1/sessions/<id>/v1`), like the session server's: each chat
    completion answers the session's next queued reply (500 when none is left)."""

    root: str
    replies: dict[str, list[str]] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def session(self, session_id: str, replies: list[str]) -> tuple[str, str]:
        """(base_url, api_key) of a new session answering `replies` in order."""
        with self.lock:
            self.replies[session_id] = list(replies)
        return f"{self.root}/v1/sessions/{session_id}/v1", f"key-{session_id}"

    def calls(self, session_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.requests if r["session"] == session_id]


def _events(completion: dict[str, Any], content: str) -> bytes:
    """The completion as OpenAI's stream: a role chunk, the content, the finish reason, usage, [DONE]."""
    base = {key: completion[key] for key in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    deltas = [({"role": "assistant", "content": ""}, None), ({"content": content}, None), ({}, "stop")]
    chunks = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": f}]} for d, f in deltas]
    chunks.append({**base, "choices": [], "usage": completion["usage"]})
    return b"".join(f"data: {json.dumps(chunk)}\n\n".encode() for chunk in chunks) + b"data: [DONE]\n\n"


@pytest.fixture(scope="module")
def fake_openai() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI(root="")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _record(self, body: Any) -> str | None:
            match = _SESSION_PATH.match(self.path)
            session = match.group(1) if match else None
            api_key = self.headers.get("Authorization", "").removeprefix("Bearer ")
            with fake.lock:
                fake.requests.append(
                    {"method": self.command, "path": self.path, "session": session, "api_key": api_key, "body": body}
                )
            return session

        def _send(self, status: int, data: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._record(None)
            self._send(200, json.dumps({"object": "list", "data": [{"id": "policy", "object": "model"}]}).encode())

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            session = self._record(body)
            with fake.lock:
                queue = fake.replies.get(session or "", [])
                content = queue.pop(0) if queue else None
            if content is None:
                self._send(500, json.dumps({"error": {"message": f"no reply left for {self.path}"}}).encode())
                return
            usage = {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}
            completion = {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"], "usage": usage}
            if body.get("stream"):
                self._send(200, _events(completion, content), "text/event-stream")
                return
            message = {"role": "assistant", "content": content}
            completion["choices"] = [{"index": 0, "message": message, "finish_reason": "stop"}]
            self._send(200, json.dumps(completion).encode())

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    fake.root = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield fake
    server.shutdown()
    server.server_close()


def server_argv(args: dict[str, Any], port_file: Path) -> list[str]:
    return [
        *(str(env_python()), "-m", "miles.envserver", "--connector", "verifiers"),
        *("--args", json.dumps(args), "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)),
    ]


def wait_for_port_file(port_file: Path, process: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the environment server wrote no port file (exit {process.poll()})")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def env_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A verifiers environment server on miles-vf-arith (six problems); verifiers' imports take ~10 s."""
    directory = tmp_path_factory.mktemp("verifiers")
    port_file, log = directory / "port", directory / "server.log"
    process = spawn(ProcessSpec(argv=tuple(server_argv(ARGS, port_file)), log_path=log, die_with_parent=True))
    try:
        wait_for_port_file(port_file, process)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        wait_for_http_ready(f"{url}/healthz", timeout_s=120, process=process)
        yield url
    except Exception:
        print(log.read_text(errors="replace"))
        raise
    finally:
        terminate(process, grace_s=10)


def rows(env_url: str) -> list[dict[str, Any]]:
    body = httpx.get(f"{env_url}/v1/rows", timeout=10).json()
    result: list[dict[str, Any]] = body["rows"]
    return result


def post_episode(env_url: str, fake: FakeOpenAI, session_id: str, index: int, replies: list[str]) -> httpx.Response:
    """One episode of row `index` in a new session whose model calls are answered with `replies`."""
    base_url, api_key = fake.session(session_id, replies)
    request = {
        "base_url": base_url,
        "api_key": api_key,
        "row_index": index,
        "row": rows(env_url)[index],
        "request_kwargs": SAMPLING,
        "metadata": {"episode_id": session_id},
    }
    return httpx.post(f"{env_url}/v1/episodes", json=request, timeout=120)


def run_episode(env_url: str, fake: FakeOpenAI, session_id: str, index: int, replies: list[str]) -> dict[str, Any]:
    response = post_episode(env_url, fake, session_id, index, replies)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def chat_calls(fake: FakeOpenAI, session_id: str) -> list[dict[str, Any]]:
    return [call for call in fake.calls(session_id) if call["path"].endswith("/chat/completions")]


def test_rows_are_the_tasksets_tasks_with_their_system_prompt_and_answer(env_url: str) -> None:
    info = httpx.get(f"{env_url}/v1/info", timeout=10).json()
    assert (info["connector"], info["environment"], info["num_rows"]) == ("verifiers", "miles-vf-arith", 6)
    for index, row in enumerate(rows(env_url)):
        system, user = row["prompt"]
        assert system["role"] == "system" and "\\boxed{N}" in system["content"]
        assert user["role"] == "user" and re.fullmatch(r"What is \d+ [-+*] \d+\?", user["content"])
        left, operation, right = user["content"].removeprefix("What is ").removesuffix("?").split()
        assert int(row["label"]) == {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}[operation](
            int(left), int(right)
        )
        assert (row["info"]["task_idx"], row["info"]["task_id"]) == (index, f"arith-1-{index}")
        assert len(row["info"]["task_key"]) == 64


def test_right_first_answer_scores_one_by_the_tasks_own_reward(env_url: str, fake_openai: FakeOpenAI) -> None:
    label = rows(env_url)[0]["label"]
    result = run_episode(env_url, fake_openai, "right", 0, [f"Adding them up: \\boxed{{{label}}}"])
    assert result["reward"] == 1.0  # 0.75 * correct + 0.25 * last_number
    assert result["reward_info"] == {"rewards": {"correct": 1.0, "last_number": 1.0}, "metrics": {"attempts": 1.0}}
    assert result["metadata"]["env"] == "miles-vf-arith" and result["metadata"]["num_turns"] == 1
    assert len(chat_calls(fake_openai, "right")) == 1  # a right answer ends the exchange


def test_wrong_answer_gets_the_environments_feedback_and_a_second_turn(env_url: str, fake_openai: FakeOpenAI) -> None:
    row = rows(env_url)[1]
    label = int(row["label"])
    result = run_episode(env_url, fake_openai, "retry", 1, [f"\\boxed{{{label + 1}}}", f"Sorry: \\boxed{{{label}}}"])
    assert result["reward"] == 0.75 * 0.5 + 0.25  # right at the second attempt: RETRY_CREDIT of `correct`
    assert result["reward_info"] == {"rewards": {"correct": 0.5, "last_number": 1.0}, "metrics": {"attempts": 2.0}}
    first, second = chat_calls(fake_openai, "retry")
    assert first["body"]["messages"] == row["prompt"]
    # The second turn extends the first token for token: the model's answer, then the environment's feedback.
    *history, answer, feedback = second["body"]["messages"]
    assert history == row["prompt"]
    assert answer == {"role": "assistant", "content": f"\\boxed{{{label + 1}}}"}
    assert feedback["role"] == "user" and feedback["content"].startswith(FEEDBACK_START)


def test_two_wrong_answers_score_zero_and_an_unboxed_right_number_gets_partial_credit(
    env_url: str, fake_openai: FakeOpenAI
) -> None:
    label = int(rows(env_url)[2]["label"])
    wrong = run_episode(env_url, fake_openai, "wrong", 2, [f"\\boxed{{{label + 1}}}", "I do not know."])
    assert wrong["reward"] == 0.0
    assert wrong["reward_info"] == {"rewards": {"correct": 0.0, "last_number": 0.0}, "metrics": {"attempts": 2.0}}
    unboxed = run_episode(env_url, fake_openai, "unboxed", 2, ["I guess 1", f"It is {label}"])
    assert unboxed["reward"] == 0.25
    assert unboxed["reward_info"]["rewards"] == {"correct": 0.0, "last_number": 1.0}


def test_every_model_call_goes_to_its_sessions_endpoint_with_its_key_and_sampling(
    env_url: str, fake_openai: FakeOpenAI
) -> None:
    """Concurrent episodes: each one's calls reach only its own base_url, with its own api_key."""
    labels = [int(row["label"]) for row in rows(env_url)]
    sessions = {f"concurrent-{i}": i for i in range(3, 6)}
    with ThreadPoolExecutor(len(sessions)) as pool:
        futures = {
            session: pool.submit(run_episode, env_url, fake_openai, session, index, [f"\\boxed{{{labels[index]}}}"])
            for session, index in sessions.items()
        }
        results = {session: future.result() for session, future in futures.items()}
    assert {session: result["reward"] for session, result in results.items()} == dict.fromkeys(sessions, 1.0)
    assert all(call["session"] is not None for call in fake_openai.requests)  # nothing outside a session
    for session in sessions:
        calls = fake_openai.calls(session)
        assert {call["api_key"] for call in calls} == {f"key-{session}"}
        (chat,) = chat_calls(fake_openai, session)
        assert chat["path"] == f"/v1/sessions/{session}/v1/chat/completions"
        assert chat["body"]["model"] == "policy"
        assert {key: chat["body"][key] for key in SAMPLING} == SAMPLING


def test_an_endpoint_failure_is_the_episodes_error(env_url: str, fake_openai: FakeOpenAI) -> None:
    response = post_episode(env_url, fake_openai, "broken", 0, [])  # the fake answers 500: no reply queued
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "environment_error"
    assert "EpisodeFailedError" in error["message"]


BAD_ARGS = [
    ({"env_id": "no-such-taskset"}, ["taskset 'no-such-taskset' not found"]),
    ({"env_args": {}}, ["env_id is required"]),
    ({"env_id": "miles-vf-arith", "env_args": {"num_task": 2}}, ["taskset.num_task", "Extra inputs"]),
    ({"env_id": "miles-vf-arith", "env_config": {"agent": {"max_turn": 2}}}, ["agent.max_turn"]),
    ({"env_id": "miles-vf-arith", "env_config": {"taskset": {}}}, ["give the taskset's fields as env_args"]),
    ({"env_id": "miles-vf-arith", "split": "test"}, ["split: taskset miles-vf-arith has no split", "num_tasks"]),
    ({"env_id": "miles-vf-arith", "num_rows": 0}, ["num_rows must be an integer"]),
    ({"env_id": "miles-vf-arith", "dataset": "x"}, ["unknown args ['dataset']"]),
]
_CREATE_EACH = """
import json, sys
from miles.envserver.connectors.verifiers import create
for args in json.loads(sys.argv[1]):
    try:
        create(args)
        print(json.dumps(None))
    except Exception as exc:
        print(json.dumps([type(exc).__name__, str(exc)]))
"""


def test_bad_args_are_refused_naming_the_field() -> None:
    """All cases in one interpreter (verifiers' imports take seconds); the server's own exit code is below."""
    cases = json.dumps([args for args, _ in BAD_ARGS])
    done = subprocess.run([str(env_python()), "-c", _CREATE_EACH, cases], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for (args, expected), line in zip(BAD_ARGS, done.stdout.splitlines(), strict=True):
        refused = json.loads(line)
        assert refused is not None, f"{args} was accepted"
        kind, message = refused
        assert kind == "ConnectorArgsError", (args, message)
        for text in expected:
            assert text in message, (args, message)


def test_bad_args_stop_the_server_before_it_listens(tmp_path: Path) -> None:
    args = {"env_id": "miles-vf-arith", "env_args": {"num_task": 2}}
    done = subprocess.run(server_argv(args, tmp_path / "port"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "ConnectorArgsError" in done.stderr and "taskset.num_task" in done.stderr
    assert not (tmp_path / "port").exists()
