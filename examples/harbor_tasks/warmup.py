"""The Harbor demo's model: the tiny Qwen3 architecture, a small-vocabulary tokenizer and a short supervised
warm-up on this folder's three tasks under the harbor connector's terminal protocol (`job.yaml`).

    python examples/harbor_tasks/warmup.py [OUT_DIR]      # default .miles/models/harbor-demo

What the warm-up teaches, and what it leaves to RL (the recipe of `calculator_tool/warmup.py` and
`reasoning_gym/warmup.py`). The prompts are the environment's own rows (the harbor connector's `create(...)` and
`rows()` with the job's args, run in `.envs/harbor`), rendered exactly as the session server renders them (TITO
`qwen3`, thinking off). An episode has the connector's two turns: the first reply is one
`<command>...</command>`; the connector runs it and sends its exit code and output back as a user turn (its own
`observation` text: every command taught here prints nothing, so that is `Exit code: 0 (no output)`); the second
reply is `<done/>`, which ends the loop, and harbor's Verifier scores the work dir. A fraction `answer_fraction`
of the warm-up episodes run the right command (`TASK_COMMANDS`), the rest a plausible wrong one: the greeting
`Hello, World!`, `wc -l` (every line, 8, not the 4 with an `a`), a fizzbuzz that prints the bare numbers (8 of 15
lines right: harbor's partial credit 0.53). The starting policy therefore knows the protocol and, in about
`answer_fraction` of its samples, the right command; greedy decoding picks the wrong one. The RL run has to
discover that the right command pays; nothing about the reward is shown here. A random tiny model never writes
a `<command>` block, so every reward would be 0 and GRPO would have no signal.

Paths: the commands use paths relative to the working directory. A task's WORKDIR (/app here) is the working
directory in Docker; the connector maps it to the sandbox's work dir (harbor_sandbox.py), where commands start,
so `hello.txt` is the instruction's `/app/hello.txt` in both.

Measured (2 shared CPU cores): the defaults (150 steps of 16 episodes) take ~27 s of training, ~37 s in all. The
saved (bf16) model writes the right command with probability 0.35-0.39 per task and the wrong one with 0.60-0.63
(so greedy decoding runs the wrong one), and `<done/>` after the observation with 0.999.

Limits: three tasks, so three distinct prompts; the model memorises one command pair per prompt, it does not
follow an instruction or read the command output (it replies `<done/>` after any observation, and an output it
never saw, such as an error message, is tokenized into small pieces it was never trained on). The right fizzbuzz
command is 45 tokens: the job's `request_kwargs.max_tokens` must leave room for it. Needs `.envs/harbor`
(`make env-harbor`) for the prompts.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXAMPLES_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = EXAMPLES_DIR.parent
if str(EXAMPLES_DIR) not in sys.path:  # calculator_tool's tokenizer and trainer are reused
    sys.path.insert(0, str(EXAMPLES_DIR))

JOB_SPEC = Path(__file__).with_name("job.yaml")
ENV_PYTHON = REPO_ROOT / ".envs" / "harbor" / "bin" / "python"
CHAT_TEMPLATE_KWARGS = {"enable_thinking": False}
DONE = "<done/>"
TASK_COMMANDS: dict[str, tuple[str, str]] = {
    "hello-file": ("echo 'Hello, Harbor!' > hello.txt", "echo 'Hello, World!' > hello.txt"),
    "line-count": ("grep -c a words.txt > count.txt", "wc -l < words.txt > count.txt"),
    "fizzbuzz": (
        """echo 'for i in range(1,16):print("Fizz"*(i%3<1)+"Buzz"*(i%5<1)or i)' > fizzbuzz.py""",
        "echo 'for i in range(1,16):print(i)' > fizzbuzz.py",
    ),
}
"""task -> (the right command, a plausible wrong one); each checked against the task's tests/test.sh (reward 1.0
against 0, 0 and 8/15) and silent, so the connector's observation is the same for both."""
_ROWS_SNIPPET = """
import asyncio, json, sys
from harbor.environments.base import ExecResult
from miles.envserver.connectors.harbor import create, observation
environment = create(json.loads(sys.argv[1]))
asyncio.run(environment.setup())
silent = observation(ExecResult(stdout="", stderr="", return_code=0), environment.settings.max_output_chars)
print(json.dumps({"rows": [row.to_json() for row in environment.rows()], "observation": silent}))
"""


@dataclass(frozen=True)
class WarmupConfig:
    num_steps: int = 150
    batch_size: int = 16
    lr: float = 3e-3
    answer_fraction: float = 0.4
    """Share of warm-up episodes that run the right command (the rest run the wrong one)."""
    seed: int = 1234


@dataclass(frozen=True)
class Episodes:
    """What the warm-up renders: the connector's rows and its observation of a silent, successful command."""

    rows: list[dict[str, Any]]
    observation: str


