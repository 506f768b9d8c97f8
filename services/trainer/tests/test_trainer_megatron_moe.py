"""Qwen3-MoE on the Megatron backend (CPU, megatron-core for real): HF <-> Megatron mapping of routers and experts
with a dense `mlp_only_layers` layer, logprobs equal to the torch backend's within 1e-5 for the same HF weights
with and without routing replay (R3, through megatron-core's RouterReplay), the routing-agreement statistic, and
a training step that moves router and expert weights."""

from __future__ import annotations

import random
from array import array
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from miles.common.errors import ConfigError
from miles.common.jobspec.trainer import TrainConfig
from miles.model import ModelConfig, Segment, load_model, read_safetensors_dir
from miles.trainer.backends.megatron_mapping import AttentionLayout, hf_to_megatron, megatron_to_hf
from miles.trainer.backends.torch_backend import load_policy
from miles.trainer.batch import TrainSample
from miles.trainer.step import MiniBatch, StepPlan, run_step

if TYPE_CHECKING:
    from miles.trainer.backends.megatron_backend import MegatronBackend

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

VOCAB = 512
NUM_EXPERTS, TOP_K = 8, 2
TEMPERATURE = 1.0
TOLERANCE = 1e-5


def test_moe_mapping_round_trips_routers_experts_and_a_dense_layer() -> None:
    layout = AttentionLayout(num_heads=4, num_kv_heads=2, head_dim=8)
    hidden, ffn, expert_ffn = 16, 24, 12
    gen = torch.Generator().manual_seed(0)
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (50, hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (32, hidden),
            p + "self_attn.k_proj.weight": (16, hidden),
            p + "self_attn.v_proj.weight": (16, hidden),
            p + "self_attn.o_proj.weight": (hidden, 32),
            p + "self_attn.q_norm.weight": (8,),
            p + "self_attn.k_norm.weight": (8,),
        }
    shapes |= {"model.layers.0.mlp.gate.weight": (NUM_EXPERTS, hidden)}  # layer 0 sparse, layer 1 dense
    for e in range(NUM_EXPERTS):
        expert = f"model.layers.0.mlp.experts.{e}."
        shapes |= {
            expert + "gate_proj.weight": (expert_ffn, hidden),
            expert + "up_proj.weight": (expert_ffn, hidden),
            expert + "down_proj.weight": (hidden, expert_ffn),
        }
    for name in ("gate_proj", "up_proj"):
        shapes[f"model.layers.1.mlp.{name}.weight"] = (ffn, hidden)
    shapes["model.layers.1.mlp.down_proj.weight"] = (hidden, ffn)
    tensors = {name: torch.randn(*shape, generator=gen) for name, shape in shapes.items()}

    megatron = hf_to_megatron(tensors, layout, 2, tied=True)
    assert torch.equal(megatron["decoder.layers.0.mlp.router.weight"], tensors["model.layers.0.mlp.gate.weight"])
    fc1 = megatron["decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight"]
    assert torch.equal(fc1[:expert_ffn], tensors["model.layers.0.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(fc1[expert_ffn:], tensors["model.layers.0.mlp.experts.5.up_proj.weight"])
    assert torch.equal(
        megatron["decoder.layers.0.mlp.experts.local_experts.7.linear_fc2.weight"],
        tensors["model.layers.0.mlp.experts.7.down_proj.weight"],
    )
    assert megatron["decoder.layers.1.mlp.linear_fc1.weight"].shape == (2 * ffn, hidden)
    assert not any(k.startswith("decoder.layers.0.mlp.linear_fc") for k in megatron)
    assert not any(k.startswith("decoder.layers.1.mlp.router") for k in megatron)
    back = megatron_to_hf(megatron, layout, 2, tied=True)
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[name], tensors[name]) for name in tensors)


def _build_moe_dir(root: Path, *, norm_topk_prob: bool) -> Path:
    from miles.engine.tiny_model import build_tiny_model

    # Layer 1 is dense (mlp_only_layers): MoE layers 0, 2 and 3 are the layer axis of recorded routing.
    overrides = {"vocab_size": VOCAB, "mlp_only_layers": [1], "norm_topk_prob": norm_topk_prob}
    return build_tiny_model(root / f"moe-norm-{norm_topk_prob}", moe=True, config_overrides=overrides)


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "no_norm_topk"])
def moe_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_moe_dir(tmp_path_factory.mktemp("models"), norm_topk_prob=request.param)


@pytest.fixture(scope="module")
def normed_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_moe_dir(tmp_path_factory.mktemp("models"), norm_topk_prob=True)


