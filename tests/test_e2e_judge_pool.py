"""Acceptance: a reward function asks a judge served by the job's own inference pool (LLM-as-judge), end to end.

The demo job (`examples/calculator_tool/job.yaml`), cut to one step, declares `inference_pools: [judge]` (the tiny
demo model again, on an engine of its own) and scores episodes with a reward function that opens a session on the
judge (`miles.rollout.pools.pool_session`) and asks it through the OpenAI client, greedily; the reward is derived
from the judge's words added to the task's own reward (the tiny judge is shown the task and the episode's answer:
it is no real judge, and any function of its words shows the path works; the task's reward keeps a group's rewards
apart, so that the step has a signal). The controller's real pieces run in this process over the `stack`'s
shared services: `SharedServicesClient.register` (the judge's session-server job config `<job>--judge`) and the
`LocalJobBackend` (the judge's engine in router pool `<job>--judge`, the policy's engine, its weight-sync origin,
a rollout worker and the trainer).

Checked: the job SUCCEEDS; every judge call ran in a session of its own (distinct session ids) and got a greedy
answer of at least one token; the step's mean reward is that of one group of those calls (the
rewards the function derived from the judge's words reached the trainer); the judge's engine generated at least
the judge's answers' tokens; no finished judge call's session is left at the session server (nothing of the judge
is recorded for training).

About 2 minutes on 2 shared cores.
"""

from __future__ import annotations

import asyncio
import json
import re
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from miles.common.jobspec.job import JobSpec
from miles.controller.backends.base import JobProgress
from miles.controller.backends.local import LocalJobBackend
from miles.controller.shared import SharedServicesClient

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

REPO_ROOT = Path(__file__).resolve().parents[1]
JOB_ID = "judged"
JUDGE_REWARD = """
import json
from pathlib import Path

import openai

from calculator_tool.reward import reward as task_reward
from miles.rollout.pools import pool_session

CALLS = Path({calls!r})


async def reward(prompt, samples, agent_result):
    answer = agent_result.get("answer") or ""
    review = [{{"role": "assistant", "content": answer}}, {{"role": "user", "content": "Check it: Answer: <number>."}}]
    async with pool_session("judge") as session:
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.token)
        judged = await client.chat.completions.create(
            model="judge",
            messages=[*prompt["messages"], *review],  # the tiny judge continues the episode; its words score it
            temperature=0,
            max_tokens=12,
        )
    text = judged.choices[0].message.content or ""
    # The task's own reward (it varies within a group) plus the judge's say: a tiny judge alone may rate a whole
    # group alike, and a group of equal rewards has no signal to train a step on.
    score = await task_reward(prompt, samples, agent_result) + 0.01 * len(text)
    with CALLS.open("a") as calls:
        calls.write(json.dumps({{"session_id": session.session_id, "text": text, "score": score,
                                 "completion_tokens": judged.usage.completion_tokens}}) + "\\n")
    return score
"""


@pytest.fixture(scope="module")
def stack_options(make_stack_options: Any) -> Any:
    return make_stack_options(engine="fake", num_engines=0, sandbox=True)


def judged_job(model: Path, reward_dir: Path) -> JobSpec:
    spec: dict[str, Any] = yaml.safe_load((REPO_ROOT / "examples" / "calculator_tool" / "job.yaml").read_text())
    spec["model"]["path"] = str(model)
    spec["rollout"]["reward"] = {
        "type": "function",
        "function": "judge_reward:reward",
        "python_path": [str(reward_dir), "examples"],  # the demo reward (cwd: the repository)
    }
    spec["rollout"]["n_samples_per_prompt"] = 4
    spec["train"].update(mode="sync", num_steps=1, batch_size_groups=1, checkpoint_interval_steps=1)
    spec["inference_pools"] = [
        {"name": "judge", "model_path": str(model), "chat_template_kwargs": {"enable_thinking": False}}
    ]
    return JobSpec.model_validate(spec)


