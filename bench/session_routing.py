"""make bench-session_routing: what routing replay (R3) costs a session: bytes per 1K tokens, and turn latency of
turn 1 against turn N of a growing session with routing recorded and without, side by side.

Bytes: computed from the packing the samples carry (`miles.common.contracts.routing.pack`: one row per token
position, MoE layers x top_k ids in the narrowest width the expert count allows) for the tiny MoE model (4 layers,
top-2 of 8) and a Qwen3-30B-A3B-like shape (48 layers, top-8 of 128), next to SGLang's wire form (base64 of int32).

Latency: a real `miles-session-server` (Redis store, real Qwen3 tokenizer) in front of a zero-latency engine (a
subprocess of this script answering /generate at once with a fixed 4-token completion and, when asked, the routed
experts of the rows asked for, in SGLang's exact shape) serving the 48-layer top-8 shape. Two jobs on the same
model directory: `record_routing` true and false. Each round plays one TURNS-turn episode per job (alternating, so
machine noise hits both alike); each turn appends a ~USER_TOKENS-token user message, so the context grows to
~TURNS x (USER_TOKENS + 10) tokens. Medians over the rounds of turn 1 and turn TURNS are printed and written to
bench/results/session_routing.json, with the server's own commit-phase means and the samples call of each episode.
Flat means: a turn writes only its new rows (appended beside its record, never the whole routing), so turn N costs
what turn 1 costs whatever the session's length; the token buffer itself is still O(context) per turn (as without
routing).
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

import httpx

from miles.common.contracts.routing import RoutingShape, pack
from miles.common.testing import RedisServer, ServiceProcess, free_port
from miles.common.testing.machine import describe_machine
from miles.common.testing.smoke import console_script

TURNS = 30
ROUNDS = 5
USER_TOKENS = 150
COMPLETION_IDS = [2009, 2814, 13, 151645]
"""The zero-latency engine's answer: " All done." + <|im_end|> in the Qwen3 vocabulary."""
OPERATOR_TOKEN = "bench-" + "t" * 40
RESULTS = Path(__file__).resolve().parent / "results" / "session_routing.json"
SHAPES = {
    "tiny_moe": RoutingShape(num_layers=4, top_k=2, num_experts=8),
    "48_layers_top8_of_128": RoutingShape(num_layers=48, top_k=8, num_experts=128),
}
SERVED = SHAPES["48_layers_top8_of_128"]
_SENTENCE = "Step {i} of the build failed: check the cache key, the lock file and the worker logs again. "


def routing_bytes_per_1k_tokens() -> dict[str, dict[str, int]]:
    """Stored (packed) and SGLang wire (base64 int32) bytes of 1000 token positions, per shape."""
    table = {}
    for name, shape in SHAPES.items():
        ids = [index % shape.num_experts for index in range(1000 * shape.row_width)]
        wire = base64.b64encode(array("i", ids).tobytes())
        table[name] = {
            "stored_bytes": len(pack(ids, shape).data),
            "sglang_wire_bytes": len(wire),
            "ids_per_token": shape.row_width,
        }
    return table


