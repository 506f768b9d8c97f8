"""Warm-up of the demo's tiny model: a short supervised fine-tune on synthetic calculator conversations.

`miles-make-tiny-model OUT --warmup calculator_tool.warmup:warmup` (with `examples` on PYTHONPATH) applies it to
the full-vocabulary tiny model; `build_demo_model(out_dir)` (what `make run` uses) builds the small-vocabulary
variant (`mini_tokenizer.py`: ~1K ids instead of 151,936, so every part of the loop runs several times faster)
and warms it up the same way (`moe=True`: the tiny Qwen3-MoE variant, below).

What the warm-up teaches, and what it leaves to RL. The conversations are rendered exactly as the session server
renders them (TITO `qwen3` family, thinking off, the agent's tool list), so the model learns the real token
sequences. A fraction `tool_fraction` of them is the ideal episode - a `<tool_call>` with the question's
expression, then `Answer: <tool result>` after the tool response - and the rest answer straight away with a
lazy guess (`Answer: 0`, almost never right). The starting policy therefore knows both formats and
calls the calculator in roughly `tool_fraction` of its episodes; the demo's RL run has to discover that the
calculator pays (reward 1.0 against ~0) and raise that rate, and sharpen the copying of the expression.
Nothing about the reward is shown to the model here.

Measured (2 shared CPU cores): the defaults (800 steps of 16 episodes, 40 % with the tool) take ~200 s; the
resulting policy calls the calculator in ~35 % of its sampled episodes and copies the expression exactly in those.
With the full Qwen3 vocabulary the same warm-up is roughly 10x slower (the LM head dominates).

MoE variant (`build_demo_model(out_dir, moe=True)`, `python examples/calculator_tool/warmup.py --moe`; the MoE demo
`job_moe.yaml`): the same tokenizer, data, seeds and warm-up on the tiny Qwen3-MoE architecture with
`DEMO_MOE_CONFIG` - every layer's MLP is 4 SwiGLU experts of width 128 with top-2 routing, so a token's active MLP
width equals the dense model's 256. 530,240 parameters (393,216 of them in experts; ~334K active per token)
against the dense demo model's 332,608. A 100-step warm-up took 16.6 s against the dense model's 17.0 s back to
back; the full warm-up 126-179 s (the dense one 92-275 s: the machine was shared, load decides). No load-balancing
loss is trained (miles.model does not compute it); after the warm-up every expert still takes 6-45 % of a layer's
routed slots (8 rendered episodes), so routing is neither collapsed nor uniform.

Limits: a model this small copies short expressions, it does not compute. Training runs on one torch thread
(bit-reproducible for a given seed and machine).
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXAMPLES_DIR = Path(__file__).resolve().parents[1]
if str(EXAMPLES_DIR) not in sys.path:  # the builder imports us by dotted path; our siblings must resolve too
    sys.path.insert(0, str(EXAMPLES_DIR))

from calculator_tool.agent import NUDGE, TOOLS  # noqa: E402
from calculator_tool.make_dataset import SYSTEM, make_expression  # noqa: E402

CHAT_TEMPLATE_KWARGS = {"enable_thinking": False}
FULL_QWEN3_VOCAB = 151936
DEMO_MOE_CONFIG: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128}
"""Overrides of the tiny Qwen3-MoE config (miles.engine.tiny_model) for the MoE demo: 4 SwiGLU experts of width
128, top-2, so a token's active MLP width (2 x 128) equals the dense demo's 256."""


@dataclass(frozen=True)
class WarmupConfig:
    num_steps: int = 800
    batch_size: int = 16
    lr: float = 3e-3
    tool_fraction: float = 0.4
    """Share of warm-up episodes that call the calculator (the rest guess an answer)."""
    seed: int = 1234
    """Data seed (different from the dataset's seed 0, so the demo's prompts are not memorised)."""


@dataclass(frozen=True)
class Example:
    token_ids: list[int]
    loss_mask: list[int]


def _tito(codec: Any) -> Any:
    from miles.session.tito import TitoTokenizer, get_family

    return TitoTokenizer(get_family("qwen3"), codec, chat_template_kwargs=CHAT_TEMPLATE_KWARGS)


def _guess(expression: str, rng: random.Random) -> str:
    """The lazy answer of the no-tool episodes: always 0 (right only when the label is 0). A constant keeps the
    answer turn after a tool response (copy the tool's number) from being confused with guessing."""
    return "0"


def conversation_texts(expression: str, result: str, guess: str) -> list[tuple[list[dict[str, Any]], str]]:
    """The turns of both episode kinds: (messages before the turn, the assistant's completion text)."""
    question = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {expression}?"}]
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    assistant = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
            }
        ],
    }
    tool = {"role": "tool", "tool_call_id": "call_0", "content": result}
    return [
        (question, f"<tool_call>\n{call}\n</tool_call>"),
        ([*question, assistant, tool], f"Answer: {result}"),
        (question, f"Answer: {guess}"),
    ]