def counter(metrics_text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", metrics_text, re.M))


def test_a_reward_function_scores_episodes_with_the_jobs_judge_pool(
    stack: Any, tmp_path: Path, demo_model: Callable[[str], Path]
) -> None:
    model = demo_model("calculator-demo")
    calls_path = tmp_path / "judge_calls.jsonl"
    reward_dir = tmp_path / "reward"
    reward_dir.mkdir()
    (reward_dir / "judge_reward.py").write_text(textwrap.dedent(JUDGE_REWARD.format(calls=str(calls_path))))
    spec = judged_job(model, reward_dir)
    services = stack.shared_services()
    backend = LocalJobBackend(services, tmp_path / "state", cwd=REPO_ROOT, restart_backoff_initial_s=0.2)
    registrar = SharedServicesClient(services, timeout_s=60)
    operator = {"authorization": f"Bearer {stack.operator_token}"}

    async def scenario() -> tuple[JobProgress, dict[str, float], list[str], list[str], str]:
        try:
            await registrar.register(JOB_ID, spec)
            await backend.start(JOB_ID, spec)
            metrics: dict[str, float] = {}
            while True:
                progress = await backend.observe(JOB_ID, spec)
                metrics.update(progress.metrics)
                if progress.phase in ("succeeded", "failed"):
                    break
                await asyncio.sleep(0.5)
            judge = backend.job_dir(JOB_ID) / "state.json"
            records = json.loads(judge.read_text())["processes"]
            judge_url = next(r["url"] for r in records if r["name"] == "judge-0")
            policy_url = next(r["url"] for r in records if r["name"] == "engine-0")
            # The worker keeps judging until it is stopped: calls logged before the scrape finished at the engine
            # (and deleted their session) before it, so only those are sure to be in its counters (and gone).
            logged_before_scrape = calls_path.read_text()
            async with httpx.AsyncClient(timeout=30) as http:
                texts = [(await http.get(f"{url}/metrics")).text for url in (judge_url, policy_url)]
                params = {"job_id": f"{JOB_ID}--judge", "limit": 100}
                live = await http.get(f"{stack.session_url}/v1/sessions", headers=operator, params=params)
            sessions = live.json().get("session_ids", []) if live.status_code == 200 else ["unreadable", live.text]
            return progress, metrics, texts, sessions, logged_before_scrape
        finally:
            await backend.stop(JOB_ID)
            await backend.close()
            await registrar.close()

    started = time.monotonic()
    progress, metrics, (judge_metrics, policy_metrics), judge_sessions_left, logged = asyncio.run(scenario())
    logs = {p.name: p.read_text(errors="replace")[-2000:] for p in backend.job_dir(JOB_ID).glob("*.log")}
    assert progress.phase == "succeeded", f"{progress}; logs: {json.dumps(logs, indent=1)}"
    calls = [json.loads(line) for line in calls_path.read_text().splitlines()]
    print(f"judged job: {time.monotonic() - started:.0f}s, {len(calls)} judge calls: {[c['text'] for c in calls]}")
    assert len(calls) >= 4, calls  # one group of 4 episodes at least
    assert len({call["session_id"] for call in calls}) == len(calls), "one judge session per call"
    assert all(call["completion_tokens"] > 0 for call in calls), calls
    judged_tokens = sum(json.loads(line)["completion_tokens"] for line in logged.splitlines())
    assert counter(judge_metrics, "miles_engine_generated_tokens_total") >= judged_tokens, judge_metrics[-2000:]
    scores = [call["score"] for call in calls]
    assert min(abs(metrics["reward_mean"] - sum(scores[i : i + 4]) / 4) for i in range(len(scores) - 3)) < 1e-6, (
        metrics,
        scores,
    )
    # Calls still in flight when the job ended may hold a session (and be logged after the listing); every call
    # logged before it had deleted its own.
    deleted = {json.loads(line)["session_id"] for line in logged.splitlines()}
    assert deleted and not deleted & set(judge_sessions_left), judge_sessions_left
    assert counter(policy_metrics, "miles_engine_generated_tokens_total") > 0