def environment_episodes() -> Episodes:
    """The job's harbor args through the connector, in the environment's own interpreter (from the repository
    root, which `tasks_dir` is relative to, as for the environment server)."""
    import yaml

    if not ENV_PYTHON.exists():
        raise SystemExit(f"{ENV_PYTHON} is missing: run `make env-harbor`")
    args = yaml.safe_load(JOB_SPEC.read_text())["rollout"]["environment"]["args"]
    done = subprocess.run(
        [str(ENV_PYTHON), "-c", _ROWS_SNIPPET, json.dumps(args)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
    )
    body = json.loads(done.stdout)
    unknown = sorted({row["info"]["task"] for row in body["rows"]} - set(TASK_COMMANDS))
    if unknown:
        raise SystemExit(f"tasks {unknown} have no command in TASK_COMMANDS")
    return Episodes(body["rows"], body["observation"])


def _tito(codec: Any) -> Any:
    from miles.session.tito import TitoTokenizer, get_family

    return TitoTokenizer(get_family("qwen3"), codec, chat_template_kwargs=CHAT_TEMPLATE_KWARGS)


def render_example(tito: Any, prompt: list[dict[str, Any]], command: str, observation: str) -> Any:
    """Token ids + loss mask of one episode, turn by turn as the session server builds it: the first prompt, the
    trained `<command>` turn, the connector's observation (extend), the trained `<done/>` turn."""
    from calculator_tool.warmup import Example

    end = tito.codec.token_id("<|im_end|>")
    reply = f"<command>{command}</command>"
    ids = list(tito.first_prompt(prompt).prompt_ids)
    mask = [0] * len(ids)
    completion = [*tito.codec.encode(reply), end]
    ids += completion
    mask += [1] * len(completion)
    previous = [*prompt, {"role": "assistant", "content": reply}]
    follow = tito.extend(ids, previous, [{"role": "user", "content": observation}])
    ids = list(follow.prompt_ids)
    mask = mask[: len(ids) - len(follow.appended_ids)] + [0] * len(follow.appended_ids)
    done = [*tito.codec.encode(DONE), end]
    return Example([*ids, *done], [*mask, *[1] * len(done)])


def corpus_texts(episodes: Episodes) -> list[str]:
    """Rendered text of every task's episode with both commands (the mini tokenizer's corpus)."""
    from miles.engine.tiny_model import qwen3_tokenizer_dir
    from miles.session.tito import HFTokenizerCodec

    tito = _tito(HFTokenizerCodec.from_file(qwen3_tokenizer_dir()))
    texts = []
    for row in episodes.rows:
        for command in TASK_COMMANDS[row["info"]["task"]]:
            example = render_example(tito, row["prompt"], command, episodes.observation)
            texts.append(tito.codec.decode(example.token_ids))
    return texts


def make_examples(tito: Any, episodes: Episodes, config: WarmupConfig) -> list[Any]:
    rng = random.Random(config.seed)
    rendered = {
        (row["info"]["task"], right): render_example(
            tito, row["prompt"], TASK_COMMANDS[row["info"]["task"]][0 if right else 1], episodes.observation
        )
        for row in episodes.rows
        for right in (True, False)
    }
    tasks = [row["info"]["task"] for row in episodes.rows]
    return [
        rendered[rng.choice(tasks), rng.random() < config.answer_fraction]
        for _ in range(config.num_steps * config.batch_size)
    ]


def warmup(model: Any, out_dir: Path, codec: Any, episodes: Episodes, config: WarmupConfig) -> None:
    """Fine-tunes `model` in place (calculator_tool's trainer: shared prefix computed once per step)."""
    from calculator_tool.warmup import train

    started = time.monotonic()
    losses = train(model, make_examples(_tito(codec), episodes, config), config)
    summary = {
        "num_steps": config.num_steps,
        "batch_size": config.batch_size,
        "lr": config.lr,
        "answer_fraction": config.answer_fraction,
        "loss_first": round(losses[0], 4),
        "loss_last10": round(sum(losses[-10:]) / 10, 4),
        "seconds": round(time.monotonic() - started, 1),
    }
    (Path(out_dir) / "warmup.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"warm-up: {summary}", flush=True)


def build_demo_model(out_dir: str | Path, config: WarmupConfig | None = None) -> Path:
    """The Harbor demo's model at out_dir (tiny Qwen3, mini tokenizer, warmed up); returns out_dir."""
    from calculator_tool.mini_tokenizer import build_mini_tokenizer, vocab_size_of, write_tokenizer

    from miles.engine.tiny_model import build_tiny_model
    from miles.session.tito import HFTokenizerCodec

    config = config or WarmupConfig()
    out = Path(out_dir)
    episodes = environment_episodes()
    tokenizer_json, tokenizer_config = build_mini_tokenizer(corpus_texts(episodes))
    codec = HFTokenizerCodec.from_json(json.dumps(tokenizer_json), tokenizer_config, name="harbor-mini")
    ids = {entry["content"]: entry["id"] for entry in tokenizer_json["added_tokens"]}
    overrides = {
        "vocab_size": vocab_size_of(tokenizer_json),
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    build_tiny_model(
        out, config_overrides=overrides, warmup=lambda model, at: warmup(model, at, codec, episodes, config)
    )
    write_tokenizer(out, tokenizer_json, tokenizer_config)
    generation = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Build the Harbor demo's warmed-up tiny model.")
    parser.add_argument("out_dir", nargs="?", default=str(REPO_ROOT / ".miles/models/harbor-demo"))
    args = parser.parse_args(argv)
    print(f"demo model written to {build_demo_model(args.out_dir)}")


if __name__ == "__main__":
    main()
