"""`miles`: the platform from a terminal (typer + rich).

    miles up                      start the shared services locally (detached; logs under .miles/logs/)
    miles down                    cancel active jobs, stop the shared services
    miles status                  services and their health, the controller URL, active jobs (and their evals)
    miles submit SPEC.yaml        submit a job (YAML or JSON) and follow it live (--no-follow: just submit)
    miles jobs                    list jobs
    miles logs SERVICE [-f]       a shared service's log, or a job's process log (`miles logs JOB_ID [PROCESS]`)
    miles cancel JOB_ID           cancel a job
    miles eval SPEC --model DIR   greedy reward of a model on held-out prompts with the spec's agent and reward
                                  (--job-id J --version V: recorded as version V's score of job J)

The controller is found from `<home>/run/platform.json` (written by `miles up`), or `--url` /
`MILES_CONTROLLER_URL`; `MILES_API_TOKEN` is sent as the bearer token when set. `<home>` is `--home` or
`MILES_HOME`, default `.miles`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
import yaml
from rich.console import Console
from rich.live import Live
from rich.table import Table

from miles.cli.follow import JobWatch, iter_events, reward_table
from miles.cli.launcher import (
    Layout,
    PlatformError,
    ServiceRecord,
    ensure_platform,
    load_state,
    service_health,
    start_platform,
    stop_platform,
)

app = typer.Typer(help="miles: agentic RL post-training platform", no_args_is_help=True, add_completion=False)
console = Console()
ACTIVE_STATES = ("PENDING", "QUEUED", "RUNNING")

HomeOption = Annotated[Path, typer.Option("--home", envvar="MILES_HOME", help="Platform state directory")]
UrlOption = Annotated[
    str | None, typer.Option("--url", envvar="MILES_CONTROLLER_URL", help="Controller URL (default: from --home)")
]
DEFAULT_HOME = Path(".miles")


def controller_client(home: Path, url: str | None, *, timeout_s: float = 30.0) -> httpx.Client:
    """An HTTP client for the controller: `url`, else the one `miles up` recorded under `home`."""
    if url is None:
        state = load_state(Layout(home))
        if state is None:
            raise typer.BadParameter(f"no platform under {home} (run `miles up`, or pass --url)")
        url = state.controller_url
    headers = {}
    token = os.environ.get("MILES_API_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.Client(base_url=url, headers=headers, timeout=timeout_s, trust_env=False)


def _check(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            detail: Any = response.json()
        except ValueError:
            detail = response.text
        console.print(f"[red]{response.request.method} {response.request.url.path}: {response.status_code}[/]")
        console.print(json.dumps(detail, indent=2) if not isinstance(detail, str) else detail)
        raise typer.Exit(1)
    return response.json() if response.content else None


@app.command()
def up(
    home: HomeOption = DEFAULT_HOME,
    timeout_s: float = typer.Option(180.0, help="Readiness timeout"),
    threads: int = typer.Option(1, help="OMP_NUM_THREADS of every service and per-job process (0: unset)"),
) -> None:
    """Start redis, router, session server, buffer, sandbox gateway and controller (local backend), detached."""
    layout = Layout(home)
    try:
        running = ensure_platform(layout, ready_timeout_s=timeout_s)
    except PlatformError as exc:
        console.print(f"[red]miles up failed:[/] {exc}")
        raise typer.Exit(1) from None
    if running is not None:
        state, restarted = running
        healed = f" (restarted on the same ports: {', '.join(restarted)})" if restarted else ""
        console.print(f"already up: controller {state.controller_url}{healed}")
        return
    if load_state(layout) is not None:
        stop_platform(layout)  # the records of a platform of which nothing runs any more
    started = time.monotonic()
    try:
        with console.status("starting the shared services"):
            state = start_platform(
                layout,
                ready_timeout_s=timeout_s,
                threads_per_process=threads,
                on_ready=lambda r: console.print(f"  [green]ready[/] {r.name:<10} {r.url}"),
            )
    except PlatformError as exc:
        console.print(f"[red]miles up failed:[/] {exc}")
        raise typer.Exit(1) from None
    console.print(_services_table(list(state.services.values())))
    console.print(f"up in {time.monotonic() - started:.1f}s; controller {state.controller_url}; logs {layout.log_dir}")


@app.command()
def down(
    home: HomeOption = DEFAULT_HOME,
    keep_jobs: bool = typer.Option(False, help="Leave active jobs' processes running (no cancel)"),
    cancel_wait_s: float = typer.Option(60.0, help="How long to wait for cancelled jobs to stop"),
) -> None:
    """Cancel active jobs, then stop the shared services (SIGTERM, SIGKILL after a grace period)."""
    layout = Layout(home)
    state = load_state(layout)
    if state is None:
        console.print("nothing to stop")
        return
    if not keep_jobs and service_health(state.services["controller"]) == "ready":
        _cancel_active_jobs(controller_client(home, None), cancel_wait_s)
    stopped = stop_platform(layout)
    console.print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")


def _cancel_active_jobs(client: httpx.Client, wait_s: float) -> None:
    with client:
        jobs = [j for j in client.get("/v1/jobs").json().get("jobs", []) if j["state"] in ACTIVE_STATES]
        for job in jobs:
            console.print(f"cancelling {job['job_id']}")
            client.post(f"/v1/jobs/{job['job_id']}/cancel")
        deadline = time.monotonic() + wait_s
        while jobs and time.monotonic() < deadline:
            jobs = [j for j in jobs if client.get(f"/v1/jobs/{j['job_id']}").json()["state"] in ACTIVE_STATES]
            time.sleep(0.5)


@app.command()
def status(home: HomeOption = DEFAULT_HOME, url: UrlOption = None) -> None:
    """Health of each shared service and the active jobs."""
    state = load_state(Layout(home))
    if state is None and url is None:
        console.print(f"no platform under {home} (miles up)")
        raise typer.Exit(1)
    if state is not None:
        console.print(_services_table(list(state.services.values())))
    try:
        with controller_client(home, url) as client:
            jobs = client.get("/v1/jobs").json().get("jobs", [])
    except httpx.HTTPError as exc:
        console.print(f"[red]controller unreachable:[/] {exc}")
        raise typer.Exit(1) from None
    active = [j for j in jobs if j["state"] in ACTIVE_STATES]
    console.print(_jobs_table(active, title="active jobs") if active else "no active jobs")
    for job in active:
        console.print(health_line(job))
        from miles.cli.evaluation import eval_lines

        with controller_client(home, url) as client:  # the job's own evaluation's scores, or recorded ones
            evals = client.get(f"/v1/jobs/{job['job_id']}/evals")
        for line in eval_lines(evals.json()) if evals.status_code == 200 else []:  # a job deleted meanwhile: none
            console.print(line, soft_wrap=True)


@app.command()
def jobs(
    home: HomeOption = DEFAULT_HOME,
    url: UrlOption = None,
    state: str | None = typer.Option(None, help="Only jobs in this state"),
    as_json: bool = typer.Option(False, "--json", help="Print the job records as JSON"),
) -> None:
    """List jobs, newest first."""
    params = {"state": state} if state else {}
    with controller_client(home, url) as client:
        records = _check(client.get("/v1/jobs", params=params))["jobs"]
    if as_json:
        console.print_json(json.dumps(records))
    else:
        console.print(_jobs_table(records, title="jobs"))


@app.command()
def submit(
    spec_path: Annotated[Path, typer.Argument(help="Job spec, YAML or JSON")],
    home: HomeOption = DEFAULT_HOME,
    url: UrlOption = None,
    follow: bool = typer.Option(True, help="Follow the job live until it ends"),
    name: str | None = typer.Option(None, help="Override the spec's name"),
    idempotency_key: str | None = typer.Option(None, help="Idempotency-Key header (safe retries)"),
) -> None:
    """Submit a job; with --follow (default) show its progress until it ends (exit 1 unless it SUCCEEDED)."""
    spec = load_spec(spec_path)
    if name is not None:
        spec["name"] = name
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    with controller_client(home, url) as client:
        job = _check(client.post("/v1/jobs", json=spec, headers=headers))
        console.print(f"submitted job [bold]{job['job_id']}[/] ({job['state']})")
        if not follow:
            return
        watch = follow_job(client, job["job_id"], num_steps=int(job.get("num_steps") or 0))
    console.print(reward_table(watch))
    console.print(f"job {watch.job_id} {watch.state}: {watch.reason}")
    if watch.state != "SUCCEEDED":
        raise typer.Exit(1)


def load_spec(path: Path) -> dict[str, Any]:
    """A job spec file as the JSON body of POST /v1/jobs (YAML is a superset of JSON)."""
    loaded = yaml.safe_load(path.read_text())
    if not isinstance(loaded, dict):
        raise typer.BadParameter(f"{path} does not hold a mapping")
    return loaded


def follow_job(client: httpx.Client, job_id: str, *, num_steps: int = 0) -> JobWatch:
    """Follow a job's event stream to its end; returns what was seen. On a terminal: a live display; otherwise
    (CI logs, pipes) one line per new step and per state change."""
    watch = JobWatch(job_id, num_steps=num_steps)
    if not console.is_terminal:
        for event in iter_events(client, job_id):
            before = (watch.state, watch.step)
            watch.apply(event)
            if (watch.state, watch.step) != before:
                console.print(watch.line(), soft_wrap=True)
        return watch
    with Live(watch.render(), console=console, refresh_per_second=4) as view:
        for event in iter_events(client, job_id):
            watch.apply(event)
            view.update(watch.render())
    return watch


@app.command(name="eval")
def eval_model(
    spec_path: Annotated[Path, typer.Argument(help="Job spec (YAML or JSON): its agent, reward and model family")],
    model: Annotated[Path, typer.Option(help="Model directory: the initial model or a checkpoint's model/")],
    home: HomeOption = DEFAULT_HOME,
    dataset: str | None = typer.Option(None, help="Prompts to evaluate on (default: the spec's dataset)"),
    limit: int | None = typer.Option(None, help="Evaluate only the first N prompts"),
    job_id: str | None = typer.Option(None, help="Record the score for this job (with --version)"),
    version: int | None = typer.Option(None, min=0, help="The job's weight version the model directory holds"),
    dataset_name: str = typer.Option("held", help="The dataset's name in the recorded result"),
    url: UrlOption = None,
) -> None:
    """Greedy reward of a model on a dataset with a job spec's agent and reward (on the platform of miles up);
    with --job-id and --version, recorded as that version's score (GET /v1/jobs/{id}/evals, miles status)."""
    import asyncio

    from miles.cli.evaluation import evaluate_model, platform_endpoints, recorded_eval_body, valid_dataset_name
    from miles.common.jobspec.job import JobSpec

    if (job_id is None) != (version is None):
        raise typer.BadParameter("--job-id and --version go together")
    if job_id is not None:  # fail before the evaluation, not after it
        if not valid_dataset_name(dataset_name):
            raise typer.BadParameter(f"--dataset-name {dataset_name!r}: lowercase letters, digits, _ and -")
        with controller_client(home, url) as client:
            _check(client.get(f"/v1/jobs/{job_id}"))
    layout = Layout(home)
    spec = JobSpec.model_validate(load_spec(spec_path))
    endpoints = platform_endpoints(layout)
    started_ms = int(time.time() * 1000)
    result = asyncio.run(
        evaluate_model(endpoints, spec, model.resolve(), log_dir=layout.log_dir, dataset_path=dataset, limit=limit)
    )
    console.print(f"eval mean_reward={result.mean_reward:.3f} prompts={result.num_prompts} reasons={result.reasons}")
    if job_id is not None and version is not None:
        body = recorded_eval_body(result, spec, version=version, dataset_name=dataset_name, seen_unix_ms=started_ms)
        with controller_client(home, url) as client:
            _check(client.post(f"/v1/jobs/{job_id}/evals", json=body))
        console.print(f"recorded as job {job_id} version {version} ({dataset_name})")


