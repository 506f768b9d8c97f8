"""The Megatron backend on the CPU: HF <-> Megatron weight mapping (Qwen3 and Llama), logprobs equal to the
torch backend's within 1e-5 for the same HF weights, and a forward/backward/optimizer step with state
round-trips. megatron-core runs for real here, with the CPU patches of backends/cpu_compat.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from miles.common.jobspec.trainer import TrainConfig
from miles.model import ModelConfig, read_safetensors_dir
from miles.trainer.backends.megatron_mapping import AttentionLayout, fuse_qkv, hf_to_megatron, megatron_to_hf, split_qkv
from miles.trainer.backends.torch_backend import load_policy
from miles.trainer.batch import TrainSample
from miles.trainer.step import MiniBatch, StepPlan, run_step

# megatron-core 0.16.1 warns about its own deprecations and missing Apex/TE at import and build time.
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def test_fused_qkv_layout_groups_query_heads_with_their_key_value_head() -> None:
    layout = AttentionLayout(num_heads=4, num_kv_heads=2, head_dim=1)
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # heads 0,1 -> kv group 0 ; heads 2,3 -> group 1
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = fuse_qkv(q, k, v, layout)
    assert fused[:, 0].tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, layout), (q, k, v), strict=True))


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_hf_megatron_mapping_round_trips(model_type: str) -> None:
    layout = AttentionLayout(num_heads=4, num_kv_heads=2, head_dim=8)
    hidden, ffn, layers = 16, 24, 2
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(50, hidden, generator=gen),
        "model.norm.weight": torch.randn(hidden, generator=gen),
        "lm_head.weight": torch.randn(50, hidden, generator=gen),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (32, hidden),
            "self_attn.k_proj.weight": (16, hidden),
            "self_attn.v_proj.weight": (16, hidden),
            "self_attn.o_proj.weight": (hidden, 32),
            "mlp.gate_proj.weight": (ffn, hidden),
            "mlp.up_proj.weight": (ffn, hidden),
            "mlp.down_proj.weight": (hidden, ffn),
        }
        if model_type == "qwen3":
            shapes |= {"self_attn.q_norm.weight": (8,), "self_attn.k_norm.weight": (8,)}
        tensors |= {p + name: torch.randn(*shape, generator=gen) for name, shape in shapes.items()}
    megatron = hf_to_megatron(tensors, layout, layers, tied=False)
    assert megatron["decoder.layers.1.mlp.linear_fc1.weight"].shape == (2 * ffn, hidden)
    assert megatron["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (64, hidden)
    back = megatron_to_hf(megatron, layout, layers, tied=False)
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[name], tensors[name]) for name in tensors)


def _samples() -> list[TrainSample]:
    rng = random.Random(3)
    samples = []
    for i, (length, prompt) in enumerate(((9, 3), (14, 5), (6, 2), (11, 1))):
        tokens = [rng.randrange(0, 512) for _ in range(length)]
        samples.append(
            TrainSample(
                "g",
                f"s{i}",
                0,
                tokens,
                prompt,
                [1] * (length - prompt),
                [-6.0] * (length - prompt),
                float(i % 2),
                True,
                0,
                0,
                advantage=1.0 if i % 2 else -1.0,
            )
        )
    return samples


@pytest.fixture(scope="module")
def llama_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.engine.tiny_model import build_tiny_model

    overrides = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512,
        "num_hidden_layers": 2,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    }
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", config_overrides=overrides)


@pytest.mark.parametrize("which", ["qwen3", "llama"])
def test_megatron_logprobs_match_the_torch_backend_within_1e_5(
    which: str, small_model_dir: Path, llama_model_dir: Path
) -> None:
    from miles.trainer.backends.megatron_backend import MegatronBackend

    model_dir = small_model_dir if which == "qwen3" else llama_model_dir
    config = TrainConfig()
    megatron = MegatronBackend(ModelConfig.from_dir(model_dir), read_safetensors_dir(model_dir), config)
    reference = load_policy(model_dir, config)
    samples = _samples()
    with torch.no_grad():
        ours = megatron.forward(samples, temperature=0.7, entropy_grad=False)
        theirs = reference.forward(samples, temperature=0.7, entropy_grad=False)
    assert ours.logprobs.shape == theirs.logprobs.shape == (sum(len(s.loss_mask) for s in samples),)
    assert (ours.logprobs - theirs.logprobs).abs().max().item() < 1e-5
    assert (ours.entropy - theirs.entropy).abs().max().item() < 1e-5
    exported = megatron.hf_state_dict()
    original = read_safetensors_dir(model_dir)
    assert set(exported) == set(original) - (
        {"lm_head.weight"} if ModelConfig.from_dir(model_dir).tie_word_embeddings else set()
    )
    assert all(torch.equal(exported[name], original[name].float()) for name in exported)


def test_megatron_trains_a_step_on_the_cpu_and_restores_its_state(small_model_dir: Path) -> None:
    from miles.trainer.backends.megatron_backend import MegatronBackend

    config = TrainConfig(optimizer={"lr": 1e-2}, loss={"kl_coef": 0.1, "entropy_coef": 0.01})
    model_config, weights = ModelConfig.from_dir(small_model_dir), read_safetensors_dir(small_model_dir)
    backend = MegatronBackend(model_config, weights, config)
    samples = _samples()
    minibatch = MiniBatch(
        [[samples[:2], samples[2:]]], global_num_tokens=sum(len(s.loss_mask) for s in samples), global_num_seqs=4
    )
    plan = StepPlan([minibatch], trainer_version=0)
    result = run_step(backend, plan, config)
    assert result.violation is None and result.grad_norm > 0 and torch.isfinite(torch.tensor(result.stats["loss"]))
    assert result.stats["kl"] == pytest.approx(0.0, abs=1e-9)
    trained = backend.hf_state_dict()
    assert max((trained[n] - weights[n].float()).abs().max().item() for n in trained) > 1e-4
    second = run_step(backend, StepPlan([minibatch], trainer_version=1), config)
    assert second.stats["kl"] > 0

    # A fresh backend restored from the exported state continues identically.
    optimizer_state = backend.optimizer_state()
    restored = MegatronBackend(model_config, backend.hf_state_dict(), config)
    restored.load_optimizer_state(optimizer_state)
    with torch.no_grad():
        a = backend.forward(samples, temperature=1.0, entropy_grad=False).logprobs
        b = restored.forward(samples, temperature=1.0, entropy_grad=False).logprobs
    assert torch.equal(a, b)
    assert restored.learning_rate() == backend.learning_rate()


def test_megatron_runs_minibatches_and_epochs_like_the_torch_backend(small_model_dir: Path) -> None:
    from miles.trainer.backends.megatron_backend import MegatronBackend

    config = TrainConfig(optimizer={"lr": 1e-3}, ppo_epochs=2, num_minibatches=2)
    samples = _samples()
    halves = (samples[:2], samples[2:])
    plan = StepPlan(
        [MiniBatch([[half]], sum(len(s.loss_mask) for s in half), len(half)) for half in halves], trainer_version=0
    )
    megatron = MegatronBackend(ModelConfig.from_dir(small_model_dir), read_safetensors_dir(small_model_dir), config)
    torch_backend = load_policy(small_model_dir, config)
    ours, theirs = run_step(megatron, plan, config), run_step(torch_backend, plan, config)
    assert ours.num_optimizer_steps == theirs.num_optimizer_steps == 4
    assert megatron.scheduler.last_epoch == 1
    assert {int(state["step"]) for state in megatron.optimizer.state.values()} == {4}
    for name in ("loss", "pg_clipfrac", "ppo_ratio_max", "ppo_ratio_min", "is_ratio_max"):
        assert ours.stats[name] == pytest.approx(theirs.stats[name], rel=1e-3, abs=1e-6), name
    print({name: round(ours.stats[name], 5) for name in ("loss", "pg_clipfrac", "ppo_ratio_max", "ppo_ratio_min")})
