"""The openenv connector in its real interpreter (`.envs/openenv`, openenv-core==0.3.0): an environment server
started as the worker starts it, which starts a real OpenEnv server (the guess-the-number environment of
examples/openenv_env, built with OpenEnv's own `create_app`) and plays it over OpenEnv's WebSocket sessions; a fake
OpenAI chat endpoint in this process plays the policy each test chooses (it reads the environment's feedback).
The args and the reply-to-action rules are also tested in-process (no OpenEnv needed: the connector imports it
lazily)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.common.spawn import ProcessSpec, spawn, terminate
from miles.common.testing.processes import wait_for_http_ready
from miles.envserver.base import ConnectorArgsError
from miles.envserver.connectors.openenv import InvalidActionError, parse_args, reply_to_action

REPO_ROOT = Path(__file__).resolve().parents[3]
ENV_PYTHON = REPO_ROOT / ".envs" / "openenv" / "bin" / "python"
APP = "miles_guess_number.server.app:app"
HIGH, MAX_GUESSES = 64, 7
ARGS = {
    "app": APP,
    "num_rows": 6,
    "reset": {"high": HIGH, "max_guesses": MAX_GUESSES},
    "observation_field": "prompt",
    "action_field": "guess",
    "max_sessions": 4,
    "env": {"MILES_GUESS_NUMBER_MAX_SESSIONS": "4"},
}
Policy = Callable[[list[dict[str, Any]]], str]


def env_python() -> Path:
    """OpenEnv's interpreter; its absence fails (not skips) the test: it is part of `make setup`."""
    if not ENV_PYTHON.exists():
        pytest.fail(f"{ENV_PYTHON} is missing: run `make env-openenv` (make setup builds it)")
    return ENV_PYTHON


def secret_of(seed: int) -> int:
    """The environment's secret for a seed (GuessNumberEnvironment.reset), to check its scoring from outside."""
    return random.Random(seed).randint(1, HIGH)


