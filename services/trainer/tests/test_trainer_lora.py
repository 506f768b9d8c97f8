"""LoRA on the torch backend (small-vocabulary tiny model, in process): a step trains the adapter only (base
weights bit-identical, AdamW state for adapter tensors only), the published weights are the merged ones and the
trainer's logprobs are bit-identical to a plain model's over them, a checkpoint holds the PEFT adapter and its
optimizer state only and resumes to the same next step, and bad LoRA settings are refused with clear errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft.utils import load_peft_weights
from pydantic import ValidationError

from miles.buffer.client import BufferClient
from miles.common.errors import ConfigError
from miles.common.jobspec.trainer import LoraConfig, TrainConfig
from miles.model import load_model, load_named_tensors, read_safetensors_dir, sequence_logprobs
from miles.model.kernels import single_threaded
from miles.proto.trainer.v1 import trainer_pb2
from miles.trainer.assemble import assemble
from miles.trainer.backends.torch_backend import TorchBackend, load_policy
from miles.trainer.batch import TrainSample
from miles.trainer.checkpoint import ADAPTER_DIR, MODEL_DIR, CheckpointStore, TrainerState
from miles.trainer.distributed import RankRunner
from miles.trainer.settings import TrainerSettings
from miles.trainer.step import StepResult, run_step

StepGroupsFactory = Callable[..., list[list[TrainSample]]]

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
RECIPE = {"optimizer": {"lr": 1e-2, "grad_clip_norm": None}, "lora": LORA}


def lora_config(**overrides: object) -> TrainConfig:
    return TrainConfig(**{**RECIPE, **overrides})  # type: ignore[arg-type]


def step(backend: TorchBackend, config: TrainConfig, groups: list[list[TrainSample]]) -> StepResult:
    assembled = assemble(groups, [0] * len(groups), config, trainer_version=0, world_size=1)
    result = run_step(backend, assembled.plan, config)
    backend.advance_schedule()
    return result


def snapshot(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in backend.policy.lm.named_parameters()}


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def test_a_step_trains_the_adapter_only_and_adamw_holds_only_adapter_tensors(
    small_model_dir: Path, make_step_groups: StepGroupsFactory
) -> None:
    config = lora_config()
    backend = load_policy(small_model_dir, config)
    before = snapshot(backend)
    trainable = {name for name, p in backend.policy.lm.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(name) for name in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj", "down_proj"}

    result = step(backend, config, make_step_groups(small_model_dir, deterministic=False))
    assert result.num_optimizer_steps == 1
    after = snapshot(backend)
    for name, value in after.items():
        if is_adapter(name):
            continue
        assert torch.equal(value, before[name]), f"frozen {name} moved"
    assert all(not torch.equal(after[n], before[n]) for n in trainable if ".lora_B." in n)  # B starts at 0
    optimized = [p for group in backend.optimizer.param_groups for p in group["params"]]
    adapter_ids = {id(p) for n, p in backend.policy.lm.named_parameters() if is_adapter(n)}
    assert len(optimized) == len(adapter_ids) and {id(p) for p in optimized} == adapter_ids
    state = backend.optimizer_state()["optimizer"]["state"]
    # AdamW moments exist for the adapter tensors and nothing else (keys: the policy's "lm." + parameter name)
    assert set(state) == {f"lm.{name}" for name in trainable}


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
def test_logprobs_are_bit_identical_to_a_plain_model_with_the_published_merged_weights(
    small_model_dir: Path, make_step_groups: StepGroupsFactory, deterministic: bool
) -> None:
    config = lora_config(deterministic=deterministic)
    groups = make_step_groups(small_model_dir, deterministic=deterministic)
    backend = load_policy(small_model_dir, config)
    step(backend, config, groups)  # B != 0 from here on
    merged = backend.hf_state_dict()
    samples = [sample for group in groups for sample in group]
    with torch.no_grad():
        trained = backend.forward(samples, temperature=1.0, entropy_grad=False).logprobs
        plain = load_policy(small_model_dir, TrainConfig(deterministic=deterministic))
        plain.load_hf_state_dict(merged)
        served = plain.forward(samples, temperature=1.0, entropy_grad=False).logprobs
    assert torch.equal(trained, served)
    base = load_policy(small_model_dir, TrainConfig(deterministic=deterministic))
    with torch.no_grad():
        assert not torch.equal(trained, base.forward(samples, temperature=1.0, entropy_grad=False).logprobs)
    if deterministic:  # what a deterministic engine serving the merged weights reports, sequence by sequence
        model = load_model(small_model_dir)
        load_named_tensors(model, merged, require_all=True)
        with torch.no_grad():
            engine = [
                sequence_logprobs(model, torch.tensor(s.tokens), start=s.response_start, deterministic=True)
                for s in samples
            ]
        assert torch.equal(trained, torch.cat(engine))


def test_published_weights_are_w_plus_scaled_b_a(small_model_dir: Path, make_step_groups: StepGroupsFactory) -> None:
    config = lora_config(lora={**LORA, "use_rslora": True})
    backend = load_policy(small_model_dir, config)
    step(backend, config, make_step_groups(small_model_dir, deterministic=False))
    published = RankRunner(backend, config).hf_tensors()  # what Trainer.publish sends to weight-sync
    base = load_model(small_model_dir).state_dict()
    params = dict(backend.policy.lm.named_parameters())
    assert set(published) == set(base)
    scaling = 8.0 / 4**0.5
    assert config.lora is not None and config.lora.scaling == scaling
    for name, tensor in published.items():
        module = name.removesuffix(".weight")
        if f"{module}.lora_A.default.weight" not in params:
            assert torch.equal(tensor, base[name]), name
            continue
        a, b = params[f"{module}.lora_A.default.weight"], params[f"{module}.lora_B.default.weight"]
        expected = base[name] + (b.detach() @ a.detach()) * scaling
        assert torch.equal(tensor, expected), name
        assert not torch.equal(tensor, base[name])


def test_checkpoint_holds_the_peft_adapter_and_its_optimizer_state_and_resumes_to_the_same_step(
    small_model_dir: Path, make_step_groups: StepGroupsFactory, tmp_path: Path
) -> None:
    from miles.trainer.backends.torch_lora import adapter_config_dict

    config = lora_config()
    assert config.lora is not None
    groups = make_step_groups(small_model_dir, deterministic=False)
    backend = load_policy(small_model_dir, config)
    step(backend, config, groups)
    runner = RankRunner(backend, config)
    tensors, optimizer = runner.full_state()
    adapter_config = adapter_config_dict(config.lora, small_model_dir)
    store = CheckpointStore(tmp_path, keep_last=2, source_model_dir=small_model_dir, adapter_config=adapter_config)
    path = store.write(TrainerState(job_id="j", step=1, weight_version=1), tensors, optimizer, {})

    assert not (path / MODEL_DIR).exists()
    assert sorted(p.name for p in (path / ADAPTER_DIR).iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    saved = load_peft_weights(str(path / ADAPTER_DIR))  # peft's own reader
    assert set(saved) == set(tensors) and all(name.startswith("base_model.model.") for name in saved)
    assert len(saved) == 2 * 3 * 2  # A and B of 3 targets in 2 layers
    peft_config = PeftLoraConfig.from_pretrained(str(path / ADAPTER_DIR))
    assert (peft_config.r, peft_config.lora_alpha) == (4, 8.0)
    assert set(peft_config.target_modules) == {"q_proj", "v_proj", "down_proj"}
    assert json.loads((path / ADAPTER_DIR / "adapter_config.json").read_text())["peft_type"] == "LORA"
    saved_optimizer = torch.load(path / "optimizer.pt", weights_only=True)
    assert len(saved_optimizer["state"]) == len(saved)

    restored = load_policy(small_model_dir, config)
    loaded = store.load(1)
    RankRunner(restored, config).load_state(loaded.tensors, loaded.optimizer)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(restored.hf_state_dict()[q_proj], backend.hf_state_dict()[q_proj])
    next_groups = make_step_groups(small_model_dir, deterministic=False, num_groups=2, per_group=2)
    original_next, restored_next = step(backend, config, next_groups), step(restored, config, next_groups)
    assert restored_next.stats["loss"] == original_next.stats["loss"]
    assert restored_next.grad_norm == original_next.grad_norm
    after_original, after_restored = backend.hf_state_dict(), restored.hf_state_dict()
    assert all(torch.equal(after_original[n], after_restored[n]) for n in after_original)


def test_a_checkpoint_of_the_other_kind_is_refused(tmp_path: Path) -> None:
    tensors = {"model.norm.weight": torch.ones(4)}
    full = CheckpointStore(tmp_path, keep_last=2, source_model_dir=None)
    full.write(TrainerState(job_id="j", step=1, weight_version=1), tensors, {}, {})
    lora = CheckpointStore(tmp_path, keep_last=2, source_model_dir=None, adapter_config={"peft_type": "LORA"})
    with pytest.raises(ConfigError, match="holds full weights but this job trains a LoRA adapter"):
        lora.load(1)


def test_an_unknown_or_unadaptable_target_module_is_refused_when_the_model_loads(small_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"\['qkv_proj'\] match no adaptable linear layer") as refused:
        load_policy(small_model_dir, lora_config(lora={**LORA, "target_modules": ["q_proj", "qkv_proj"]}))
    assert refused.value.field == "train.lora.target_modules"
    assert "'gate_proj'" in str(refused.value)  # the message lists what the model has
    with pytest.raises(ConfigError, match=r"\['lm_head'\]"):
        load_policy(small_model_dir, lora_config(lora={**LORA, "target_modules": ["lm_head"]}))


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"rank": 0}, "rank"),
        ({"target_modules": []}, "at least one linear layer"),
        ({"target_modules": ["model.layers.0.q_proj"]}, "without dots"),
        ({"target_modules": ["q_proj", "q_proj"]}, "duplicates"),
        ({"alpha": 0}, "alpha"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_bad_lora_fields_are_refused(lora: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TrainConfig(lora=lora)  # type: ignore[arg-type]


def test_dropout_with_strict_on_policy_is_a_recipe_problem() -> None:
    ((field, why),) = TrainConfig(strict_on_policy=True, lora=LoraConfig(dropout=0.1)).recipe_problems()
    assert field == "train.lora.dropout" and "exactly" in why
    assert TrainConfig(strict_on_policy=True, lora=LoraConfig()).recipe_problems() == []


@pytest.mark.parametrize(
    ("process", "message"),
    [
        ({"backend": "megatron"}, "torch backend only"),
        ({"world_size": 2}, "single trainer process"),
        ({"checkpoint_format": "sharded"}, "checkpoint_format 'full'"),
    ],
)
def test_trainer_settings_refuse_lora_where_it_is_not_implemented(
    process: dict[str, object], message: str, tmp_path: Path
) -> None:
    with pytest.raises(ValidationError, match=message):
        TrainerSettings(train=TrainConfig(lora=LoraConfig()), **process)  # type: ignore[arg-type]
    TrainerSettings(train=TrainConfig(lora=LoraConfig()))  # torch, one process, full checkpoints: accepted


def test_lora_jobs_write_adapter_checkpoints_and_others_full_ones(small_model_dir: Path) -> None:
    from miles.trainer.main import _adapter_config

    settings = TrainerSettings(model_path=small_model_dir, train=TrainConfig(lora=LoraConfig(rank=2)))
    adapter_config = _adapter_config(settings)
    assert adapter_config is not None
    assert (adapter_config["r"], adapter_config["base_model_name_or_path"]) == (2, str(small_model_dir))
    json.dumps(adapter_config)  # JSON-ready, as adapter_config.json
    assert _adapter_config(TrainerSettings(model_path=small_model_dir)) is None


def test_gradient_checkpointing_and_bf16_train_the_adapter(
    small_model_dir: Path, make_step_groups: StepGroupsFactory
) -> None:
    groups = make_step_groups(small_model_dir, deterministic=False)
    plain_config, ckpt_config = lora_config(), lora_config(gradient_checkpointing=True)
    plain, ckpt = load_policy(small_model_dir, plain_config), load_policy(small_model_dir, ckpt_config)
    plain_result, ckpt_result = step(plain, plain_config, groups), step(ckpt, ckpt_config, groups)
    assert ckpt_result.stats["loss"] == pytest.approx(plain_result.stats["loss"], abs=1e-7)
    a, b = snapshot(plain), snapshot(ckpt)  # the adapters start the same (A's init is drawn from train.seed)
    assert max((a[n] - b[n]).abs().max().item() for n in a) < 2e-7
    bf16_config = lora_config(dtype="bfloat16")
    bf16 = load_policy(small_model_dir, bf16_config)
    before = snapshot(bf16)
    assert step(bf16, bf16_config, groups).num_optimizer_steps == 1
    after = snapshot(bf16)
    assert all(torch.equal(after[n], before[n]) for n in after if not is_adapter(n))
    assert all(not torch.equal(after[n], before[n]) for n in after if ".lora_B." in n)


def test_make_backend_refuses_lora_on_megatron_before_building_it() -> None:
    from miles.trainer.backends.base import make_backend

    settings = TrainerSettings(backend="megatron")
    with pytest.raises(ConfigError, match="torch backend only") as refused:
        make_backend(settings, TrainConfig(lora=LoraConfig()))
    assert refused.value.field == "train.lora"


async def _push(target: str, job_id: str, groups: list[Any]) -> None:
    async with BufferClient(target) as buffer:
        await buffer.configure_job(job_id)
        for group in groups:
            assert (await buffer.push_group(job_id, group)).outcome == 1  # QUEUED


@pytest.mark.integration
async def test_a_lora_trainer_process_publishes_merged_weights_checkpoints_the_adapter_and_resumes(
    buffer_process: Any,
    small_model_dir: Path,
    tmp_path: Path,
    job_id: str,
    make_group: Any,
    make_trainer_env: Any,
    start_trainer: Any,
) -> None:
    await _push(buffer_process.target, job_id, [make_group(f"a-{i}", seed=i) for i in range(4)])
    checkpoint_dir = tmp_path / "ckpt"
    env = make_trainer_env(
        job_id=job_id,
        buffer=buffer_process,
        model_dir=small_model_dir,
        checkpoint_dir=checkpoint_dir,
        batch_size_groups=2,
        num_steps=2,
        pull_wait_s=0.5,
    )
    env |= {
        "MILES_TRAINER_TRAIN__OPTIMIZER__LR": "1e-2",
        "MILES_TRAINER_TRAIN__LORA__RANK": "4",
        "MILES_TRAINER_TRAIN__LORA__TARGET_MODULES": json.dumps(LORA["target_modules"]),
    }
    first = start_trainer(env).start()
    status = first.wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED, timeout_s=120)
    assert (status.step, status.checkpoint_step) == (2, 2)
    step_dir = checkpoint_dir / "step-00000002"
    assert (step_dir / ADAPTER_DIR / "adapter_config.json").is_file() and not (step_dir / MODEL_DIR).exists()
    adapter = load_peft_weights(str(step_dir / ADAPTER_DIR))
    published = read_safetensors_dir(checkpoint_dir / "published" / "weights-v000002")
    base = load_model(small_model_dir).state_dict()
    scaling = 16.0 / 4  # default alpha / rank
    with single_threaded():  # the trainer process computes on one thread (MILES_TRAINER_NUM_THREADS=1)
        for name, tensor in published.items():
            prefix = "base_model.model." + name.removesuffix(".weight")
            if f"{prefix}.lora_A.weight" in adapter:
                delta = adapter[f"{prefix}.lora_B.weight"] @ adapter[f"{prefix}.lora_A.weight"]
                assert torch.equal(tensor, base[name] + delta * scaling), name
            else:
                assert torch.equal(tensor, base[name]), name
    first.stop()

    await _push(buffer_process.target, job_id, [make_group(f"b-{i}", seed=10 + i, version=2) for i in range(2)])
    env["MILES_TRAINER_TRAIN__NUM_STEPS"] = "3"
    second = start_trainer(env).start()
    status = second.wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED, timeout_s=120)
    assert (status.step, status.weight_version, status.checkpoint_step) == (3, 3, 3)
    assert status.groups_trained == 2  # resumed at step 2: only the new groups were trained
    assert (checkpoint_dir / "step-00000003" / ADAPTER_DIR / "adapter_model.safetensors").is_file()
