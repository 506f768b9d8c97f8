"""Every PromQL expression the chart ships (Grafana dashboards, PrometheusRule alerts) queries only metric names
that something exports: a miles service, or a real SGLang engine (its documented `sglang:*` names).

The exported names are collected for real: the services are started from their console entry points (all at once,
with a real Redis where they need one, idle: no job) and their /metrics is read, TYPE lines included so that
labelled metrics without a child yet count. Two exceptions are served in-process by the common HTTP app over the
metrics their main() registers: the engine (it cannot start without a model; `EngineMetrics` exports SGLang's
names) and the trainer (`TrainerMetrics` is registered only while it trains a job). Nothing here is a hand-written
list of miles names, and a new directory under services/ that is neither started nor registered here fails.

SGLang's names come from its documentation (the `/metrics` table of the SGLang protocol reference the engine was
built against, copied below): production engines are real SGLang pods, scraped by the chart's PodMonitor.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient

from miles.common.grpc_server import build_grpc_server
from miles.common.http import create_http_app
from miles.common.telemetry import Metrics
from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.helm import by_kind, run_helm
from miles.common.testing.processes import wait_for_http_ready
from miles.common.testing.redis_server import RedisServer
from miles.common.testing.smoke import console_script

Renderer = Callable[..., list[dict[str, Any]]]
SERVICES_DIR = Path(__file__).resolve().parents[3] / "services"
START_TIMEOUT_S = 180.0

# SGLang's documented /metrics names (SGLang server protocol reference, "Metrics" section; sglang 0.5.x with
# --enable-metrics), as exposed (counters with _total; histograms expand to _bucket/_sum/_count below).
SGLANG_GAUGES = [
    "num_running_reqs",
    "num_queue_reqs",
    "num_grammar_queue_reqs",
    "num_used_tokens",
    "token_usage",
    "full_token_usage",
    "swa_token_usage",
    "mamba_usage",
    "kv_used_tokens",
    "kv_available_tokens",
    "kv_evictable_tokens",
    "max_total_num_tokens",
    "cache_hit_rate",
    "gen_throughput",
    "utilization",
    "new_token_ratio",
    "decode_sum_seq_lens",
    "num_retracted_reqs",
    "num_paused_reqs",
    "is_cuda_graph",
    "spec_accept_length",
    "spec_accept_rate",
]
SGLANG_COUNTERS = [
    "prompt_tokens",
    "generation_tokens",
    "cached_tokens",
    "num_requests",
    "num_aborted_requests",
    "num_retracted_requests",
    "num_retracted_input_tokens",
    "num_retracted_output_tokens",
]
SGLANG_HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "queue_time_seconds",
    "per_stage_req_latency_seconds",
    "prompt_tokens_histogram",
    "generation_tokens_histogram",
    "uncached_prompt_tokens_histogram",
    "weight_load_duration_seconds",
    "get_loads_duration_seconds",
    "func_latency_seconds",
]
# Series Prometheus itself adds to every target.
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created", ""),
    "gauge": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "unknown": ("",),
}


def sglang_documented_names() -> set[str]:
    names = {f"sglang:{name}" for name in SGLANG_GAUGES}
    names |= {f"sglang:{name}_total" for name in SGLANG_COUNTERS}
    names |= {f"sglang:{name}{suffix}" for name in SGLANG_HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
    return names


def scraped_names(exposition: str) -> set[str]:
    """The series names of a Prometheus text exposition, from its TYPE lines (so labelled metrics that have no
    child yet count) and its samples."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            family = name.removesuffix("_total") if kind == "counter" else name
            names |= {family + suffix for suffix in _SUFFIXES[kind]}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


