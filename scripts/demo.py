"""`make run`: the whole platform on this machine with the calculator tool-use demo job, end to end.

    python scripts/demo.py [--spec examples/calculator_tool/job.yaml] [--home .miles] [--keep-up] [--seed N]

1. builds the demo model (`examples/calculator_tool/warmup.py`: tiny Qwen3 architecture, small-vocabulary Qwen3
   tokenizer, a short supervised warm-up) at the spec's `model.path` when it is missing; a path whose directory
   name ends in `-moe` (`examples/calculator_tool/job_moe.yaml`) is built as the tiny Qwen3-MoE variant instead,
   and `reasoning-demo` / `harbor-demo` (`examples/reasoning_gym/job.yaml`, `make run DEMO=reasoning`;
   `examples/harbor_tasks/job.yaml`) by that example's warmup.py;
2. `miles up` (unless a platform is already up under --home, which is then reused and left up);
3. submits the job (fully-async GRPO) and follows it live until it ends;
4. evaluates the model before and after training on held-out prompts (`examples/calculator_tool/eval.jsonl`: no
   prompt of the training set; for a job with a hub environment, the environment's rows made with
   --eval-environment-args, another seed), greedy, with the job's agent and reward (`miles eval`: one engine on
   the initial model, then on the final checkpoint);
5. prints the reward per step and the final line
   `demo eval_before=<e0> eval_after=<e1> reward_first=<a> reward_last=<b> steps=<n> staleness_mean=<s>
   prefix_hit=<h> tito_critical=<c>`, where reward_first / reward_last are the mean rewards of the first / last
   three steps the controller reported (sampled, so noisier than the greedy evaluation); for a MoE model (its
   config.json says `qwen3_moe`) the line ends with ` routing_agreement=<r>`, the trainer's last step's share of
   routed positions whose own top-k equals the recorded one;
6. `miles down` (the platform it started is stopped; `--keep-up` leaves it running for `miles status` etc.).

Exit status 0 when the job SUCCEEDED, the held-out greedy reward rose by at least --min-eval-rise, the training
reward by at least --min-rise, and tito_critical is 0; for a MoE model also when R3 was really on: the last step
of `GET /v1/jobs/{id}` reports routing_replay 1 and a routing_agreement, and the trainer's log names no group
rejected for missing_routing or bad_routing (`routing_replay_problems`); else 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "examples"))

from miles.cli.follow import JobWatch, reward_table  # noqa: E402
from miles.cli.launcher import Layout, load_state, start_platform, stop_platform  # noqa: E402
from miles.cli.launcher import ensure_platform as ensure_running_platform  # noqa: E402
from miles.cli.main import console, controller_client, follow_job  # noqa: E402

NUM_EDGE_STEPS = 3
"""reward_first / reward_last average this many steps (one step is 32 episodes: noisy on its own)."""
ROUTING_REJECT_REASONS = ("missing_routing", "bad_routing")
"""The trainer's nack reasons that mean a MoE group was not trained with its recorded routing (R3)."""


MOE_MODEL_SUFFIX = "-moe"
WARMUP_SCRIPTS = {
    "reasoning-demo": "examples/reasoning_gym/warmup.py",
    "harbor-demo": "examples/harbor_tasks/warmup.py",
}
"""Demo models of the hub-environment examples, by directory name, and the script that builds each (scripts, not
modules: examples/reasoning_gym must not shadow the real reasoning_gym package)."""
"""A model directory named like this (`.miles/models/calculator-demo-moe`) is built as the tiny Qwen3-MoE."""


