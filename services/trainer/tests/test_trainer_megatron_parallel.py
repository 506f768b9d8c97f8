"""The Megatron backend at real parallelism on the CPU (gloo): TP = 2, PP = 2, DP = 2 on the small dense Qwen3
(the TP test with a vocabulary of 509, not divisible by 2: padded and cut back) and EP = 2 on the tiny Qwen3-MoE
with routing replay, each compared with the same computation at TP = PP = DP = EP = 1 in this process.

Each parallel run is this file run as a script by `torch.distributed.run --nproc_per_node 2` (the trainer's own
launcher), driving the trainer's own rank model (`distributed.py`: rank 0 broadcasts `train_step`, `hf_tensors`,
`full_state`, `load_state`, the other rank follows). The backend builds each rank's shards from the HF checkpoint
itself (`LazyCheckpoint`); rank 0 writes what it measured to a file that the test compares:

- per-token logprobs (and entropies) of one forward: within 1e-5 of the single-rank run;
- hf_state_dict before any step: bit-identical to the checkpoint (the gather is exact);
- the loss (and pre-clip grad norm) of 5 trainer steps (one optimizer step each, KL and entropy terms on, several
  micro-batches per data rank) on the same batch: within LOSS_RTOL (GRAD_NORM_RTOL) of the single-rank run's (the
  parallel run sums in another order, and 5 AdamW updates carry that rounding forward);
- publishing after one step: "the same step" means both runs start from the same weights and take the same
  optimizer step on the same data; the weights then differ by float rounding only (within MAX_STEP_DIFF, far
  below how far the step moved them), so bit-identity is checked where it is exact: the parallel run's export
  loaded into a single-rank backend exports the very same bytes, and the single-rank run's step-one weights
  loaded into the parallel run (`load_state`: scattered from rank 0) come back out of it unchanged;
- the optimizer state gathered from the parallel run has the single-rank keys and loads into a single-rank backend
  (torch's own loader), which exports it back bit for bit.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.common.jobspec.trainer import TrainConfig
from miles.model import ModelConfig, read_safetensors_dir
from miles.trainer.assemble import plan_minibatch
from miles.trainer.batch import TrainSample
from miles.trainer.step import StepPlan, run_step

# Each test starts 2 processes (torch.distributed.run) and builds megatron-core 3 times: 15-30 s on 2 cores.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

LOGPROB_TOLERANCE = 1e-5
# Measured: losses within 3e-6 relative, grad norms within 2e-6, weights after one step within 1.2e-7.
LOSS_RTOL = 1e-4
GRAD_NORM_RTOL = 1e-4
MAX_STEP_DIFF = 1e-5
NUM_STEPS = 5
VOCAB = 512
NUM_EXPERTS = 8
# AdamW with eps = 1 makes the first updates ~linear in the gradient (as in test_trainer_fsdp.py): a gradient off
# by a factor (a wrong data-parallel scale, a doubled tied-embedding gradient) shows in the weights, where
# default-eps Adam's sign-like first step would hide it. No clipping: grad norms are compared instead.
RECIPE: dict[str, Any] = {
    "optimizer": {"lr": 1e-2, "eps": 1.0, "grad_clip_norm": None},
    "loss": {"kl_coef": 0.05, "entropy_coef": 0.01},
    "micro_batch_max_tokens": 20,
}


def _samples(vocab_size: int, *, seed: int = 3) -> list[TrainSample]:
    """Six sequences of 6 to 14 tokens (response masks with a hole, advantages +-1): with 20 tokens per
    micro-batch, several micro-batches per data rank."""
    rng = random.Random(seed)
    samples = []
    for i, (length, prompt) in enumerate(((9, 3), (14, 5), (6, 2), (11, 1), (8, 4), (12, 6))):
        mask = [1] * (length - prompt)
        mask[0] = 0
        samples.append(
            TrainSample(
                group_id="g",
                sample_id=f"s{i}",
                group_index=0,
                tokens=[rng.randrange(0, vocab_size) for _ in range(length)],
                response_start=prompt,
                loss_mask=mask,
                rollout_logprobs=[-6.0] * (length - prompt),
                reward=float(i % 2),
                trainable=True,
                min_version=0,
                max_version=0,
                advantage=1.0 if i % 2 else -1.0,
            )
        )
    return samples


def _single_rank(model_dir: Path, samples: list[TrainSample], train: TrainConfig) -> dict[str, Any]:
    """The same measurements at TP = PP = DP = EP = 1, in this process."""
    from miles.trainer.backends.megatron_backend import MegatronBackend

    backend = MegatronBackend(ModelConfig.from_dir(model_dir), read_safetensors_dir(model_dir), train)
    with torch.no_grad():
        outputs = backend.forward(samples, temperature=0.7, entropy_grad=False)
    plan = StepPlan([plan_minibatch(samples, train, 1)], trainer_version=0)
    results: dict[str, Any] = {"logprobs": outputs.logprobs, "entropy": outputs.entropy}
    results["agreement"] = outputs.routing_agreement
    results["losses"], results["grad_norms"] = [], []
    for step in range(NUM_STEPS):
        result = run_step(backend, plan, train)
        results["losses"].append(result.stats["loss"])
        results["grad_norms"].append(result.grad_norm)
        if step == 0:
            results["after_one"], results["state_after_one"] = backend.hf_state_dict(), backend.optimizer_state()
    results["final"] = backend.hf_state_dict()
    results["backend"] = backend
    return results


def _run_parallel(tmp_path: Path, model_dir: Path, inputs: dict[str, Any], **sizes: int) -> dict[str, Any]:
    """This file as a script on 2 ranks (torch.distributed.run); what rank 0 measured."""
    from miles.common.testing import free_port

    inputs_path, out_path = tmp_path / "inputs.pt", tmp_path / "results.pt"
    torch.save(inputs, inputs_path)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master-port",
        str(free_port()),
        __file__,
        "--model-dir",
        str(model_dir),
        "--inputs",
        str(inputs_path),
        "--out",
        str(out_path),
    ]
    for name, size in sizes.items():
        command += [f"--{name}", str(size)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-20000:]
    results: dict[str, Any] = torch.load(out_path, weights_only=False)
    return results


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def _assert_matches_single_rank(parallel: dict[str, Any], single: dict[str, Any], model_dir: Path) -> None:
    """Every comparison of the module docstring; prints what it measured."""
    logprob_diff = (parallel["logprobs"] - single["logprobs"]).abs().max().item()
    entropy_diff = (parallel["entropy"] - single["entropy"]).abs().max().item()
    assert parallel["logprobs"].shape == single["logprobs"].shape
    assert logprob_diff < LOGPROB_TOLERANCE and entropy_diff < LOGPROB_TOLERANCE
    checkpoint = {name: tensor.float() for name, tensor in read_safetensors_dir(model_dir).items()}
    assert parallel["initial"].keys() == single["final"].keys() <= checkpoint.keys()
    assert all(torch.equal(parallel["initial"][name], checkpoint[name]) for name in parallel["initial"])
    assert parallel["losses"] == pytest.approx(single["losses"], rel=LOSS_RTOL)
    assert parallel["grad_norms"] == pytest.approx(single["grad_norms"], rel=GRAD_NORM_RTOL)
    assert len(set(single["losses"])) == NUM_STEPS  # the weights moved: every step's loss differs
    step_diff = _max_diff(parallel["after_one"], single["after_one"])
    moved = _max_diff(single["after_one"], {name: checkpoint[name] for name in single["after_one"]})
    assert step_diff < MAX_STEP_DIFF < moved  # a real update, reproduced up to float rounding
    # Publishing is exact: the parallel run's export round-trips through a single-rank backend bit for bit, and
    # the single-rank run's step-one weights scattered into the parallel run come back out unchanged.
    backend = single["backend"]
    backend.load_hf_state_dict(parallel["after_one"])
    assert all(torch.equal(backend.hf_state_dict()[n], t) for n, t in parallel["after_one"].items())
    assert all(torch.equal(parallel["reloaded"][n], t) for n, t in single["after_one"].items())
    # The optimizer state gathered from the parallel run is the single-rank format: it loads and exports unchanged.
    state = parallel["state_after_one"]
    assert state["optimizer"]["state"].keys() == single["state_after_one"]["optimizer"]["state"].keys()
    backend.load_optimizer_state(state)
    reloaded = backend.optimizer_state()["optimizer"]["state"]
    for name, moments in state["optimizer"]["state"].items():
        assert all(torch.equal(reloaded[name][key], value) for key, value in moments.items()), name
    print(
        f"max |logprob diff| {logprob_diff:.3g}, entropy {entropy_diff:.3g}; weights after one step {step_diff:.3g} "
        f"(the step moved them {moved:.3g}); losses {parallel['losses']} vs {single['losses']}"
    )


def _dense_inputs(vocab_size: int) -> dict[str, Any]:
    return {"train": TrainConfig(**RECIPE), "samples": _samples(vocab_size)}


def _run_and_compare(
    tmp_path: Path, model_dir: Path, inputs: dict[str, Any], **sizes: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The single-rank run first (its step-one weights go to the parallel run's `load_state`), then the parallel
    run, then every comparison; (parallel, single) results."""
    single = _single_rank(model_dir, inputs["samples"], inputs["train"])
    inputs = {**inputs, "load_after_one": single["after_one"]}
    parallel = _run_parallel(tmp_path, model_dir, inputs, **sizes)
    _assert_matches_single_rank(parallel, single, model_dir)
    return parallel, single