@app.command()
def cancel(job_id: str, home: HomeOption = DEFAULT_HOME, url: UrlOption = None) -> None:
    """Cancel a job (its per-job processes are stopped)."""
    with controller_client(home, url) as client:
        job = _check(client.post(f"/v1/jobs/{job_id}/cancel"))
    console.print(f"job {job_id}: {job['state']}")


@app.command()
def logs(
    service: Annotated[str, typer.Argument(help="Shared service (redis, router, ...) or a job id")],
    process: Annotated[str | None, typer.Argument(help="A job's process log (e.g. trainer, engine-0)")] = None,
    home: HomeOption = DEFAULT_HOME,
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines"),
    lines: int = typer.Option(50, "--lines", "-n", help="Lines from the end"),
) -> None:
    """Print (and with -f follow) a log file."""
    layout = Layout(home)
    path = layout.log_file(service)
    if not path.is_file():
        job_dir = layout.controller_state_dir / "jobs" / service
        if not job_dir.is_dir():
            raise typer.BadParameter(f"no log for {service!r} under {layout.log_dir} and no job dir {job_dir}")
        candidates = sorted(job_dir.rglob("*.log"))
        if process is None:
            for candidate in candidates:
                console.print(str(candidate.relative_to(job_dir)))
            return
        matching = [c for c in candidates if c.stem == process or c.name == process]
        if not matching:
            raise typer.BadParameter(f"job {service} has no {process!r} log: {[c.stem for c in candidates]}")
        path = matching[0]
    _tail(path, lines, follow)