def bisect(messages: list[dict[str, Any]]) -> str:
    """The right policy: binary search on the environment's higher/lower feedback in the conversation."""
    turns = [m for m in messages if m["role"] in ("user", "assistant")]
    low, high = 1, int(re.search(r"between 1 and (\d+)", turns[0]["content"]).group(1))  # type: ignore[union-attr]
    for reply, feedback in zip(turns[1::2], turns[2::2], strict=False):
        guess = int(re.findall(r"-?\d+", reply["content"])[-1])  # the reply's last integer, as the environment reads
        if feedback["content"].startswith("Higher"):
            low = guess + 1
        elif feedback["content"].startswith("Lower"):
            high = guess - 1
    return str((low + high) // 2)


def bisect_steps(seed: int) -> int:
    low, high, steps = 1, HIGH, 1
    while (guess := (low + high) // 2) != secret_of(seed):
        low, high, steps = (guess + 1, high, steps + 1) if guess < secret_of(seed) else (low, guess - 1, steps + 1)
    return steps


@dataclass
class FakeChat:
    """An OpenAI chat-completions endpoint: each API key's policy answers its conversation."""

    url: str
    policies: dict[str, Policy] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def calls(self, api_key: str) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.requests if r["api_key"] == api_key]


@pytest.fixture(scope="module")
def fake_chat() -> Iterator[FakeChat]:
    chat = FakeChat(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            api_key = self.headers.get("Authorization", "").removeprefix("Bearer ")
            with chat.lock:
                chat.requests.append({"path": self.path, "api_key": api_key, "body": body})
            message = {"role": "assistant", "content": chat.policies[api_key](body["messages"])}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            answer = {"id": "x", "object": "chat.completion", "choices": [choice]}
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    chat.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield chat
    server.shutdown()
    server.server_close()


def server_argv(args: dict[str, Any], port_file: Path) -> list[str]:
    return [
        *(str(env_python()), "-m", "miles.envserver", "--connector", "openenv"),
        *("--args", json.dumps(args), "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)),
    ]


@dataclass
class EnvServer:
    url: str
    process: subprocess.Popen[bytes]


@contextlib.contextmanager
def start_server(args: dict[str, Any], directory: Path) -> Iterator[EnvServer]:
    port_file, log = directory / "port", directory / "server.log"
    process = spawn(ProcessSpec(argv=tuple(server_argv(args, port_file)), log_path=log, die_with_parent=True))
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the environment server wrote no port file (exit {process.poll()})")
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        wait_for_http_ready(f"{url}/healthz", timeout_s=120, process=process)
        yield EnvServer(url, process)
    except Exception:
        print(log.read_text(errors="replace"))
        raise
    finally:
        terminate(process, grace_s=10)
        print(log.read_text(errors="replace")[-3000:])


@pytest.fixture(scope="module")
def env_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvServer]:
    """The guessing game in [1, 64] with 7 guesses, rows seeded 0..5, the reply text as the guess."""
    with start_server(ARGS, tmp_path_factory.mktemp("openenv")) as server:
        yield server


def rows(server: EnvServer) -> list[dict[str, Any]]:
    body = httpx.get(f"{server.url}/v1/rows", timeout=10).json()
    result: list[dict[str, Any]] = body["rows"]
    return result


def post_episode(server: EnvServer, chat: FakeChat, index: int, policy: Policy, key: str) -> httpx.Response:
    chat.policies[key] = policy
    request = {
        "base_url": chat.url,
        "api_key": key,
        "row_index": index,
        "row": rows(server)[index],
        "request_kwargs": {"temperature": 0.7, "max_tokens": 16},
        "metadata": {"episode_id": f"episode-{key}"},
    }
    return httpx.post(f"{server.url}/v1/episodes", json=request, timeout=120)


def run_episode(server: EnvServer, chat: FakeChat, index: int, policy: Policy, key: str) -> dict[str, Any]:
    response = post_episode(server, chat, index, policy, key)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


@pytest.mark.integration
@pytest.mark.slow
def test_rows_are_the_seeded_resets_of_the_environment_named_by_its_server(env_server: EnvServer) -> None:
    info = httpx.get(f"{env_server.url}/v1/info", timeout=10).json()
    assert (info["connector"], info["environment"], info["num_rows"]) == ("openenv", "guess_number", 6)
    for seed, row in enumerate(rows(env_server)):
        assert row["info"] == {"reset": {"high": HIGH, "max_guesses": MAX_GUESSES, "seed": seed}}
        assert row["prompt"].startswith("OpenEnv guess_number: reset(")


@pytest.mark.integration
@pytest.mark.slow
def test_bisecting_policy_is_rewarded_by_the_environments_own_steps(env_server: EnvServer, fake_chat: FakeChat) -> None:
    result = run_episode(env_server, fake_chat, 0, bisect, "right-0")
    steps = bisect_steps(0)
    assert result["reward"] == 1.0
    assert result["turn_rewards"] == [0.0] * (steps - 1) + [1.0]
    assert result["reward_info"] == {
        "return": 1.0,
        "num_steps": steps,
        "done": True,
        "truncated": False,
        "invalid_action": None,
    }
    calls = fake_chat.calls("right-0")
    assert len(calls) == steps
    # The conversation is the environment's: its reset prompt, then its feedback on each guess.
    last = calls[-1]["body"]["messages"]
    assert last[0]["role"] == "user" and last[0]["content"].startswith("I am thinking of an integer between 1 and 64")
    assert all(m["content"].startswith(("Higher.", "Lower.")) for m in last[2::2])
    assert int(bisect(last)) == secret_of(0)  # the last reply, the guess the environment rewarded
    assert calls[0]["path"] == "/v1/chat/completions"
    assert (calls[0]["body"]["temperature"], calls[0]["body"]["max_tokens"]) == (0.7, 16)


@pytest.mark.integration
@pytest.mark.slow
def test_wrong_policy_scores_zero_after_every_guess(env_server: EnvServer, fake_chat: FakeChat) -> None:
    result = run_episode(env_server, fake_chat, 1, lambda messages: "I guess 0", "wrong-1")
    assert result["reward"] == 0.0
    assert result["turn_rewards"] == [0.0] * MAX_GUESSES
    assert (result["reward_info"]["num_steps"], result["reward_info"]["done"]) == (MAX_GUESSES, True)
    final = fake_chat.calls("wrong-1")[-1]["body"]["messages"]
    assert final[-1]["content"] == "Higher. 1 guesses left."


@pytest.mark.integration
@pytest.mark.slow
def test_concurrent_episodes_keep_their_own_sessions(env_server: EnvServer, fake_chat: FakeChat) -> None:
    """Four episodes at once, each in an OpenEnv session of its own: no first guess is answered before all four
    episodes asked for one, and each bisects to its own row's secret."""
    all_started = threading.Barrier(4, timeout=60)

    def bisect_together(messages: list[dict[str, Any]]) -> str:
        if len(messages) == 1:  # the reset's prompt only: the episode's first model call
            all_started.wait()  # broken (and the episode failed) if the episodes ran one after another
        return bisect(messages)

    with ThreadPoolExecutor(4) as pool:
        futures = {
            seed: pool.submit(run_episode, env_server, fake_chat, seed, bisect_together, f"parallel-{seed}")
            for seed in (2, 3, 4, 5)
        }
        results = {seed: future.result() for seed, future in futures.items()}
    for seed, result in results.items():
        assert result["reward"] == 1.0
        assert result["reward_info"]["num_steps"] == bisect_steps(seed)
        assert result["metadata"]["reset"]["seed"] == seed


@pytest.mark.integration
@pytest.mark.slow
def test_json_actions_and_refused_actions_end_the_episode(tmp_path: Path, fake_chat: FakeChat) -> None:
    """Without action_field the reply is the action as JSON; the server admits one session at a time while the
    connector plays three episodes at once (it waits out OpenEnv's CAPACITY_REACHED)."""
    args = {
        **{k: v for k, v in ARGS.items() if k not in ("action_field", "env")},
        **{"max_sessions": 3, "env": {"MILES_GUESS_NUMBER_MAX_SESSIONS": "1"}},
        "system_prompt": "Act with one JSON object of this schema: {action_schema}",
    }
    with start_server(args, tmp_path) as server:
        with ThreadPoolExecutor(3) as pool:
            futures = [
                pool.submit(
                    run_episode, server, fake_chat, 0, lambda m: f'```json\n{{"guess": "{bisect(m)}"}}\n```', "j0"
                ),
                pool.submit(run_episode, server, fake_chat, 1, lambda m: "fifty", "j1"),
                pool.submit(run_episode, server, fake_chat, 2, lambda m: '{"gues": 5}', "j2"),
            ]
            right, no_json, refused = (future.result() for future in futures)
        assert (right["reward"], right["reward_info"]["num_steps"]) == (1.0, bisect_steps(0))
        system = fake_chat.calls("j0")[0]["body"]["messages"][0]
        assert system["role"] == "system" and '"guess": {' in system["content"] and "metadata" not in system["content"]
        assert no_json["reward"] == 0.0 and no_json["turn_rewards"] == [0.0]
        assert no_json["reward_info"]["invalid_action"].startswith("the reply holds no JSON object")
        assert refused["reward"] == 0.0 and refused["reward_info"]["num_steps"] == 0
        assert "VALIDATION_ERROR" in refused["reward_info"]["invalid_action"]


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.mark.integration
@pytest.mark.slow
def test_a_crashed_openenv_server_fails_its_episode_and_is_started_again(tmp_path: Path, fake_chat: FakeChat) -> None:
    with start_server({**ARGS, "num_rows": 2}, tmp_path) as server:
        (openenv_pid,) = children_of(server.process.pid)

        def crash(messages: list[dict[str, Any]]) -> str:
            os.kill(openenv_pid, signal.SIGKILL)
            time.sleep(0.5)
            return "32"

        response = post_episode(server, fake_chat, 0, crash, "crash-0")
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert error["code"] == "environment_error"
        assert "the OpenEnv server exited with code -9" in error["message"]
        # The next episode starts it again and plays as usual.
        assert run_episode(server, fake_chat, 1, bisect, "after-crash-1")["reward"] == 1.0
        restarted = children_of(server.process.pid)
        assert len(restarted) == 1 and restarted != [openenv_pid]


@pytest.mark.integration
@pytest.mark.slow
def test_base_url_plays_an_openenv_server_run_elsewhere(tmp_path: Path, fake_chat: FakeChat) -> None:
    """A server the connector does not start (a sidecar or pod on Kubernetes): only its URL is given."""
    port = 0
    argv = (str(env_python()), "-m", "uvicorn", APP, "--host", "127.0.0.1", "--port", "0")
    sidecar = spawn(ProcessSpec(argv=argv, log_path=tmp_path / "sidecar.log", die_with_parent=True))
    try:
        deadline = time.monotonic() + 120
        while not port:
            match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", (tmp_path / "sidecar.log").read_text())
            port = int(match.group(1)) if match else 0
            assert sidecar.poll() is None and time.monotonic() < deadline, (tmp_path / "sidecar.log").read_text()
            time.sleep(0.1)
        args = {k: v for k, v in ARGS.items() if k not in ("app", "env")} | {"base_url": f"http://127.0.0.1:{port}"}
        with start_server(args, tmp_path / "server") as server:
            assert children_of(server.process.pid) == []
            assert run_episode(server, fake_chat, 3, bisect, "remote-3")["reward"] == 1.0
    finally:
        terminate(sidecar, grace_s=10)


@pytest.mark.integration
@pytest.mark.slow
def test_bad_args_stop_the_server_before_it_listens_naming_the_field(tmp_path: Path) -> None:
    args = {**ARGS, "base_url": "http://127.0.0.1:1"}
    done = subprocess.run(server_argv(args, tmp_path / "port"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "ConnectorArgsError: give exactly one of app, command and base_url" in done.stderr
    assert not (tmp_path / "port").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"base_url": "http://127.0.0.1:1"}, "give exactly one of app, command and base_url"),
        ({"app": None, "command": "uvicorn x:app"}, "command must be a non-empty list of strings"),
        ({"app": None, "base_url": "localhost:8000"}, "base_url must be an http(s):// or ws(s):// URL"),
        ({"app": "no colon"}, "app must be 'module:attribute'"),
        ({"reward": "max"}, "reward must be 'sum' or 'last'"),
        ({"rows": [{"seed": 1}]}, "give rows or num_rows, not both"),
        ({"num_rows": 0}, "num_rows must be an integer in [1, 1e+06]"),
        ({"max_sessions": 1.5}, "max_sessions must be an integer"),
        ({"env": {"N": 1}}, "env must be an object of strings"),
        ({"max_turn": 3}, "unknown args ['max_turn']"),
    ],
)
def test_bad_args_are_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConnectorArgsError) as caught:
        parse_args({k: v for k, v in {**ARGS, **change}.items() if v is not None})
    assert message in str(caught.value)