# services/<dir> -> (env prefix, serves gRPC (then /metrics is on METRICS_PORT), needs Redis, extra environment).
STARTED_SERVICES: dict[str, tuple[str, bool, bool, dict[str, str]]] = {
    "buffer": ("BUFFER", True, True, {}),
    "controller": ("CONTROLLER", False, True, {}),
    "rollout-router": ("ROUTER", False, False, {}),
    "rollout-worker": ("ROLLOUT", False, False, {}),
    "sandbox-gateway": ("SANDBOX", True, False, {}),
    "session-server": ("SESSION", False, True, {}),
    "weight-sync": ("WEIGHTSYNC", True, False, {}),
}
IN_PROCESS_SERVICES = {"engine", "trainer"}


def scrape_running_services(redis_url: str, log_dir: Path) -> dict[str, str]:
    """Start every service of STARTED_SERVICES at once, read each one's /metrics, stop them all."""
    processes: dict[str, tuple[ServiceProcess, str]] = {}
    try:
        for service, (prefix, grpc, uses_redis, extra_env) in STARTED_SERVICES.items():
            port, metrics_port = free_port(), free_port()
            env = {f"MILES_{prefix}_PORT": str(port), f"MILES_{prefix}_METRICS_PORT": str(metrics_port), **extra_env}
            if uses_redis:
                env[f"MILES_{prefix}_REDIS_URL"] = redis_url
            if service == "rollout-router":
                env["MILES_ROUTER_ADMIN_GRPC_PORT"] = str(free_port())
            if service == "controller":
                env["MILES_CONTROLLER_STATE_DIR"] = str(log_dir / "controller-state")
            process = ServiceProcess(
                [console_script(f"miles-{service}")], ready_url=None, env=env, log_path=log_dir / f"{service}.log"
            )
            processes[service] = (process.start(), f"http://127.0.0.1:{metrics_port if grpc else port}")
        scraped = {}
        for service, (process, base) in processes.items():
            try:
                wait_for_http_ready(f"{base}/readyz", START_TIMEOUT_S, process.process)
            except (RuntimeError, TimeoutError) as exc:
                raise AssertionError(f"miles-{service}: {exc}\n{process.log_tail()}") from None
            response = httpx.get(f"{base}/metrics", timeout=10)
            assert response.status_code == 200, response.text
            scraped[service] = response.text
        return scraped
    finally:
        for process, _ in processes.values():
            process.stop()


def scrape_in_process(service: str) -> str:
    """/metrics of the common HTTP app (and gRPC server) over what `service`'s main() registers when it runs a job:
    for the engine (which needs a model to start) and the trainer (whose TrainerMetrics exist only while it trains;
    an idle trainer process serves the transport metrics alone)."""
    if service == "engine":
        from miles.engine.main import SERVICE
        from miles.engine.metrics import EngineMetrics

        metrics = Metrics(SERVICE)
        EngineMetrics(metrics, "tiny-qwen3")
    elif service == "trainer":
        from miles.trainer.main import SERVICE
        from miles.trainer.metrics import TrainerMetrics

        metrics = Metrics(SERVICE)
        TrainerMetrics(metrics)

        async def build_grpc_server_and_close() -> None:
            server = build_grpc_server(servicers=[], service_names=[], metrics=metrics)
            await server.server.stop(None)

        asyncio.run(build_grpc_server_and_close())
    else:
        raise AssertionError(f"no in-process registration for services/{service}")
    with TestClient(create_http_app(service=SERVICE, metrics=metrics)) as client:
        response = client.get("/metrics")
    assert response.status_code == 200, response.text
    return response.text