def ensure_model(path: Path) -> None:
    if (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file():
        console.print(f"demo model: {path} (exists)")
        return
    started = time.monotonic()
    if path.name in WARMUP_SCRIPTS:  # a hub-environment example: its own warm-up
        console.print(f"building the demo model at {path} (tiny Qwen3 + {WARMUP_SCRIPTS[path.name]}) ...")
        subprocess.run([sys.executable, str(REPO_ROOT / WARMUP_SCRIPTS[path.name]), str(path)], check=True)
        console.print(f"demo model built in {time.monotonic() - started:.0f}s")
        return
    from calculator_tool.warmup import build_demo_model

    moe = path.name.endswith(MOE_MODEL_SUFFIX)
    console.print(f"building the demo model at {path} (tiny Qwen3{'-MoE' if moe else ''} + warm-up) ...")
    build_demo_model(path, moe=moe)
    console.print(f"demo model built in {time.monotonic() - started:.0f}s")


def is_moe_model(path: Path) -> bool:
    """Whether the model directory holds a Qwen3-MoE (what the session server and trainer decide R3 by)."""
    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    return bool(config.get("model_type") == "qwen3_moe")


def routing_agreement(job: dict[str, Any]) -> float | None:
    """The trainer's last step's routing agreement over all MoE layers, as `GET /v1/jobs/{id}` shows it."""
    value = (job.get("metrics") or {}).get("routing_agreement")
    return None if value is None else float(value)


def routing_report(job: dict[str, Any]) -> str:
    """One line of the last step's R3 figures: replay on/off, agreement per MoE layer, train/rollout logprob gap."""
    metrics = job.get("metrics") or {}
    layers = sorted(
        (int(k.rsplit("_", 1)[1]), v) for k, v in metrics.items() if k.startswith("routing_agreement_layer_")
    )
    per_layer = " ".join(f"{value:.3f}" for _, value in layers) or "-"
    gap = metrics.get("train_rollout_logprob_abs_diff")
    return (
        f"R3 last step: routing_replay={metrics.get('routing_replay', '-')} routing_agreement per MoE layer "
        f"{per_layer}; mean |train - rollout logprob| {'-' if gap is None else f'{gap:.4f}'}"
    )


def routing_rejections(trainer_log: Path) -> dict[str, int]:
    """Groups the trainer rejected for their routing, by reason, from its log (every restart appends to it).
    The trainer logs `group rejected: <reason>`; the counter of the same name dies with the job's processes."""
    counts = dict.fromkeys(ROUTING_REJECT_REASONS, 0)
    text = trainer_log.read_text(errors="replace") if trainer_log.is_file() else ""
    for line in text.splitlines():
        for reason in ROUTING_REJECT_REASONS:
            counts[reason] += f"group rejected: {reason}" in line
    return counts


def routing_replay_problems(job: dict[str, Any], job_directory: Path) -> list[str]:
    """Why R3 was not really on for a MoE job ([] when it was): the last step did not replay, reported no
    routing agreement, or some group was refused for missing or bad routing."""
    metrics = job.get("metrics") or {}
    problems = []
    if metrics.get("routing_replay") != 1.0:
        problems.append(f"the last step reports routing_replay={metrics.get('routing_replay')}, not 1")
    if routing_agreement(job) is None:
        problems.append("the last step reports no routing_agreement (no recorded routing reached the trainer)")
    trainer_log = job_directory / "trainer.log"
    if not trainer_log.is_file():
        problems.append(f"no trainer log at {trainer_log} to check for rejected groups")
    for reason, count in routing_rejections(trainer_log).items():
        if count:
            problems.append(f"the trainer rejected {count} groups for {reason}")
    return problems


def ensure_platform(layout: Layout) -> bool:
    """Start the platform unless one is up (healed in place if part of it died); True when this run started it."""
    running = ensure_running_platform(layout)
    if running is not None:
        console.print(f"reusing the platform under {layout.home}: {running[0].controller_url}")
        return False
    if load_state(layout) is not None:
        stop_platform(layout)
    started = time.monotonic()
    with console.status("miles up"):
        state = start_platform(layout, on_ready=lambda r: console.print(f"  ready {r.name:<10} {r.url}"))
    console.print(f"platform up in {time.monotonic() - started:.0f}s: controller {state.controller_url}")
    return True


def edge_mean(rewards: dict[int, float], *, last: bool) -> float:
    steps = sorted(rewards)
    chosen = steps[-NUM_EDGE_STEPS:] if last else steps[:NUM_EDGE_STEPS]
    return sum(rewards[s] for s in chosen) / max(1, len(chosen))


def summary_line(watch: JobWatch, job: dict[str, Any], evals: tuple[float, float], *, moe: bool = False) -> str:
    staleness = list(watch.staleness_by_step.values())
    prefix_hit = job.get("prefix_hit_rate")
    tito = job.get("tito_mismatches")
    agreement = routing_agreement(job)
    routing = "" if not moe else f" routing_agreement={'-' if agreement is None else f'{agreement:.3f}'}"
    return (
        f"demo eval_before={evals[0]:.3f} eval_after={evals[1]:.3f} "
        f"reward_first={edge_mean(watch.rewards_by_step, last=False):.3f} "
        f"reward_last={edge_mean(watch.rewards_by_step, last=True):.3f} steps={job.get('step', watch.step)} "
        f"staleness_mean={sum(staleness) / max(1, len(staleness)):.2f} "
        f"prefix_hit={0.0 if prefix_hit is None else prefix_hit:.3f} tito_critical={int(tito or 0)}{routing}"
    )


def job_dir(layout: Layout, job_id: str) -> Path:
    """The local backend's directory of the job: config files, logs (`trainer.log`), checkpoints."""
    return Path(layout.controller_state_dir) / "jobs" / job_id


def final_checkpoint_model(layout: Layout, job_id: str) -> Path:
    """The `model/` directory of the job's newest checkpoint (the local backend keeps it in the job dir)."""
    steps = sorted((job_dir(layout, job_id) / "checkpoints").glob("step-*"))
    if not steps or not (steps[-1] / "model").is_dir():
        raise RuntimeError(f"job {job_id} left no checkpoint to evaluate")
    return steps[-1] / "model"


def evaluate(
    layout: Layout, spec: dict[str, Any], model_dir: Path, eval_path: Path, what: str, environment_args: str
) -> float:
    """Greedy mean reward on held-out prompts: eval_path's rows, or (a job with a hub environment) the environment's
    rows made with `environment_args` merged into its args (another seed)."""
    import asyncio

    from miles.cli.evaluation import evaluate_model, platform_endpoints
    from miles.common.jobspec.job import JobSpec

    started = time.monotonic()
    job_spec = JobSpec.model_validate(spec)
    on_environment = job_spec.rollout.environment is not None
    source = f"environment rows with {environment_args}" if on_environment else eval_path.name
    with console.status(f"evaluating the {what} model on {source}"):
        result = asyncio.run(
            evaluate_model(
                platform_endpoints(layout),
                job_spec,
                model_dir,
                log_dir=layout.log_dir,
                dataset_path=None if on_environment else str(eval_path),
                environment_args=json.loads(environment_args) if on_environment else None,
            )
        )
    console.print(
        f"eval {what}: mean greedy reward {result.mean_reward:.3f} over {result.num_prompts} held-out prompts "
        f"({time.monotonic() - started:.0f}s; {result.reasons})"
    )
    return float(result.mean_reward)


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    spec = yaml.safe_load(args.spec.read_text())
    model_path = Path(spec["model"]["path"])
    model_path = model_path if model_path.is_absolute() else REPO_ROOT / model_path
    spec["model"]["path"] = str(model_path)  # the per-job processes need not share our working directory
    if args.seed is not None:
        spec["train"]["seed"] = args.seed
        spec["rollout"]["dataset"]["seed"] = args.seed
    ensure_model(model_path)
    layout = Layout(args.home)
    started_platform = ensure_platform(layout)
    try:
        eval_before = evaluate(layout, spec, model_path, args.eval, "initial", args.eval_environment_args)
        with controller_client(args.home, None) as client:
            response = client.post("/v1/jobs", json=spec)
            if response.status_code != 201:
                console.print(f"[red]submit failed {response.status_code}:[/] {response.text}")
                return 1
            job = response.json()
            console.print(f"submitted job {job['job_id']} ({spec.get('name', '')}, {spec['train']['mode']} mode)")
            watch = follow_job(client, job["job_id"], num_steps=int(job["num_steps"]))
            job = client.get(f"/v1/jobs/{job['job_id']}").json()
        console.print(reward_table(watch))
        if job["state"] != "SUCCEEDED":
            console.print(f"[red]job {job['job_id']} {job['state']}[/]: {job.get('errors')}")
            return 1
        final_model = final_checkpoint_model(layout, job["job_id"])
        eval_after = evaluate(layout, spec, final_model, args.eval, "trained", args.eval_environment_args)
        moe = is_moe_model(model_path)
        line = summary_line(watch, job, (eval_before, eval_after), moe=moe)
        rise = edge_mean(watch.rewards_by_step, last=True) - edge_mean(watch.rewards_by_step, last=False)
        console.print(f"wall time {time.monotonic() - started:.0f}s")
        r3_problems = routing_replay_problems(job, job_dir(layout, job["job_id"])) if moe else []
        if moe:
            console.print(routing_report(job))
        for problem in r3_problems:
            console.print(f"[red]R3 was not really on:[/] {problem}")
        print(line, flush=True)
        learned = eval_after - eval_before >= args.min_eval_rise and rise >= args.min_rise
        return 0 if learned and "tito_critical=0" in line and not r3_problems else 1
    finally:
        if started_platform and not args.keep_up:
            stopped = stop_platform(layout)
            console.print(f"platform stopped ({', '.join(stopped)})")
        elif not started_platform:
            console.print("platform left up (it was up before make run)")
        else:
            console.print(f"platform left up (--keep-up): miles status --home {args.home}; miles down to stop")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, default=REPO_ROOT / "examples/calculator_tool/job.yaml")
    parser.add_argument("--home", type=Path, default=REPO_ROOT / ".miles")
    parser.add_argument("--keep-up", action="store_true", help="leave the platform running afterwards")
    parser.add_argument("--eval", type=Path, default=REPO_ROOT / "examples/calculator_tool/eval.jsonl")
    parser.add_argument(
        "--eval-environment-args",
        default='{"seed": 1, "size": 48}',
        help="for a job with a hub environment: merged into its args for the evaluation (reasoning-gym: another "
        "seed gives rows the job does not train on)",
    )
    parser.add_argument("--min-eval-rise", type=float, default=0.2, help="eval_after - eval_before needed to pass")
    parser.add_argument("--min-rise", type=float, default=0.1, help="reward_last - reward_first needed to pass")
    parser.add_argument("--seed", type=int, default=None, help="train.seed and the dataset order (default: spec's)")
    sys.exit(run(parser.parse_args()))


if __name__ == "__main__":
    main()