def test_rows_are_resets_under_the_common_reset_args() -> None:
    args = parse_args({"app": APP, "reset": {"high": 8, "seed": 9}, "rows": [{"seed": 1}, {"high": 4}]})
    assert args.resets == [{"high": 8, "seed": 1}, {"high": 4, "seed": 9}]
    assert parse_args({"app": APP, "num_rows": 2}).resets == [{"seed": 0}, {"seed": 1}]


@pytest.mark.parametrize(
    ("reply", "action"),
    [
        ('{"guess": "5"}', {"guess": "5"}),
        ('<think>maybe {"guess": "1"}</think>\n```json\n{"guess": "7"}\n```', {"guess": "7"}),
        ('I pick {"guess": "3", "why": {"a": 1}} now', {"guess": "3", "why": {"a": 1}}),
    ],
)
def test_a_json_reply_is_the_action(reply: str, action: dict[str, Any]) -> None:
    assert reply_to_action(reply, None) == action


@pytest.mark.parametrize("reply", ["fifty", "[1, 2]", "{not json}", "} {"])
def test_a_reply_without_a_json_object_is_no_action(reply: str) -> None:
    with pytest.raises(InvalidActionError):
        reply_to_action(reply, None)


def test_with_an_action_field_the_reply_text_is_the_action_without_think_blocks() -> None:
    assert reply_to_action("<think>2 or 3?</think>\n I say 3 ", "guess") == {"guess": "I say 3"}


def marked_processes(mark: str) -> list[int]:
    """Processes whose environment has MILES_TEST_MARK=mark."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"MILES_TEST_MARK={mark}".encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.integration
@pytest.mark.slow
def test_a_field_the_environment_lacks_fails_setup_and_stops_its_server(tmp_path: Path) -> None:
    mark = f"missing-field-{os.getpid()}"
    args = {**ARGS, "action_field": "answer", "env": {"MILES_TEST_MARK": mark}}
    done = subprocess.run(server_argv(args, tmp_path / "port"), capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stderr
    assert "action_field: guess_number's action has no field 'answer'; its fields: ['guess', 'metadata']" in done.stderr
    assert (tmp_path / "port").exists()  # it listened (setup runs after), started OpenEnv's server, then failed
    assert marked_processes(mark) == []  # and stopped that server before it exited
