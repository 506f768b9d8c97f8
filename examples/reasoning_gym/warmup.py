"""The reasoning demo's model: the tiny Qwen3 architecture, a small-vocabulary tokenizer and a short supervised
warm-up on the demo's reasoning-gym task (`job.yaml`: leg_counting, one animal, the `direct` system prompt).

    python examples/reasoning_gym/warmup.py [OUT_DIR]      # default .miles/models/reasoning-demo

What the warm-up teaches, and what it leaves to RL (the recipe of `calculator_tool/warmup.py`). The prompts are
the environment's own rows (the reasoning_gym connector run in `.envs/reasoning-gym`, with a seed other than the
job's), rendered exactly as the session server renders them (TITO `qwen3`, thinking off). A fraction
`answer_fraction` of the warm-up episodes answer right (`<answer>8</answer>` for a spider), the rest answer with a
lazy constant (`<answer>0</answer>`, right only for the five legless animals). The starting policy therefore
knows the answer format and, in about `answer_fraction` of its samples, the right number; greedy decoding picks
the lazy answer. The RL run has to discover that the right number pays (the dataset's scorer: 1.0 against 0) and
raise that rate; nothing about the reward is shown here. A random tiny model would never write the `<answer>`
tags, so its reward would stay 0 and GRPO would have no signal.

Limits: 37 animals, so 37 distinct questions; the model memorises a table, it does not count legs of several
animals (a model this small cannot add). Needs `.envs/reasoning-gym` (`make env-reasoning-gym`) for the prompts.
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
ENV_PYTHON = REPO_ROOT / ".envs" / "reasoning-gym" / "bin" / "python"
CHAT_TEMPLATE_KWARGS = {"enable_thinking": False}
LAZY_ANSWER = "0"
_ROWS_SNIPPET = """
import asyncio, json, sys
from miles.envserver.connectors.reasoning_gym import create
environment = create(json.loads(sys.argv[1]))
asyncio.run(environment.setup())
print(json.dumps([row.to_json() for row in environment.rows()]))
"""


@dataclass(frozen=True)
class WarmupConfig:
    num_steps: int = 300
    batch_size: int = 16
    lr: float = 3e-3
    answer_fraction: float = 0.4
    """Share of warm-up episodes that answer right (the rest give the lazy answer)."""
    seed: int = 1234
    """Data seed; also the environment's seed for the warm-up rows (the job's is 0)."""
    num_rows: int = 512


def environment_args(seed: int, size: int) -> dict[str, Any]:
    """The job's reasoning_gym args with another seed and size."""
    import yaml

    args: dict[str, Any] = yaml.safe_load(JOB_SPEC.read_text())["rollout"]["environment"]["args"]
    return {**args, "seed": seed, "size": size}


def environment_rows(args: dict[str, Any]) -> list[dict[str, Any]]:
    """The connector's rows for `args`, generated in the environment's own interpreter."""
    if not ENV_PYTHON.exists():
        raise SystemExit(f"{ENV_PYTHON} is missing: run `make env-reasoning-gym`")
    done = subprocess.run(
        [str(ENV_PYTHON), "-c", _ROWS_SNIPPET, json.dumps(args)], capture_output=True, text=True, check=True
    )
    rows: list[dict[str, Any]] = json.loads(done.stdout)
    return rows


def _tito(codec: Any) -> Any:
    from miles.session.tito import TitoTokenizer, get_family

    return TitoTokenizer(get_family("qwen3"), codec, chat_template_kwargs=CHAT_TEMPLATE_KWARGS)


def render_example(tito: Any, messages: list[dict[str, Any]], answer: str) -> Any:
    """Token ids + loss mask of one episode: the first prompt, then the trained `<answer>...</answer>` turn."""
    from calculator_tool.warmup import Example

    ids = list(tito.first_prompt(messages).prompt_ids)
    completion = [*tito.codec.encode(f"<answer>{answer}</answer>"), tito.codec.token_id("<|im_end|>")]
    return Example([*ids, *completion], [0] * len(ids) + [1] * len(completion))


def corpus_texts(rows: list[dict[str, Any]]) -> list[str]:
    """Rendered text of every distinct question with both answers (the mini tokenizer's corpus)."""
    from miles.engine.tiny_model import qwen3_tokenizer_dir
    from miles.session.tito import HFTokenizerCodec

    tito = _tito(HFTokenizerCodec.from_file(qwen3_tokenizer_dir()))
    texts = ["0123456789"]
    distinct = {json.dumps(row["prompt"]): row for row in rows}
    for row in distinct.values():
        for answer in (str(row["label"]), LAZY_ANSWER):
            texts.append(tito.codec.decode(render_example(tito, row["prompt"], answer).token_ids))
    return texts


def make_examples(tito: Any, rows: list[dict[str, Any]], config: WarmupConfig) -> list[Any]:
    rng = random.Random(config.seed)
    examples = []
    for _ in range(config.num_steps * config.batch_size):
        row = rng.choice(rows)
        answer = str(row["label"]) if rng.random() < config.answer_fraction else LAZY_ANSWER
        examples.append(render_example(tito, row["prompt"], answer))
    return examples


def warmup(model: Any, out_dir: Path, codec: Any, rows: list[dict[str, Any]], config: WarmupConfig) -> None:
    """Fine-tunes `model` in place (calculator_tool's trainer: shared prefix computed once per step)."""
    from calculator_tool.warmup import train

    started = time.monotonic()
    losses = train(model, make_examples(_tito(codec), rows, config), config)
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
    """The reasoning demo's model at out_dir (tiny Qwen3, mini tokenizer, warmed up); returns out_dir."""
    from calculator_tool.mini_tokenizer import build_mini_tokenizer, vocab_size_of, write_tokenizer

    from miles.engine.tiny_model import build_tiny_model
    from miles.session.tito import HFTokenizerCodec

    config = config or WarmupConfig()
    out = Path(out_dir)
    rows = environment_rows(environment_args(config.seed, config.num_rows))
    tokenizer_json, tokenizer_config = build_mini_tokenizer(corpus_texts(rows))
    codec = HFTokenizerCodec.from_json(json.dumps(tokenizer_json), tokenizer_config, name="reasoning-mini")
    ids = {entry["content"]: entry["id"] for entry in tokenizer_json["added_tokens"]}
    overrides = {
        "vocab_size": vocab_size_of(tokenizer_json),
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    build_tiny_model(out, config_overrides=overrides, warmup=lambda model, at: warmup(model, at, codec, rows, config))
    write_tokenizer(out, tokenizer_json, tokenizer_config)
    generation = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Build the reasoning demo's warmed-up tiny model.")
    parser.add_argument("out_dir", nargs="?", default=str(REPO_ROOT / ".miles/models/reasoning-demo"))
    args = parser.parse_args(argv)
    print(f"demo model written to {build_demo_model(args.out_dir)}")


if __name__ == "__main__":
    main()