def _samples() -> list[TrainSample]:
    rng = random.Random(3)
    samples = []
    for i, (length, prompt) in enumerate(((9, 3), (14, 5), (6, 2), (11, 1))):
        tokens = [rng.randrange(0, VOCAB) for _ in range(length)]
        num_response = length - prompt
        samples.append(
            TrainSample(
                group_id="g",
                sample_id=f"s{i}",
                group_index=0,
                tokens=tokens,
                response_start=prompt,
                loss_mask=[1] * num_response,
                rollout_logprobs=[-6.0] * num_response,
                reward=float(i % 2),
                trainable=True,
                min_version=0,
                max_version=0,
                advantage=1.0 if i % 2 else -1.0,
            )
        )
    return samples


def _own_routing(model_dir: Path, samples: list[TrainSample]) -> list[torch.Tensor]:
    """What the torch model's routers pick for each sample's fed positions 0..T-2: (T - 1, layers, k) int32,
    the layout an engine records."""
    lm = load_model(model_dir)
    with torch.no_grad():
        return [lm.forward_routed([Segment(torch.tensor(s.tokens[:-1]))]).routed_experts for s in samples]


def _with_routing(samples: list[TrainSample], routing: list[torch.Tensor]) -> list[TrainSample]:
    for sample, ids in zip(samples, routing, strict=True):
        sample.routed_experts = array("i", ids.reshape(-1).tolist())
    return samples


