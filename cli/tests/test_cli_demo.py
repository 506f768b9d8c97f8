"""The `make run` demo's pieces that can be checked cheaply: the job spec, the small-vocabulary tokenizer, the
warm-up's episodes, and the final line `scripts/demo.py` prints. (The demo itself runs by `make run`.)"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from miles.cli.follow import JobWatch
from miles.common.jobspec.job import JobSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples"


@pytest.fixture(scope="module")
def examples_path() -> None:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))


def _demo_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("miles_demo_script", REPO_ROOT / "scripts" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_job_is_a_valid_fully_async_job_spec() -> None:
    spec = JobSpec.model_validate(yaml.safe_load((EXAMPLES / "calculator_tool" / "job.yaml").read_text()))
    assert spec.train.mode == "async" and spec.train.num_steps >= 1
    assert spec.model.chat_template_kwargs == {"enable_thinking": False}
    assert spec.rollout.agent.function == "calculator_tool.agent:agent"


def test_mini_tokenizer_encodes_the_demo_text_exactly_like_qwen3(examples_path: None) -> None:
    from calculator_tool.mini_tokenizer import build_mini_tokenizer, vocab_size_of
    from calculator_tool.warmup import corpus_texts
    from tokenizers import Tokenizer

    texts = corpus_texts(num_examples=8)
    tokenizer_json, config = build_mini_tokenizer(texts)  # raises if any token differs from Qwen3's
    mini = Tokenizer.from_str(json.dumps(tokenizer_json))
    assert vocab_size_of(tokenizer_json) <= 1024
    assert mini.token_to_id("<|im_end|>") is not None and mini.token_to_id("<tool_call>") is not None
    unseen = "Zebra 12345 ünïcode ✓"
    assert mini.decode(mini.encode(unseen).ids) == unseen  # anything still encodes (down to bytes)
    assert config["eos_token"] == "<|im_end|>"


def test_warmup_episodes_train_only_the_assistant_turns(examples_path: None) -> None:
    from calculator_tool.warmup import _tito, render_example

    from miles.engine.tiny_model import qwen3_tokenizer_dir
    from miles.session.tito import HFTokenizerCodec

    tito = _tito(HFTokenizerCodec.from_file(qwen3_tokenizer_dir()))
    example = render_example(tito, "(12 + 7) * 3", "57", "0", use_tool=True)
    trained = tito.codec.decode([t for t, m in zip(example.token_ids, example.loss_mask, strict=True) if m])
    assert trained == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "(12 + 7) * 3"}}\n</tool_call><|im_end|>'
        "Answer: 57<|im_end|>"
    )
    guess = render_example(tito, "(12 + 7) * 3", "57", "0", use_tool=False)
    assert tito.codec.decode([t for t, m in zip(guess.token_ids, guess.loss_mask, strict=True) if m]) == (
        "Answer: 0<|im_end|>"
    )


def test_demo_final_line_averages_the_first_and_last_three_steps() -> None:
    demo = _demo_module()
    watch = JobWatch("job-1", num_steps=5)
    watch.rewards_by_step = {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.5, 5: 0.7}
    watch.staleness_by_step = {1: 0.0, 2: 1.0}
    job = {"step": 5, "prefix_hit_rate": 0.875, "tito_mismatches": 0}
    assert demo.summary_line(watch, job, (0.125, 0.5)) == (
        "demo eval_before=0.125 eval_after=0.500 reward_first=0.200 reward_last=0.500 steps=5 staleness_mean=0.50 "
        "prefix_hit=0.875 tito_critical=0"
    )


def test_held_out_prompts_share_no_expression_with_the_training_set() -> None:
    def expressions(name: str) -> list[str]:
        lines = (EXAMPLES / "calculator_tool" / name).read_text().splitlines()
        return [json.loads(line)["expression"] for line in lines if line.strip()]

    held_out = expressions("eval.jsonl")
    assert len(held_out) == len(set(held_out)) >= 40
    assert not set(held_out) & set(expressions("data.jsonl"))