def _model_dir(scratch: Path) -> Path:
    """The real Qwen3 tokenizer (with its chat template) and a qwen3_moe config.json of the served shape."""
    from miles.session.tito.assets import bundled_tokenizer_dir

    folder = scratch / "qwen3-moe"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(bundled_tokenizer_dir("qwen3") / name, folder / name)
    config = {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "eos_token_id": 151645,
        "num_hidden_layers": SERVED.num_layers,
        "num_experts": SERVED.num_experts,
        "num_experts_per_tok": SERVED.top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _serve_engine(port: int) -> None:
    """The zero-latency /generate (with /readyz): routing rows [start, seqlen - 1) when asked, made-up ids."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    row = array("i", [(7 * k) % SERVED.num_experts for k in range(SERVED.row_width)]).tobytes()

    async def generate(request: Request) -> Response:
        body = json.loads(await request.body())
        num_prompt = len(body["input_ids"])
        meta: dict[str, Any] = {
            "id": "bench",
            "finish_reason": {"type": "stop", "matched": COMPLETION_IDS[-1]},
            "weight_version": "1",
            "prompt_tokens": num_prompt,
            "cached_tokens": num_prompt - 1,
            "completion_tokens": len(COMPLETION_IDS),
            "output_token_logprobs": [[-0.5, token, None] for token in COMPLETION_IDS],
        }
        if body.get("return_routed_experts"):
            num_rows = num_prompt + len(COMPLETION_IDS) - 1 - int(body.get("routed_experts_start_len", 0))
            meta["routed_experts"] = base64.b64encode(row * num_rows).decode()
        return JSONResponse({"text": " All done.", "output_ids": COMPLETION_IDS, "meta_info": meta})

    async def ready(_: Request) -> Response:
        return JSONResponse({"status": "ready"})

    routes = [Route("/generate", generate, methods=["POST"]), Route("/readyz", ready)]
    uvicorn.run(Starlette(routes=routes), host="127.0.0.1", port=port, log_level="warning")


def _episode(client: httpx.Client, job_id: str) -> tuple[list[float], float, int]:
    """(seconds per turn, seconds of the samples call, routing bytes of the merged sample) of one episode."""
    op = {"authorization": f"Bearer {OPERATOR_TOKEN}"}
    created = client.post("/v1/sessions", json={"job_id": job_id}, headers=op).json()
    sid, auth = created["session_id"], {"authorization": f"Bearer {created['token']}"}
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a build assistant."}]
    seconds = []
    sentences_per_turn = max(1, USER_TOKENS // 20)
    for turn in range(TURNS):
        text = "".join(_SENTENCE.format(i=turn * sentences_per_turn + k) for k in range(sentences_per_turn))
        history.append({"role": "user", "content": text})
        body = {"messages": history, "max_tokens": 16, "temperature": 0}
        started = time.perf_counter()
        response = client.post(f"/v1/sessions/{sid}/v1/chat/completions", json=body, headers=auth)
        seconds.append(time.perf_counter() - started)
        response.raise_for_status()
        history.append(response.json()["choices"][0]["message"])
    started = time.perf_counter()
    reply = client.post(f"/v1/sessions/{sid}/samples", json={"mode": "merge"}, headers=auth)
    samples_s = time.perf_counter() - started
    reply.raise_for_status()
    (sample,) = reply.json()["samples"]
    routed = sample.get("rollout_routed_experts", {}).get("data", "")
    client.delete(f"/v1/sessions/{sid}", headers=auth)
    return seconds, samples_s, len(base64.b64decode(routed))


def _commit_means_ms(metrics: str) -> float:
    sums = counts = 0.0
    for line in metrics.splitlines():
        if line.startswith('miles_session_turn_phase_duration_seconds_sum{phase="commit"}'):
            sums = float(line.rsplit(" ", 1)[1])
        if line.startswith('miles_session_turn_phase_duration_seconds_count{phase="commit"}'):
            counts = float(line.rsplit(" ", 1)[1])
    return round(1e3 * sums / counts, 3) if counts else 0.0


def _measure(client: httpx.Client) -> dict[str, Any]:
    """Rounds of one episode per job, alternating; medians per job."""
    turns: dict[str, list[list[float]]] = {"on": [], "off": []}
    samples_ms: dict[str, list[float]] = {"on": [], "off": []}
    routing_bytes = 0
    for mode in ("on", "off"):
        _episode(client, f"bench-{mode}")  # warm-up
    for _ in range(ROUNDS):
        for mode in ("on", "off"):
            seconds, samples_s, num_bytes = _episode(client, f"bench-{mode}")
            turns[mode].append(seconds)
            samples_ms[mode].append(samples_s * 1e3)
            routing_bytes = max(routing_bytes, num_bytes)
    result: dict[str, Any] = {}
    for mode in ("on", "off"):
        first = statistics.median(s[0] for s in turns[mode]) * 1e3
        last = statistics.median(s[-1] for s in turns[mode]) * 1e3
        result[f"routing_{mode}"] = {
            "turn_1_ms": round(first, 3),
            f"turn_{TURNS}_ms": round(last, 3),
            "turn_n_over_turn_1": round(last / first, 3),
            "samples_call_ms": round(statistics.median(samples_ms[mode]), 3),
        }
    result["merged_sample_routing_bytes"] = routing_bytes
    return result


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="bench-session-routing-"))
    model_dir = _model_dir(scratch)
    redis_server = RedisServer(scratch / "redis", free_port())
    redis_server.start()
    engine_port, session_port = free_port(), free_port()
    engine_url, session_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{session_port}"
    session_env = {
        "MILES_SESSION_PORT": str(session_port),
        "MILES_SESSION_REDIS_URL": redis_server.url,
        "MILES_SESSION_UPSTREAM_URL": engine_url,
        "MILES_SESSION_OPERATOR_TOKEN": OPERATOR_TOKEN,
        "MILES_SESSION_LOG_LEVEL": "WARNING",
    }
    op = {"authorization": f"Bearer {OPERATOR_TOKEN}"}
    try:
        with (
            ServiceProcess(
                [sys.executable, __file__, "--serve-engine", str(engine_port)],
                ready_url=f"{engine_url}/readyz",
                log_path=scratch / "e.log",
            ),
            ServiceProcess(
                [console_script("miles-session-server")],
                ready_url=f"{session_url}/readyz",
                env=session_env,
                log_path=scratch / "s.log",
            ),
            httpx.Client(base_url=session_url, timeout=120) as client,
        ):
            for mode, record in (("on", True), ("off", False)):
                config = {"model_path": str(model_dir), "model_family": "qwen3", "record_routing": record}
                client.put(f"/v1/jobs/bench-{mode}/config", json=config, headers=op).raise_for_status()
            latency = _measure(client)
            latency["commit_phase_mean_ms_both_jobs"] = _commit_means_ms(client.get("/metrics").text)
    finally:
        redis_server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    sizes = routing_bytes_per_1k_tokens()
    result = {
        "routing_bytes_per_1k_tokens": sizes,
        "turn_latency": latency,
        "served_shape": {"num_layers": SERVED.num_layers, "top_k": SERVED.top_k, "num_experts": SERVED.num_experts},
        "turns": TURNS,
        "rounds": ROUNDS,
        "user_tokens_per_turn": USER_TOKENS,
        "machine": describe_machine(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for name, size in sizes.items():
        stored, wire = size["stored_bytes"], size["sglang_wire_bytes"]
        print(f"routing {name}: {stored} bytes stored per 1K tokens ({wire} on the wire)")
    on, off = latency["routing_on"], latency["routing_off"]
    for mode, values in (("on", on), ("off", off)):
        print(f"routing {mode}: {values}")
    print(f"routing_turn_{TURNS}_over_turn_1 on={on['turn_n_over_turn_1']} off={off['turn_n_over_turn_1']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve-engine", type=int, metavar="PORT", help="internal: the zero-latency engine")
    args = parser.parse_args()
    if args.serve_engine:
        _serve_engine(args.serve_engine)
    else:
        main()