@pytest.fixture(scope="module")
def scraped(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """services/<dir> -> the series names its /metrics exposes."""
    texts = scrape_running_services(redis_server.url, tmp_path_factory.mktemp("service-logs"))
    texts |= {service: scrape_in_process(service) for service in sorted(IN_PROCESS_SERVICES)}
    return {service: scraped_names(text) for service, text in texts.items()}


@pytest.fixture(scope="module")
def exported(scraped: dict[str, set[str]]) -> frozenset[str]:
    """Every name a query may use: the services', SGLang's documented ones and Prometheus' own series."""
    return frozenset(set().union(*scraped.values()) | sglang_documented_names() | PROMETHEUS_SERIES)


# --- PromQL -----------------------------------------------------------------------------------------------------

_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless",
    "inf", "nan", "atan2", "start", "end",
}  # fmt: skip
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS_RE = re.compile(r"\{[^{}]*\}")
_RANGE_RE = re.compile(r"\[[^\]]*\]")
_GROUPING_RE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_GRAFANA_VAR_RE = re.compile(r"\$\{[^}]*\}|\$\w+")
_IDENTIFIER_RE = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*+)(?!\s*\()")
_LABEL_VALUES_RE = re.compile(r"^\s*label_values\(\s*(?:([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{[^}]*\})?\s*,)?")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (a small lexer: strings, label matchers, ranges, grouping
    clauses and Grafana variables are removed; what remains that is not a function call or keyword is a name)."""
    text = _GRAFANA_VAR_RE.sub("1", _STRING_RE.sub('""', expr))
    text = _RANGE_RE.sub("", _MATCHERS_RE.sub("", text))
    text = _GROUPING_RE.sub("", text)
    return {name for name in _IDENTIFIER_RE.findall(text) if name not in _KEYWORDS}


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable of a Grafana dashboard."""
    title = dashboard["title"]
    for panel in _panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                yield f"{title} / {panel.get('title')} / {target.get('refId')}", target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]
        text = query.get("query", "") if isinstance(query, dict) else str(query)
        label_values = _LABEL_VALUES_RE.match(text)
        if label_values:
            text = label_values.group(1) or ""
        if text:
            yield f"{title} / variable {variable['name']}", text


