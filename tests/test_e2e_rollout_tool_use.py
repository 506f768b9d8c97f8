"""Acceptance: the multi-turn tool-use example (`examples/calculator_tool`) rolled out by a real
`miles-rollout-worker` through the whole stack — Redis, engine, router, session server, buffer, sandbox gateway,
all real subprocesses — and every pushed sample checked independently of the session server.

Main path: the real engine with the tiny Qwen3 model in deterministic mode. A random model rarely writes a
tool call, so its episodes run through the agent's nudge branch (user messages between turns). The checks do
not trust the session server: the loss mask is 1 exactly on the engine's outputs (each 1-run ends the turn with
<|im_end|> or at max_tokens, each 0-run is template/user/tool text ending in the assistant generation prompt),
each 1-run is one weight span, and every masked-in logprob equals the engine's own score of that token in one
fresh prefill of the whole sequence (bit-exact in deterministic mode). The session server's comparator must
find 0 critical TITO mismatches.

Tool branch: a scripted SGLang-protocol policy in its own engine pool (test code: the only part that is not
the real engine) answers with a real Qwen3 `<tool_call>`; the example agent runs it in the sandbox gateway and
answers from the tool output, so the partial-credit reward is 1.0 and the tool message is in the tokens.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi import Request  # module level: FastAPI resolves the route's string annotations here
from tokenizers import Tokenizer

from miles.proto.common.v1 import common_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

REPO_ROOT = Path(__file__).resolve().parents[1]
IM_END = 151645
STOP_IDS = (IM_END, 151643)
"""The model's generation_config eos_token_id: <|im_end|> and <|endoftext|> (the tiny model samples the latter now
and then: a CI rehearsal's turn stopped on it)."""
GENERATION_PROMPT_END = r"<\|im_start\|>assistant\n(<think>\n\n</think>\n\n)?$"  # Qwen3, thinking off
NUM_PROMPTS, N_SAMPLES = 3, 4


@pytest.fixture(scope="module")
def stack_options(make_stack_options: Any) -> Any:
    return make_stack_options(engine="tiny", deterministic=True)


def example_rollout(**overrides: Any) -> dict[str, Any]:
    """The example's job spec section with a few groups' worth of overrides."""
    rollout = yaml.safe_load((REPO_ROOT / "examples/calculator_tool/job.yaml").read_text())["rollout"]
    rollout["dataset"].update(limit=NUM_PROMPTS, num_epochs=1)
    rollout["agent"]["config"] = {"max_turns": 3}
    rollout.update(n_samples_per_prompt=N_SAMPLES, request_kwargs={"temperature": 1.0, "max_tokens": 24})
    rollout["concurrency"] = {"max_live_episodes": 6}
    rollout.update(overrides)
    return rollout


def wait_until_exhausted(worker: Any) -> dict[str, Any]:
    while True:
        status = worker.status()
        if status["exhausted"]:
            return status
        assert worker.process.is_running(), worker.log_tail()
        time.sleep(0.3)


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    found: list[tuple[int, int, int]] = []
    for index, value in enumerate(mask):
        if found and found[-1][0] == value:
            found[-1] = (value, found[-1][1], index + 1)
        else:
            found.append((value, index, index + 1))
    return found


