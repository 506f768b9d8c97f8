"""make bench-engine: is prefix reuse real? Time to first token of a 2,048-token prompt whose first 1,900 tokens
are already in the engine's radix cache, against the same length cold, measured side by side in one run.

Starts a real miles-engine (tiny Qwen3 model, fast path) as a subprocess and talks HTTP to it, so the numbers
include everything a client sees. TTFT is the arrival of the first streamed chunk. Each round uses fresh random
token ids, so the cold prompt shares nothing with the cache and the warm one shares exactly its 1,900-token
prefix (the engine's reported cached_tokens is checked). Prints the medians and their ratio and writes
bench/results/engine.json.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.machine import describe_machine
from miles.common.testing.smoke import console_script

PROMPT_TOKENS = 2048
PREFIX_TOKENS = 1900
ROUNDS = 7
REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "engine.json"


def _model_dir(scratch: Path) -> Path:
    made = REPO / ".miles" / "models" / "tiny-qwen3"
    if (made / "config.json").is_file():
        return made
    from miles.engine.tiny_model import build_tiny_model

    return build_tiny_model(scratch / "tiny-qwen3")


def _ttft(client: httpx.Client, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first streamed chunk, and the cached_tokens the engine reported."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "stream": True}
    started = time.perf_counter()
    first_at = None
    cached = -1
    with client.stream("POST", "/generate", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            first_at = first_at or time.perf_counter()
            cached = json.loads(line[len("data: ") :])["meta_info"]["cached_tokens"]
    assert first_at is not None, "no chunk received"
    return first_at - started, cached


def _random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 150000) for _ in range(n)]


def main() -> None:
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = _model_dir(Path(scratch))
        port = free_port()
        argv = [console_script("miles-engine"), "--model-path", str(model_dir), "--port", str(port)]
        log = Path(scratch) / "engine.log"
        with (
            ServiceProcess(argv, ready_url=f"http://127.0.0.1:{port}/readyz", log_path=log),
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as client,
        ):
            for _ in range(2):  # warm-up: first calls of each kernel shape
                _ttft(client, _random_ids(rng, PROMPT_TOKENS))
            cold, warm, cached_seen = [], [], []
            for _ in range(ROUNDS):
                prefix = _random_ids(rng, PREFIX_TOKENS)
                _ttft(client, prefix + _random_ids(rng, PROMPT_TOKENS - PREFIX_TOKENS))  # puts the prefix in cache
                seconds, cached = _ttft(client, prefix + _random_ids(rng, PROMPT_TOKENS - PREFIX_TOKENS))
                warm.append(seconds)
                cached_seen.append(cached)
                seconds, cached = _ttft(client, _random_ids(rng, PROMPT_TOKENS))
                assert cached == 0, f"a cold prompt found {cached} cached tokens"
                cold.append(seconds)
    assert all(c == PREFIX_TOKENS for c in cached_seen), f"expected {PREFIX_TOKENS} cached tokens, got {cached_seen}"
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    result = {
        "benchmark": "engine prefix reuse: TTFT of a 2048-token prompt, 1900-token cached prefix vs cold",
        "prompt_tokens": PROMPT_TOKENS,
        "cached_prefix_tokens": PREFIX_TOKENS,
        "rounds": ROUNDS,
        "cold_ttft_s": cold,
        "cached_ttft_s": warm,
        "cold_ttft_median_s": cold_s,
        "cached_ttft_median_s": warm_s,
        "cold_over_cached_ratio": cold_s / warm_s,
        "model": "tiny-qwen3 (miles-make-tiny-model, seed 0), fast path",
        "machine": describe_machine(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"TTFT, {PROMPT_TOKENS}-token prompt, median of {ROUNDS} rounds (one run, side by side)")
    print(f"  cold                         {cold_s * 1000:8.1f} ms")
    print(f"  {PREFIX_TOKENS}-token prefix cached    {warm_s * 1000:8.1f} ms")
    print(f"  ratio cold / cached          {cold_s / warm_s:8.2f}x")
    print(f"written to {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