def render_example(tito: Any, expression: str, result: str, guess: str, *, use_tool: bool) -> Example:
    """Token ids + loss mask of one episode, built turn by turn the way the session server builds them."""
    (question, call_text), (with_tool, answer_text), (_, guess_text) = conversation_texts(expression, result, guess)
    end = tito.codec.token_id("<|im_end|>")
    first = tito.first_prompt(question, tools=TOOLS)
    ids = list(first.prompt_ids)
    mask = [0] * len(ids)
    completion = [*tito.codec.encode(call_text if use_tool else guess_text), end]
    ids += completion
    mask += [1] * len(completion)
    if use_tool:
        follow = tito.extend(ids, with_tool[:-1], with_tool[-1:], tools=TOOLS)
        ids = list(follow.prompt_ids)
        mask = mask[: len(ids) - len(follow.appended_ids)] + [0] * len(follow.appended_ids)
        answer = [*tito.codec.encode(answer_text), end]
        ids += answer
        mask += [1] * len(answer)
    return Example(ids, mask)


def corpus_texts(num_examples: int = 64, seed: int = 7) -> list[str]:
    """Rendered text of every turn kind (the mini tokenizer's corpus), with the full Qwen3 tokenizer."""
    from miles.engine.tiny_model import qwen3_tokenizer_dir
    from miles.session.tito import HFTokenizerCodec

    tito = _tito(HFTokenizerCodec.from_file(qwen3_tokenizer_dir()))
    rng = random.Random(seed)
    texts = [NUDGE, "error: only digits, spaces and + - * / ( ) are allowed", "0123456789 -+*/()."]
    for _ in range(num_examples):
        expression = make_expression(rng)
        result = str(eval(expression))
        example = render_example(tito, expression, result, _guess(expression, rng), use_tool=True)
        texts.append(tito.codec.decode(example.token_ids))
    return texts


def make_examples(tito: Any, config: WarmupConfig) -> list[Example]:
    rng = random.Random(config.seed)
    examples = []
    for _ in range(config.num_steps * config.batch_size):
        expression = make_expression(rng)
        result = str(eval(expression))
        use_tool = rng.random() < config.tool_fraction
        examples.append(render_example(tito, expression, result, _guess(expression, rng), use_tool=use_tool))
    return examples


def common_prefix_length(examples: list[Example]) -> int:
    """Tokens every example starts with (the system prompt and the tool list), none of them trained."""
    first = examples[0].token_ids
    length = min(len(e.token_ids) for e in examples) - 1
    for example in examples:
        length = next((i for i in range(length) if example.token_ids[i] != first[i]), length)
    return min(length, examples[0].loss_mask.index(1))