def _perturbed(routing: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every other position moved to other experts in every MoE layer (a shift keeps the k ids distinct, and for
    k = 2 of 8 experts never maps a pair onto itself)."""
    out = []
    for ids in routing:
        shifted = ids.clone().long()
        shifted[::2] = (shifted[::2] + 3) % NUM_EXPERTS
        out.append(shifted.int())
    return out


def _megatron(model_dir: Path, config: TrainConfig) -> MegatronBackend:
    from miles.trainer.backends.megatron_backend import MegatronBackend

    return MegatronBackend(ModelConfig.from_dir(model_dir), read_safetensors_dir(model_dir), config)


def test_megatron_builds_qwen3_moe_as_hugging_face_routes(moe_model_dir: Path) -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer  # type: ignore[import-untyped]

    backend = _megatron(moe_model_dir, TrainConfig())
    model = backend.model
    config = model.config
    norm_topk_prob = ModelConfig.from_dir(moe_model_dir).norm_topk_prob
    assert config.moe_router_pre_softmax is (not norm_topk_prob)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (NUM_EXPERTS, TOP_K, 128)
    assert config.moe_aux_loss_coeff == 0.0 and config.moe_z_loss_coeff is None
    assert config.moe_enable_routing_replay is True  # routing_replay None: on for MoE
    assert [isinstance(layer.mlp, MoELayer) for layer in model.decoder.layers] == [True, False, True, True]
    routing = backend.shape.routing
    assert (routing.num_layers, routing.top_k, routing.num_experts) == (3, TOP_K, NUM_EXPERTS)

    exported = backend.hf_state_dict()
    original = read_safetensors_dir(moe_model_dir)
    assert set(exported) == set(original) - {"lm_head.weight"}
    assert (
        "model.layers.1.mlp.gate_proj.weight" in exported and "model.layers.2.mlp.experts.7.up_proj.weight" in exported
    )
    assert all(torch.equal(exported[name], original[name].float()) for name in exported)


def test_megatron_moe_logprobs_match_the_torch_backend_without_replay(moe_model_dir: Path) -> None:
    config = TrainConfig(routing_replay=False)
    megatron = _megatron(moe_model_dir, config)
    torch_backend = load_policy(moe_model_dir, config)
    samples = _samples()
    with torch.no_grad():
        free = megatron.forward(samples, temperature=TEMPERATURE, entropy_grad=False)
        reference = torch_backend.forward(samples, temperature=TEMPERATURE, entropy_grad=False)
    assert free.routing_agreement is None
    assert (free.logprobs - reference.logprobs).abs().max().item() < TOLERANCE
    assert (free.entropy - reference.entropy).abs().max().item() < TOLERANCE

    # Recorded routing without replay: only the statistic. Megatron's routers pick exactly the torch model's
    # experts at every position of every MoE layer (no near-tie flips on these weights), so the logprobs agree.
    recorded = _with_routing(_samples(), _own_routing(moe_model_dir, samples))
    with torch.no_grad():
        measured = megatron.forward(recorded, temperature=TEMPERATURE, entropy_grad=False)
    assert measured.routing_agreement is not None
    assert measured.routing_agreement.tolist() == [1.0, 1.0, 1.0]
    assert torch.equal(measured.logprobs, free.logprobs)
    print("max |megatron - torch| without replay:", (free.logprobs - reference.logprobs).abs().max().item())


def test_megatron_moe_replays_recorded_routing_like_the_torch_backend(moe_model_dir: Path) -> None:
    config = TrainConfig()  # routing_replay None: on for MoE
    megatron = _megatron(moe_model_dir, config)
    torch_backend = load_policy(moe_model_dir, config)
    own = _own_routing(moe_model_dir, _samples())
    with torch.no_grad():
        unreplayed = torch_backend.forward(_samples(), temperature=TEMPERATURE, entropy_grad=False).logprobs

        # The routers' own routing replayed: the same logprobs as free routing, full agreement.
        same = _with_routing(_samples(), own)
        ours = megatron.forward(same, temperature=TEMPERATURE, entropy_grad=False)
        assert (ours.logprobs - unreplayed).abs().max().item() < TOLERANCE
        assert ours.routing_agreement.tolist() == [1.0, 1.0, 1.0]

        # Perturbed routing: both backends follow the recorded experts, agree with each other, not with free routing.
        perturbed = _with_routing(_samples(), _perturbed(own))
        replayed = megatron.forward(perturbed, temperature=TEMPERATURE, entropy_grad=False)
        theirs = torch_backend.forward(perturbed, temperature=TEMPERATURE, entropy_grad=False)
    diff = (replayed.logprobs - theirs.logprobs).abs().max().item()
    assert diff < TOLERANCE
    assert (replayed.logprobs - unreplayed).abs().max().item() > 0.1
    assert (replayed.entropy - theirs.entropy).abs().max().item() < TOLERANCE
    # The agreement is the routers' own choice (given the replayed layers before) against the recorded one,
    # the same statistic the torch backend computes from miles.model's own picks.
    assert theirs.routing_agreement is not None
    assert torch.equal(replayed.routing_agreement, theirs.routing_agreement)
    assert replayed.routing_agreement.max().item() < 1.0
    # Nothing is left armed: the next forward routes freely again.
    assert all(
        h.target_topk_idx is None and h.router_replay_action is None and not h.replay_backward_list
        for h in megatron.routers.replays
    )
    print("max |megatron - torch| with replay of perturbed routing:", diff)


def test_megatron_moe_trains_router_and_experts_with_replay(normed_moe_model_dir: Path) -> None:
    # kl_coef builds the reference model, which replays too: before any update it scores exactly as the policy.
    config = TrainConfig(optimizer={"lr": 1e-2}, loss={"kl_coef": 0.1})
    megatron = _megatron(normed_moe_model_dir, config)
    samples = _with_routing(_samples(), _perturbed(_own_routing(normed_moe_model_dir, _samples())))
    with torch.no_grad():
        policy = megatron.forward(samples, temperature=TEMPERATURE, entropy_grad=False)
        reference = megatron.reference_logprobs(samples, temperature=TEMPERATURE)
    assert torch.equal(policy.logprobs, reference)

    minibatch = MiniBatch([[samples[:2], samples[2:]]], sum(len(s.loss_mask) for s in samples), len(samples))
    result = run_step(megatron, StepPlan([minibatch], trainer_version=0), config)
    assert result.violation is None and result.grad_norm > 0
    assert torch.isfinite(torch.tensor(result.stats["loss"]))
    before = read_safetensors_dir(normed_moe_model_dir)
    after = megatron.hf_state_dict()

    def moved(name: str) -> float:
        return (after[name] - before[name].float()).abs().max().item()

    for layer in (0, 2, 3):
        assert moved(f"model.layers.{layer}.mlp.gate.weight") > 1e-4, layer  # the router, through replay
        # Only the experts recorded positions route to get a gradient: some of them moved.
        assert max(moved(f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight") for e in range(8)) > 1e-4
    assert moved("model.layers.1.mlp.gate_proj.weight") > 1e-4  # the dense layer


def test_megatron_moe_refuses_bad_routing_and_replay_on_a_dense_model(
    normed_moe_model_dir: Path, small_model_dir: Path
) -> None:
    with pytest.raises(ConfigError, match="routing_replay"):
        _megatron(small_model_dir, TrainConfig(routing_replay=True))
    megatron = _megatron(normed_moe_model_dir, TrainConfig())
    own = _own_routing(normed_moe_model_dir, _samples())
    out_of_range = [ids.clone() for ids in own]
    out_of_range[1][0, 0, 0] = NUM_EXPERTS
    repeated = [ids.clone() for ids in own]
    repeated[2][1, 2] = repeated[2][1, 2, 0]
    short = _with_routing(_samples(), own)
    short[0].routed_experts = short[0].routed_experts[:-TOP_K]  # type: ignore[index]
    for samples, match in (
        (_with_routing(_samples(), out_of_range), "within"),
        (_with_routing(_samples(), repeated), "repeat"),
        (short, "routed expert ids"),
    ):
        with torch.no_grad(), pytest.raises(ValueError, match=match):
            megatron.forward(samples, temperature=TEMPERATURE, entropy_grad=False)
    # A sample without routing (one that is not trained on) beside routed ones runs with stand-in experts.
    mixed = _with_routing(_samples(), own)
    mixed[3].routed_experts = None
    with torch.no_grad():
        outputs = megatron.forward(mixed, temperature=TEMPERATURE, entropy_grad=False)
    assert outputs.routing_agreement.tolist() == [1.0, 1.0, 1.0]