@pytest.mark.slow
def test_tensor_parallel_2_matches_one_rank_with_a_padded_vocabulary(tmp_path: Path) -> None:
    from miles.engine.tiny_model import build_tiny_model

    # 509 tokens: not divisible by TP = 2, so the (tied) embedding and output are padded to 510 and cut back.
    overrides = {"vocab_size": 509, "num_hidden_layers": 2, "max_window_layers": 2}
    model_dir = build_tiny_model(tmp_path / "qwen3-509", config_overrides=overrides)
    parallel, _ = _run_and_compare(tmp_path, model_dir, _dense_inputs(509), tp=2)
    shapes = parallel["local_shapes"]
    assert parallel["data_ranks"] == 1  # both ranks train the same micro-batches
    assert shapes["embedding.word_embeddings.weight"] == (255, 64)  # rows 0..254 of 510
    assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == ((4 + 2 * 2) * 32 // 2, 64)  # 1 kv group
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (256, 64)  # [gate; up] halves of 2 x 256 rows
    assert shapes["decoder.layers.1.mlp.linear_fc2.weight"] == (64, 128)


def test_pipeline_parallel_2_matches_one_rank_with_tied_embeddings(tmp_path: Path, small_model_dir: Path) -> None:
    parallel, _ = _run_and_compare(tmp_path, small_model_dir, _dense_inputs(VOCAB), pp=2)
    shapes = parallel["local_shapes"]
    assert parallel["data_ranks"] == 1
    # Rank 0 is the first stage: the embedding and layer 0 only (the last stage holds layer 1, the final norm and
    # its own copy of the tied embedding as the output layer).
    assert {name.split(".")[2] for name in shapes if name.startswith("decoder.layers.")} == {"0"}
    assert "decoder.final_layernorm.weight" not in shapes and "output_layer.weight" not in shapes


def test_data_parallel_2_matches_one_rank(tmp_path: Path, small_model_dir: Path) -> None:
    parallel, _ = _run_and_compare(tmp_path, small_model_dir, _dense_inputs(VOCAB))
    assert parallel["data_ranks"] == 2  # each rank trains half of every minibatch's micro-batches


@pytest.mark.slow
def test_expert_parallel_2_with_routing_replay_matches_one_rank(tmp_path: Path) -> None:
    from miles.engine.tiny_model import build_tiny_model
    from miles.model import Segment, load_model

    overrides = {"vocab_size": VOCAB, "mlp_only_layers": [1]}  # MoE layers 0, 2, 3; layer 1 dense
    model_dir = build_tiny_model(tmp_path / "moe", moe=True, config_overrides=overrides)
    samples = _samples(VOCAB)
    lm = load_model(model_dir)
    for sample in samples:  # every other position moved to other experts: replay, not the router, decides
        with torch.no_grad():
            own = lm.forward_routed([Segment(torch.tensor(sample.tokens[:-1]))]).routed_experts.long()
        own[::2] = (own[::2] + 3) % NUM_EXPERTS
        sample.routed_experts = array("i", own.reshape(-1).tolist())
    inputs = {"train": TrainConfig(**RECIPE), "samples": samples}
    parallel, single = _run_and_compare(tmp_path, model_dir, inputs, ep=2)
    assert parallel["data_ranks"] == 2
    experts = {name.split(".")[6] for name in parallel["local_shapes"] if ".local_experts." in name}
    assert experts == {"0", "1", "2", "3"}  # 4 of the 8 experts of each MoE layer per rank
    # The routers' own top-k against the perturbed routing: the same statistic on both layouts (below 1: replayed).
    assert parallel["agreement"] is not None and torch.equal(parallel["agreement"], single["agreement"])
    assert single["agreement"].max().item() < 1.0


# ---- the worker (run as a script under torch.distributed.run) ------------------------------------------------


def _worker(args: argparse.Namespace) -> None:
    """One rank: build the backend, measure, train NUM_STEPS trainer steps through the trainer's rank model."""
    from miles.trainer.backends.megatron_backend import MegatronBackend
    from miles.trainer.backends.megatron_parallel import ParallelSizes
    from miles.trainer.backends.megatron_shards import LazyCheckpoint
    from miles.trainer.distributed import init_process_group, make_runner, serve_worker

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    init_process_group(
        rank=rank,
        world_size=world_size,
        master_addr="127.0.0.1",
        master_port=int(os.environ["MASTER_PORT"]),
        backend="gloo",
    )
    inputs = torch.load(args.inputs, weights_only=False)
    train: TrainConfig = inputs["train"]
    source = LazyCheckpoint(Path(args.model_dir))
    sizes = ParallelSizes(tp=args.tp, pp=args.pp, ep=args.ep)
    backend = MegatronBackend(ModelConfig.from_dir(args.model_dir), source, train, sizes=sizes)
    source.close()
    with torch.no_grad():
        outputs = backend.forward(inputs["samples"], temperature=0.7, entropy_grad=False)
    initial = backend.hf_state_dict()
    runner = make_runner(backend, train, rank=rank, world_size=world_size)
    if rank > 0:
        serve_worker(runner)
        return
    plan = StepPlan([plan_minibatch(inputs["samples"], train, runner.data.size)], trainer_version=0)
    results: dict[str, Any] = {"logprobs": outputs.logprobs, "entropy": outputs.entropy, "initial": initial}
    results["agreement"] = outputs.routing_agreement
    results["data_ranks"] = runner.data.size
    results["local_shapes"] = {name: tuple(param.shape) for name, param in backend.model.named_parameters()}
    results["losses"], results["grad_norms"] = [], []
    for step in range(NUM_STEPS):
        result = runner.train_step(plan)
        results["losses"].append(result.stats["loss"])
        results["grad_norms"].append(result.grad_norm)
        if step == 0:
            results["after_one"], results["state_after_one"] = runner.full_state()
            if inputs.get("load_after_one"):  # the single-rank run's weights after the same step, scattered back
                runner.load_state(inputs["load_after_one"], results["state_after_one"])
                results["reloaded"] = runner.hf_tensors()
    results["final"] = runner.hf_tensors()
    runner.stop_workers()
    torch.save(results, args.out)


def _main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("tp", "pp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--out", required=True)
    _worker(parser.parse_args())


if __name__ == "__main__":
    _main()
