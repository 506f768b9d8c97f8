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


def test_moe_demo_job_is_the_demo_recipe_on_the_moe_model_with_replay_left_to_its_default() -> None:
    def load(name: str) -> JobSpec:
        return JobSpec.model_validate(yaml.safe_load((EXAMPLES / "calculator_tool" / name).read_text()))

    dense, moe = load("job.yaml"), load("job_moe.yaml")
    assert moe.model.path.endswith(_demo_module().MOE_MODEL_SUFFIX) and moe.train.mode == "async"
    assert moe.train.routing_replay is None  # unset: on for a MoE model
    assert moe.train == dense.train and moe.rollout == dense.rollout


def test_moe_demo_model_is_a_tiny_qwen3_moe_with_the_mini_vocabulary(examples_path: None, tmp_path: Path) -> None:
    from calculator_tool.warmup import DEMO_MOE_CONFIG, build_demo_model

    config = json.loads((build_demo_model(tmp_path / "m", warm=False, moe=True) / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["vocab_size"] <= 1024
    assert {key: config[key] for key in DEMO_MOE_CONFIG} == {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
    }
    assert _demo_module().is_moe_model(tmp_path / "m")


def test_moe_demo_final_line_adds_the_routing_agreement() -> None:
    demo = _demo_module()
    watch = JobWatch("job-1", num_steps=1)
    watch.rewards_by_step = {1: 0.5}
    job = {"step": 1, "prefix_hit_rate": 0.9, "tito_mismatches": 0, "metrics": {"routing_agreement": 0.96875}}
    assert demo.summary_line(watch, job, (0.0, 0.5), moe=True).endswith("tito_critical=0 routing_agreement=0.969")
    assert demo.summary_line(watch, {**job, "metrics": {}}, (0.0, 0.5), moe=True).endswith("routing_agreement=-")
    assert "routing_agreement" not in demo.summary_line(watch, job, (0.0, 0.5))


def test_moe_demo_fails_unless_the_trainer_really_replayed_routing(tmp_path: Path) -> None:
    demo = _demo_module()
    replayed = {"metrics": {"routing_replay": 1.0, "routing_agreement": 0.97}}
    log = tmp_path / "trainer.log"
    log.write_text("2026-01-01 00:00:00,000 trainer INFO miles.trainer.loop: step\n")
    assert demo.routing_replay_problems(replayed, tmp_path) == []
    assert len(demo.routing_replay_problems({"metrics": {"routing_replay": 0.0}}, tmp_path)) == 2
    with log.open("a") as out:
        out.write("2026-01-01 00:00:01,000 trainer WARNING miles.trainer.admission: group rejected: missing_routing\n")
    assert demo.routing_replay_problems(replayed, tmp_path) == ["the trainer rejected 1 groups for missing_routing"]
    assert demo.routing_replay_problems(replayed, tmp_path / "nowhere")[0].startswith("no trainer log")


def test_evaluation_never_records_routing(tmp_path: Path) -> None:
    from miles.cli.evaluation import eval_session_config

    spec = JobSpec.model_validate(yaml.safe_load((EXAMPLES / "calculator_tool" / "job_moe.yaml").read_text()))
    config = eval_session_config(spec, tmp_path, "eval-1")
    assert config["record_routing"] is False  # its engine runs without --enable-return-routed-experts
    assert config["engine_pool"] == "eval-1" and config["model_path"] == str(tmp_path)