def _tail(path: Path, num_lines: int, follow: bool) -> None:
    with path.open("r", errors="replace") as handle:
        for line in handle.readlines()[-num_lines:] if num_lines > 0 else []:
            typer.echo(line.rstrip("\n"))
        while follow:
            line = handle.readline()
            if line:
                typer.echo(line.rstrip("\n"))
            else:
                time.sleep(0.2)


def _services_table(records: list[ServiceRecord]) -> Table:
    table = Table(title="miles shared services")
    for column in ("service", "health", "pid", "restarts", "address", "log"):
        table.add_column(column)
    for record in records:
        health = service_health(record)
        style = {"ready": "green", "stopped": "red"}.get(health, "yellow")
        row = (record.name, f"[{style}]{health}[/]", str(record.pid), str(record.restarts), record.url, record.log_path)
        table.add_row(*row)
    return table


def _jobs_table(records: list[dict[str, Any]], *, title: str) -> Table:
    table = Table(title=title)
    for column in ("job", "name", "state", "step", "reward", "staleness", "prefix hit"):
        table.add_column(column)
    for job in records:
        table.add_row(
            job["job_id"],
            job.get("name") or "",
            job["state"],
            f"{job.get('step', 0)}/{job.get('num_steps', '?')}",
            _fmt(job.get("reward")),
            _fmt(job.get("staleness")),
            _fmt(job.get("prefix_hit_rate")),
        )
    return table


def health_line(job: dict[str, Any]) -> str:
    """One line per job: reward trend, entropy, grad norm, train/rollout logprob gap, zero-signal and clip
    fractions, then the warnings (miles.controller.health)."""
    health = job.get("health") or {}

    def value(key: str, spec: str) -> str:
        number = health.get(key)
        return "-" if number is None else format(number, spec)

    line = (
        f"{job['job_id']} health: reward {value('reward_first', '.2f')} -> {value('reward_last', '.2f')}, "
        f"entropy {value('entropy', '.3f')}, grad_norm {value('grad_norm', '.2f')}, "
        f"logprob_diff {value('logprob_diff', '.3f')}, zero_signal {value('zero_signal_fraction', '.0%')}, "
        f"clip {value('clip_fraction', '.1%')}"
    )
    warnings = health.get("warnings") or []
    return line + (" [red]" + "; ".join(warnings) + "[/]" if warnings else " [green]ok[/]")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main() -> None:
    app()