def train(model: Any, examples: list[Example], config: WarmupConfig) -> list[float]:
    """Next-token cross-entropy on the assistant tokens, AdamW; returns the loss per step.

    The shared prompt prefix is run once per step without gradient and its keys/values are copied into every
    example's KV cache, so each example only runs its own suffix (~4x fewer tokens). The prefix is context the
    model reads, never a target, so this only drops the gradient through the prefix's keys and values.
    """
    import torch

    from miles.model import Segment, SequenceKV, target_logprobs

    c = model.config
    torch.manual_seed(config.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-reproducible, and kinder to a shared machine than 2 spinning threads
    prefix_len = common_prefix_length(examples)
    prefix = torch.tensor(examples[0].token_ids[:prefix_len])
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    losses = []
    for step in range(config.num_steps):
        batch = examples[step * config.batch_size : (step + 1) * config.batch_size]
        with torch.no_grad():
            shared = SequenceKV(c.num_hidden_layers, prefix_len, c.num_key_value_heads, c.head_dim)
            model.forward_segments([Segment(prefix, 0, shared)])
            block = shared.export(0, prefix_len)
        segments, rows, targets, offset = [], [], [], 0
        for example in batch:
            kv = SequenceKV(c.num_hidden_layers, len(example.token_ids), c.num_key_value_heads, c.head_dim)
            kv.load_prefix([block])
            segments.append(Segment(torch.tensor(example.token_ids[prefix_len:-1]), prefix_len, kv))
            positions = [i for i in range(prefix_len, len(example.token_ids) - 1) if example.loss_mask[i + 1]]
            rows += [offset + i - prefix_len for i in positions]
            targets += [example.token_ids[i + 1] for i in positions]
            offset += len(example.token_ids) - 1 - prefix_len
        hidden = model.forward_segments(segments)[torch.tensor(rows)]
        loss = -target_logprobs(model, hidden, torch.tensor(targets)).mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr_scale = min(1.0, (step + 1) / 20) * max(0.1, 1 - step / config.num_steps)
        for group in optimizer.param_groups:
            group["lr"] = config.lr * lr_scale
        optimizer.step()
        losses.append(loss.item())
        if step % 25 == 0:
            print(f"warm-up step {step}: loss {losses[-1]:.3f} cpu {time.process_time():.0f}s", flush=True)
    model.eval()
    torch.set_num_threads(threads)
    return losses


def _codec_for(model: Any) -> Any:
    from miles.session.tito import HFTokenizerCodec

    if model.config.vocab_size >= FULL_QWEN3_VOCAB:
        from miles.engine.tiny_model import qwen3_tokenizer_dir

        return HFTokenizerCodec.from_file(qwen3_tokenizer_dir())
    from calculator_tool.mini_tokenizer import build_mini_tokenizer

    tokenizer_json, config = build_mini_tokenizer(corpus_texts())
    return HFTokenizerCodec.from_json(json.dumps(tokenizer_json), config, name="calculator-mini")


def warmup(model: Any, out_dir: Path, config: WarmupConfig | None = None) -> None:
    """The `--warmup` hook of miles-make-tiny-model: fine-tunes `model` in place."""
    config = config or WarmupConfig()
    started = time.monotonic()
    tito = _tito(_codec_for(model))
    examples = make_examples(tito, config)
    losses = train(model, examples, config)
    summary = {
        "num_steps": config.num_steps,
        "batch_size": config.batch_size,
        "lr": config.lr,
        "tool_fraction": config.tool_fraction,
        "loss_first": round(losses[0], 4),
        "loss_last10": round(sum(losses[-10:]) / 10, 4),
        "seconds": round(time.monotonic() - started, 1),
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "warmup.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"warm-up: {summary}", flush=True)


def build_demo_model(
    out_dir: str | Path, config: WarmupConfig | None = None, *, warm: bool = True, moe: bool = False
) -> Path:
    """The demo model: tiny Qwen3 architecture (tiny Qwen3-MoE with `DEMO_MOE_CONFIG` when `moe`), the mini
    tokenizer's vocabulary, warmed up (unless `warm` is False: random weights, for benchmarks that only need the
    shapes). Returns out_dir."""
    from calculator_tool.mini_tokenizer import build_mini_tokenizer, vocab_size_of, write_tokenizer
    from miles.engine.tiny_model import build_tiny_model

    out = Path(out_dir)
    tokenizer_json, tokenizer_config = build_mini_tokenizer(corpus_texts())
    ids = {entry["content"]: entry["id"] for entry in tokenizer_json["added_tokens"]}
    overrides = {
        **(DEMO_MOE_CONFIG if moe else {}),
        "vocab_size": vocab_size_of(tokenizer_json),
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    hook = (lambda model, path: warmup(model, path, config)) if warm else None
    build_tiny_model(out, config_overrides=overrides, warmup=hook, moe=moe)
    write_tokenizer(out, tokenizer_json, tokenizer_config)
    generation = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Build the demo's warmed-up tiny model.")
    parser.add_argument("out_dir", nargs="?", default=None, help="default .miles/models/calculator-demo[-moe]")
    parser.add_argument("--moe", action="store_true", help="the tiny Qwen3-MoE variant (DEMO_MOE_CONFIG)")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or (".miles/models/calculator-demo" + ("-moe" if args.moe else ""))
    print(f"demo model written to {build_demo_model(out_dir, moe=args.moe)}")


if __name__ == "__main__":
    main()
