"""Data parallelism and several API servers, on a tiny random model (the front end is what is
measured, not the model), in one run:

- front-end throughput: 1-token completions at high concurrency, `--api-server-count 1` vs 2
  (one engine core), requests/s for both and their ratio;
- load balance: `-dp 2` under prompts of skewed lengths (most short, a few long); per engine
  the requests, prompt tokens and generated tokens it served (from /metrics), and max/min.

On a 2-core machine the engine, the API servers and this client share the cores: read the
ratios, not the absolute figures.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from serve_bench import Server  # noqa: E402
from treadle.cli.bench_client import first_model_id, run_benchmark  # noqa: E402
from treadle.cli.bench_metrics import compute_metrics  # noqa: E402

FRONT_END_REQUESTS, FRONT_END_CONCURRENCY = 600, 64
LB_REQUESTS, LB_CONCURRENCY, LB_OUTPUT = 160, 32, 16


def serve(tmp: Path, name: str, args: list[str]) -> Server:
    server = Server(tmp / f"{name}.log", args)
    try:
        server.wait_healthy()
    except BaseException:
        print(server.output()[-4000:], file=sys.stderr)
        server.stop()
        raise
    return server


def front_end_rate(model_path: str, api_servers: int, tmp: Path) -> float:
    server = serve(tmp, f"asc{api_servers}", [model_path, "--api-server-count", str(api_servers)])
    try:
        model = first_model_id(server.url)
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 1000) for _ in range(32)] for _ in range(FRONT_END_REQUESTS)]
        warm = prompts[:FRONT_END_CONCURRENCY]
        asyncio.run(run_benchmark(server.url, model, warm, 1, disable_tqdm=True))
        records, duration = asyncio.run(
            run_benchmark(
                server.url,
                model,
                prompts,
                1,
                max_concurrency=FRONT_END_CONCURRENCY,
                ignore_eos=True,
                disable_tqdm=True,
            )
        )
        metrics = compute_metrics(records, duration)
        assert metrics["completed"] == FRONT_END_REQUESTS, metrics
        return float(metrics["request_throughput"])
    finally:
        server.stop()


def engine_counters(url: str) -> dict[str, dict[str, float]]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, dict[str, float]] = {}
    for name in ("request_success_total", "prompt_tokens_total", "generation_tokens_total"):
        for m in re.finditer(rf"treadle:{name}\{{([^}}]*)\}} ([\d.e+]+)", text):
            engine = re.search(r'engine="(\d+)"', m.group(1))
            if engine:
                per = out.setdefault(engine.group(1), {})
                per[name] = per.get(name, 0.0) + float(m.group(2))
    return out


def load_balance(model_path: str, tmp: Path) -> dict[str, Any]:
    server = serve(tmp, "dp2", [model_path, "-dp", "2"])
    try:
        model = first_model_id(server.url)
        rng = random.Random(1)
        # Skewed: 80% of prompts 8-32 tokens, 20% 200-400 tokens, in random order.
        lengths = [
            rng.randint(200, 400) if rng.random() < 0.2 else rng.randint(8, 32)
            for _ in range(LB_REQUESTS)
        ]
        prompts = [[rng.randrange(100, 1000) for _ in range(n)] for n in lengths]
        records, duration = asyncio.run(
            run_benchmark(
                server.url,
                model,
                prompts,
                LB_OUTPUT,
                max_concurrency=LB_CONCURRENCY,
                ignore_eos=True,
                disable_tqdm=True,
            )
        )
        assert all(r.success for r in records)
        return engine_counters(server.url)
    finally:
        server.stop()


def main() -> int:
    from conftest import build_tiny_model

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with tempfile.TemporaryDirectory(prefix="treadle-dp-bench-") as tmp_name:
        tmp = Path(tmp_name)
        model_path = str(build_tiny_model(tmp / "tiny", "llama"))
        print(
            f"front end: {FRONT_END_REQUESTS} completions of 32 tokens in / 1 out, "
            f"concurrency {FRONT_END_CONCURRENCY}, one engine core"
        )
        rates = {n: front_end_rate(model_path, n, tmp) for n in (1, 2)}
        for n, rate in rates.items():
            print(f"  --api-server-count {n}: {rate:8.1f} req/s")
        print(f"  ratio 2 / 1: {rates[2] / rates[1]:.2f}")

        print(
            f"\nload balance: -dp 2, {LB_REQUESTS} requests (80% 8-32 tokens, 20% 200-400), "
            f"{LB_OUTPUT} out, concurrency {LB_CONCURRENCY}"
        )
        per_engine = load_balance(model_path, tmp)
        for name, label in (
            ("request_success_total", "requests"),
            ("prompt_tokens_total", "prompt tokens"),
            ("generation_tokens_total", "generated tokens"),
        ):
            values = [per_engine.get(e, {}).get(name, 0.0) for e in ("0", "1")]
            ratio = max(values) / min(values) if min(values) else float("inf")
            print(
                f"  {label:18s} engine 0 {values[0]:8.0f}  engine 1 {values[1]:8.0f}  "
                f"max/min {ratio:.2f}"
            )
        work = [
            per_engine.get(e, {}).get("prompt_tokens_total", 0.0)
            + per_engine.get(e, {}).get("generation_tokens_total", 0.0)
            for e in ("0", "1")
        ]
        print(
            f"  {'all tokens (load)':18s} engine 0 {work[0]:8.0f}  engine 1 {work[1]:8.0f}  "
            f"max/min {max(work) / max(min(work), 1.0):.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