def check_sample_shape(sample: common_pb2.Sample, tokenizer: Tokenizer) -> list[tuple[int, int, int]]:
    """Loss mask = engine-sampled tokens only, spans = those tokens, TITO clean; returns the mask runs."""
    num_response = len(sample.tokens) - sample.response_start
    assert len(sample.loss_mask) == len(sample.rollout_logprobs) == num_response
    assert sample.metadata["tito_num_critical"] == 0
    prompt_text = tokenizer.decode(list(sample.tokens[: sample.response_start]), skip_special_tokens=False)
    assert prompt_text.startswith("<|im_start|>system\n") and re.search(GENERATION_PROMPT_END, prompt_text)
    mask_runs = runs(list(sample.loss_mask))
    finishes = list(sample.metadata["finish_reasons"])
    sampled_runs = [run for run in mask_runs if run[0] == 1]
    assert mask_runs[0][0] == 1 and len(sampled_runs) == len(finishes) == sample.metadata["num_turns"]
    for (_, _start, end), finish in zip(sampled_runs, finishes, strict=True):
        last_token = sample.tokens[sample.response_start + end - 1]
        assert last_token in STOP_IDS or finish == "length"
    for _, start, end in (run for run in mask_runs if run[0] == 0):
        gap = tokenizer.decode(
            list(sample.tokens[sample.response_start + start : sample.response_start + end]), skip_special_tokens=False
        )
        assert re.match(r"^(<\|im_end\|>)?\n<\|im_start\|>user\n", gap), gap
        assert re.search(GENERATION_PROMPT_END, gap), gap
        assert all(lp == 0.0 for lp in sample.rollout_logprobs[start:end])
    spans = [(span.start, span.end) for span in sample.weight_versions]
    assert spans == [(start, end) for _, start, end in sampled_runs]
    return mask_runs


