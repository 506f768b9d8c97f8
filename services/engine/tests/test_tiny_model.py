"""The tiny model builder: reproducible bit for bit, small, a real Qwen3 checkpoint that Hugging Face loads and
computes exactly like our implementation, with the real Qwen3 tokenizer and chat template; and its Qwen3-MoE
variant (`--moe`), which Hugging Face also loads and routes exactly as we do."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.engine.tiny_model import build_tiny_model, main
from miles.engine.tokenizer import TextTokenizer
from miles.model import Segment, load_model


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    main([str(tmp_path / "again")])
    assert _digests(tmp_path / "again") == _digests(tiny_model_dir)
    other = build_tiny_model(tmp_path / "seed1", seed=1)
    assert _digests(other)["model.safetensors"] != _digests(tiny_model_dir)["model.safetensors"]
    assert _digests(other)["tokenizer.json"] == _digests(tiny_model_dir)["tokenizer.json"]


def test_size_and_contents(tiny_model_dir: Path) -> None:
    total_bytes = sum(p.stat().st_size for p in tiny_model_dir.iterdir())
    assert (tiny_model_dir / "model.safetensors").stat().st_size < 25_000_000
    assert total_bytes < 40_000_000
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (tiny_model_dir / name).is_file()


def test_hugging_face_loads_it_and_computes_what_we_compute(tiny_model_dir: Path) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ids = torch.tensor([9707, 11, 1246, 525, 498, 30, 151645, 198])
    ours = load_model(tiny_model_dir)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
        actual = torch.nn.functional.linear(ours(ids), ours.lm_head_weight)
    assert torch.allclose(actual, expected, atol=1e-4, rtol=1e-4), (actual - expected).abs().max()


def test_real_qwen3_tokenizer_and_chat_template(tiny_model_dir: Path) -> None:
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    ours = TextTokenizer(tiny_model_dir)
    text = "Hello, world! <|im_start|>user\nÜber 2+2?<|im_end|>"
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.eos_token_id == 151645 and ours.size == 151669
    rendered = hf.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_warmup_hook_runs_before_saving(tmp_path: Path) -> None:
    seen: list[Any] = []

    def warmup(model: Any, out_dir: Path) -> None:
        seen.append(out_dir)
        with torch.no_grad():
            model.model.norm.weight.fill_(2.0)

    out = build_tiny_model(tmp_path / "warm", warmup=warmup)
    assert seen == [out]
    assert torch.equal(load_model(out).model.norm.weight.detach(), torch.full((64,), 2.0))
    assert "warm-up" in (out / "README.md").read_text()


def test_bad_warmup_path_is_refused() -> None:
    with pytest.raises(SystemExit, match=r"package\.module:function"):
        main(["/tmp/unused", "--warmup", "no_colon_here"])


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe", moe=True)


def test_moe_variant_is_reproducible_and_keeps_the_tokenizer(
    tiny_moe_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    main([str(tmp_path / "again"), "--moe"])
    assert _digests(tmp_path / "again") == _digests(tiny_moe_dir)
    config = json.loads((tiny_moe_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"], config["mlp_only_layers"]) == (8, 2, [])
    assert json.loads((tiny_model_dir / "config.json").read_text())["model_type"] == "qwen3"  # default unchanged
    assert (tiny_moe_dir / "model.safetensors").stat().st_size < 25_000_000
    assert _digests(tiny_moe_dir)["tokenizer.json"] == _digests(tiny_model_dir)["tokenizer.json"]
    assert "tiny-qwen3-moe" in (tiny_moe_dir / "README.md").read_text()


def test_moe_variant_loads_in_hugging_face_with_the_same_logits_and_routing(tiny_moe_dir: Path) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.tensor([9707, 11, 1246, 525, 498, 30, 151645, 198, 35, 2776, 374, 264])
    ours = load_model(tiny_moe_dir)
    with torch.no_grad():
        expected = hf(ids[None], output_router_logits=True)
        out = ours.forward_routed([Segment(ids)])
        actual = torch.nn.functional.linear(out.hidden, ours.lm_head_weight)
    assert torch.allclose(actual, expected.logits[0], atol=1e-4, rtol=1e-4), (actual - expected.logits[0]).abs().max()
    hf_routing = torch.stack([torch.softmax(r, -1).topk(2, dim=-1).indices for r in expected.router_logits], dim=1)
    assert out.routed_experts.shape == (12, 4, 2)
    assert torch.equal(out.routed_experts, hf_routing.to(torch.int32))
    assert len(set(out.routed_experts.flatten().tolist())) > 4  # tokens spread over the experts