def shipped_queries(objects: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard ConfigMap and PrometheusRule among rendered chart objects."""
    queries = []
    for config_map in by_kind(objects, "ConfigMap"):
        for key, text in config_map.get("data", {}).items():
            if config_map["metadata"]["name"].startswith("miles-dashboard-") and key.endswith(".json"):
                queries += list(dashboard_queries(json.loads(text)))
    for rule_object in by_kind(objects, "PrometheusRule"):
        for group in rule_object["spec"]["groups"]:
            for rule in group["rules"]:
                queries.append((f"PrometheusRule {group['name']} / {rule['alert']}", rule["expr"]))
    return queries


def unexported(queries: list[tuple[str, str]], exported: frozenset[str]) -> list[str]:
    return [f"{where}: {name}" for where, expr in queries for name in sorted(metric_names(expr) - exported)]


# --- tests ------------------------------------------------------------------------------------------------------


def test_promql_lexer_finds_metric_names_only() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (phase, le) (rate(miles_x_seconds_bucket{job_id=~"$job", a="b c"}'
        "[$__rate_interval]))) / ignoring (phase) group_left sum(miles_y_total offset 5m) > 1e-3 "
        "and on (job_id) sglang:num_queue_reqs unless up == bool 0"
    )
    assert metric_names(expr) == {"miles_x_seconds_bucket", "miles_y_total", "sglang:num_queue_reqs", "up"}


@pytest.mark.integration
def test_exported_names_come_from_every_service(scraped: dict[str, set[str]]) -> None:
    services = {path.name for path in SERVICES_DIR.iterdir() if (path / "pyproject.toml").exists()}
    assert set(scraped) == services == set(STARTED_SERVICES) | IN_PROCESS_SERVICES
    prefixes = {"buffer": "buffer", "controller": "controller", "engine": "engine", "rollout-router": "router",
                "rollout-worker": "rollout", "sandbox-gateway": "sandbox", "session-server": "session",
                "trainer": "trainer", "weight-sync": "weightsync"}  # fmt: skip
    for service, names in scraped.items():
        assert f"miles_{prefixes[service]}_http_requests_total" in names, service
    assert "miles_weightsync_grpc_requests_total" in scraped["weight-sync"]
    assert {"miles_router_engine_weight_version", "miles_router_pool_engines"} <= scraped["rollout-router"]
    assert {"miles_trainer_loss", "miles_trainer_step_phase_duration_seconds_sum"} <= scraped["trainer"]
    assert "miles_buffer_pulled_group_staleness_steps_bucket" in scraped["buffer"]
    assert "sglang:cache_hit_rate" in scraped["engine"]


@pytest.mark.integration
def test_dashboards_and_alerts_query_only_exported_metrics(render: Renderer, exported: frozenset[str]) -> None:
    objects = render(["ci-values.yaml"])
    queries = shipped_queries(objects)
    dashboards = [o for o in by_kind(objects, "ConfigMap") if o["metadata"]["name"].startswith("miles-dashboard-")]
    assert {o["metadata"]["name"] for o in dashboards} == {
        "miles-dashboard-rollout",
        "miles-dashboard-training",
        "miles-dashboard-async-health",
    }
    assert len(queries) > 100
    assert unexported(queries, exported) == []


@pytest.mark.integration
def test_a_dashboard_querying_an_unexported_metric_fails(
    tmp_path: Path, chart_dir: Path, exported: frozenset[str]
) -> None:
    """A copy of the chart whose Training dashboard gains a panel on a misspelt metric, and whose alerts are
    checked with one misspelt rule, is refused by the same check, naming the panel and the metric."""
    chart_copy = tmp_path / "miles"
    shutil.copytree(chart_dir, chart_copy, ignore=shutil.ignore_patterns("tests", "__pycache__"))
    dashboard_path = chart_copy / "dashboards" / "training.json"
    dashboard = json.loads(dashboard_path.read_text())
    bad_panel = copy.deepcopy(dashboard["panels"][-1])
    bad_panel.update(id=999, title="Typo")
    bad_panel["targets"] = [{"refId": "A", "expr": 'max by (job_id) (miles_trainer_rewards_mean{job_id=~"$job"})'}]
    dashboard["panels"].append(bad_panel)
    dashboard_path.write_text(json.dumps(dashboard))
    result = run_helm(
        chart_dir.parents[1], "template", "miles", str(chart_copy), "-f", str(chart_dir / "ci" / "ci-values.yaml")
    )
    assert result.returncode == 0, result.stderr
    objects = [document for document in yaml.safe_load_all(result.stdout) if document]
    (rules,) = by_kind(objects, "PrometheusRule")
    rules["spec"]["groups"][0]["rules"].append(
        {"alert": "Typo", "expr": "sum(rate(miles_buffer_pushed_total[5m])) > 0"}
    )
    assert unexported(shipped_queries(objects), exported) == [
        "miles / Training / Typo / A: miles_trainer_rewards_mean",
        "PrometheusRule miles.async / Typo: miles_buffer_pushed_total",
    ]


@pytest.mark.integration  # helm
def test_the_cpu_engine_exports_every_sglang_name_the_dashboards_query(render: Renderer) -> None:
    """Dashboards read SGLang's names; the CPU engine exports the same ones, so the GPU-less demo fills them."""
    queried = {name for _, expr in shipped_queries(render(["ci-values.yaml"])) for name in metric_names(expr)}
    sglang_queried = {name for name in queried if name.startswith("sglang:")}
    assert sglang_queried
    assert sglang_queried <= scraped_names(scrape_in_process("engine"))


def test_training_dashboard_shows_reward_per_role_from_the_trainers_gauges() -> None:
    """Multi-agent episodes: the Training dashboard's "Reward per role" panel reads the trainer's per-role gauges,
    split by their `role` label, and the trainer exports them (in process: no helm, no processes)."""
    dashboard = json.loads((SERVICES_DIR.parent / "helm" / "miles" / "dashboards" / "training.json").read_text())
    panel = next(panel for panel in _panels(dashboard["panels"]) if panel.get("title") == "Reward per role")
    expressions = [target["expr"] for target in panel["targets"]]
    queried = {name for expr in expressions for name in metric_names(expr)}
    assert queried == {"miles_trainer_role_reward_mean", "miles_trainer_role_reward_std"}
    assert queried <= scraped_names(scrape_in_process("trainer"))
    assert all(re.search(r"\bby \(job_id, role\)", expr) for expr in expressions)