def engine_logprobs(engine_url: str, sample: common_pb2.Sample) -> list[float]:
    """The engine's logprob of every response token, scored in one prefill of the whole sequence."""
    body = {
        "input_ids": list(sample.tokens),
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": sample.response_start - 1,
    }
    reply = httpx.post(f"{engine_url}/generate", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    entries = reply.json()["meta_info"]["input_token_logprobs"]
    assert [entry[1] for entry in entries[1:]] == list(sample.tokens[sample.response_start :])
    return [entry[0] for entry in entries[1:]]


def test_calculator_example_through_the_real_engine_gives_exact_samples(stack: Any) -> None:
    job_id = "calc-tiny"
    stack.register_job(job_id)
    worker = stack.worker(job_id, example_rollout()).start()
    status = wait_until_exhausted(worker)
    groups = stack.take_groups(job_id)
    metrics = worker.metrics()

    assert status["cursor"]["num_done"] == NUM_PROMPTS
    assert sorted(group.group_id for group in groups) == [f"{job_id}/e0/p{i}" for i in range(NUM_PROMPTS)]
    tokenizer = Tokenizer.from_file(str(stack.model_dir / "tokenizer.json"))
    num_multi_turn = 0
    for group in groups:
        assert group.job_id == job_id and len(group.samples) == N_SAMPLES
        assert sorted(s.episode_id for s in group.samples) == [f"{group.group_id}/{i}" for i in range(N_SAMPLES)]
        for sample in group.samples:
            assert sample.group_id == group.group_id
            assert sample.status in (common_pb2.SAMPLE_STATUS_COMPLETED, common_pb2.SAMPLE_STATUS_TRUNCATED)
            assert sample.metadata["status_reason"] in ("ok", "truncated")
            assert 0.0 <= sample.reward <= 1.0 and "num_valid_tool_calls" in sample.metadata
            mask_runs = check_sample_shape(sample, tokenizer)
            num_multi_turn += len(mask_runs) > 1
            scored = engine_logprobs(stack.engine_urls[0], sample)
            for index, mask in enumerate(sample.loss_mask):
                if mask:
                    assert sample.rollout_logprobs[index] == pytest.approx(scored[index], abs=1e-5), index
    assert num_multi_turn > 0, "the nudge branch should give multi-turn episodes"
    assert stack.live_sessions(job_id) == []
    assert f'miles_rollout_groups_total{{outcome="queued"}} {float(NUM_PROMPTS)}' in metrics
    assert "miles_rollout_session_delete_failures_total 0.0" in metrics


# --- the tool branch, through a scripted policy --------------------------------------------------------------
class ScriptedToolPolicy:
    """An SGLang-protocol engine (test code) that plays a perfect calculator policy: it answers the user's
    `What is <expr>?` with a Qwen3 tool call, and a tool response with `Answer: <result>`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.url = ""
        self.num_generations = 0
        self._server: Any = None

    def reply_for(self, prompt_text: str) -> str:
        last_turn = prompt_text.rsplit("<|im_start|>user", 1)[-1]
        result = re.search(r"<tool_response>\n(.*?)\n</tool_response>", last_turn, re.DOTALL)
        if result is not None:
            return f"Answer: {result.group(1).strip()}"
        expression = re.findall(r"What is (.+?)\?", prompt_text)[-1]
        call = {"name": "calculator", "arguments": {"expression": expression}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    def app(self) -> Any:
        from fastapi import FastAPI

        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request) -> dict[str, Any]:
            body = await request.json()
            prompt = body["input_ids"]
            ids = [
                *self.tokenizer.encode(
                    self.reply_for(self.tokenizer.decode(prompt, skip_special_tokens=False)), add_special_tokens=False
                ).ids,
                IM_END,
            ]
            self.num_generations += 1
            entries = [[-0.05 * (1 + i % 7), token, None] for i, token in enumerate(ids)]
            meta = {
                "id": "scripted",
                "finish_reason": {"type": "stop", "matched": IM_END},
                "weight_version": "0",
                "prompt_tokens": len(prompt),
                "cached_tokens": 0,
                "completion_tokens": len(ids),
                "output_token_logprobs": entries,
            }
            return {"text": self.tokenizer.decode(ids), "output_ids": ids, "meta_info": meta}

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {}

        @app.get("/model_info")
        async def model_info() -> dict[str, Any]:
            return {"model_path": "scripted", "weight_version": "0"}

        @app.get("/server_info")
        async def server_info() -> dict[str, Any]:
            return {"max_running_requests": 32, "weight_version": "0"}

        return app

    def start(self) -> ScriptedToolPolicy:
        import uvicorn

        from miles.common.testing import free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=self._server.run, daemon=True).start()
        while not self._server.started:
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True


@pytest.fixture
def scripted_pool(stack: Any) -> Iterator[ScriptedToolPolicy]:
    policy = ScriptedToolPolicy(Tokenizer.from_file(str(stack.model_dir / "tokenizer.json"))).start()
    reply = httpx.post(
        f"{stack.router_url}/admin/v1/engines",
        json={"pool": "scripted", "url": policy.url, "max_concurrency": 16},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    yield policy
    httpx.post(f"{stack.router_url}/admin/v1/engines/deregister", json={"pool": "scripted", "url": policy.url})
    policy.stop()


def test_calculator_tool_calls_run_in_the_sandbox_and_earn_full_reward(
    stack: Any, scripted_pool: ScriptedToolPolicy
) -> None:
    job_id = "calc-scripted"
    stack.register_job(job_id, engine_pool="scripted")
    worker = stack.worker(job_id, example_rollout()).start()
    wait_until_exhausted(worker)
    groups = stack.take_groups(job_id)

    assert len(groups) == NUM_PROMPTS, worker.log_tail()
    assert scripted_pool.num_generations == 2 * NUM_PROMPTS * N_SAMPLES
    tokenizer = Tokenizer.from_file(str(stack.model_dir / "tokenizer.json"))
    for group in groups:
        assert len(group.samples) == N_SAMPLES
        for sample in group.samples:
            assert sample.status == common_pb2.SAMPLE_STATUS_COMPLETED and sample.reward == 1.0
            assert sample.metadata["num_valid_tool_calls"] == 1 and sample.metadata["num_turns"] == 2
            mask_runs = check_sample_shape_tool(sample, tokenizer)
            assert len(mask_runs) == 3
    assert stack.live_sessions(job_id) == []
    sandboxes = httpx.get(f"{stack.sandbox_http_url}/v1/sandboxes", params={"job_id": job_id}, timeout=30).json()
    assert sandboxes["sandboxes"] == []


def check_sample_shape_tool(sample: common_pb2.Sample, tokenizer: Tokenizer) -> list[tuple[int, int, int]]:
    """Tokens: the tool call sampled (mask 1), the tool response injected (mask 0), the answer sampled (mask 1)."""
    assert sample.metadata["tito_num_critical"] == 0
    mask_runs = runs(list(sample.loss_mask))
    texts = [
        tokenizer.decode(
            list(sample.tokens[sample.response_start + start : sample.response_start + end]), skip_special_tokens=False
        )
        for _, start, end in mask_runs
    ]
    assert [run[0] for run in mask_runs] == [1, 0, 1]
    assert texts[0].startswith("<tool_call>") and texts[0].endswith("</tool_call><|im_end|>")
    assert "<tool_response>" in texts[1] and "<|im_start|>assistant\n" in texts[1]
    assert texts[2].startswith("Answer: ") and texts[2].endswith("<|im_end|>")
    return mask_runs


def test_unit_tests_verifier_scores_code_in_the_sandbox(stack: Any) -> None:
    import asyncio

    from miles.common.jobspec.rollout import UnitTestsRewardSpec
    from miles.rollout.rewards import unit_tests_score
    from miles.rollout.sandbox import SandboxClient

    tests = (
        "import sys\nfrom solution import add\nok = [add(a, b) == a + b for a, b in [(1, 2), (3, 4)]]\n"
        "print('\\n'.join('PASS' if passed else 'FAIL' for passed in ok))\nsys.exit(0 if all(ok) else 1)\n"
    )
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    half = "def add(a, b):\n    return 3 if a == 1 else 0\n"

    async def score_all() -> list[tuple[float, dict[str, Any]]]:
        client = SandboxClient(stack.sandbox_address)
        try:
            strict = UnitTestsRewardSpec(type="unit_tests")
            partial = UnitTestsRewardSpec(type="unit_tests", partial_credit=True)
            return [
                await unit_tests_score(client, "verifier", good, tests, strict),
                await unit_tests_score(client, "verifier", half, tests, strict),
                await unit_tests_score(client, "verifier", half, tests, partial),
                await unit_tests_score(client, "verifier", None, tests, strict),
            ]
        finally:
            await client.close()

    results = asyncio.run(score_all())
    assert [score for score, _ in results] == [1.0, 0.0, 0.5, 0.0]
    assert results[2][1]["num_pass"] == 1 and results[2][1]["num_fail"] == 1
    sandboxes = httpx.get(f"{stack.sandbox_http_url}/v1/sandboxes", params={"job_id": "verifier"}, timeout=30)
    assert sandboxes.json()["sandboxes"] == []


@pytest.mark.parametrize("example", ["math_single_turn", "terminal_task"])
def test_the_other_examples_run_through_the_stack(stack: Any, example: str) -> None:
    job_id = f"example-{example.replace('_', '-')}"
    stack.register_job(job_id)
    rollout = yaml.safe_load((REPO_ROOT / "examples" / example / "job.yaml").read_text())["rollout"]
    rollout["dataset"].update(limit=1, num_epochs=1)
    rollout["agent"]["config"] = {"max_turns": 2}
    rollout.update(
        n_samples_per_prompt=2,
        group_filters={"drop_equal_rewards": False},
        request_kwargs={"temperature": 1.0, "max_tokens": 12},
    )
    worker = stack.worker(job_id, rollout).start()
    wait_until_exhausted(worker)
    (group,) = stack.take_groups(job_id)

    for sample in group.samples:
        assert sample.status in (common_pb2.SAMPLE_STATUS_COMPLETED, common_pb2.SAMPLE_STATUS_TRUNCATED)
        assert sample.metadata["tito_num_critical"] == 0 and sample.reward in (0.0, 1.0)
    if example == "terminal_task":  # the agent ran the task's check in its sandbox
        assert all("check_exit_code" in sample.metadata["reward_info"] for sample in group.samples)
    assert stack.live_sessions(job_id) == []
    sandboxes = httpx.get(f"{stack.sandbox_http_url}/v1/sandboxes", params={"job_id": job_id}, timeout=30).json()
    assert sandboxes["sandboxes"] == []
