"""The throughput cost of structured outputs, served: `treadle serve` (default model), JSON-schema
requests beside unconstrained requests of the same lengths, in one run.

For each workload (64 requests at concurrency 16, 128 at concurrency 64; chat prompts, sampled
at temperature 0.7 with a seed per request):
  1. constrained: each request under one of four JSON schemas (`response_format` json_schema);
     their output lengths are recorded (a warm-up run);
  2. plain: the same prompts and seeds without a constraint, each with `max_tokens` = its
     constrained twin's length and `ignore_eos`, so both runs produce the same tokens count;
  3. constrained again; 2 and 3 alternate `--pairs` times (default 3).
Cost = 1 - constrained output tok/s / plain output tok/s of each pair; the median pair is
reported (target: under 10%, issue 13).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")

from serve_bench import Server  # noqa: E402
from treadle.cli.bench_client import first_model_id  # noqa: E402

WORKLOADS = (("c16", 64, 16), ("c64", 128, 64))  # (name, requests, max concurrency)
MAX_TOKENS = 256
_name = {"type": "string", "minLength": 1, "maxLength": 24}
_int = {"type": "integer", "minimum": 0, "maximum": 10000}
SCHEMAS = [
    (
        "Describe three people.",
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": _name, "age": _int, "city": _name},
                "required": ["name", "age", "city"],
            },
            "minItems": 3,
            "maxItems": 3,
        },
    ),
    (
        "Describe a book.",
        {
            "type": "object",
            "properties": {
                "title": _name,
                "author": _name,
                "year": _int,
                "genres": {"type": "array", "items": _name, "maxItems": 4},
            },
            "required": ["title", "author", "year", "genres"],
        },
    ),
    (
        "Plan a trip.",
        {
            "type": "object",
            "properties": {
                "destination": _name,
                "days": _int,
                "stops": {"type": "array", "items": _name, "minItems": 2, "maxItems": 5},
                "budget": {"type": "number"},
            },
            "required": ["destination", "days", "stops", "budget"],
        },
    ),
    (
        "Describe a laptop.",
        {
            "type": "object",
            "properties": {
                "brand": _name,
                "ram_gb": _int,
                "ssd": {"type": "boolean"},
                "color": {"enum": ["black", "silver", "white"]},
                "ports": {"type": "array", "items": _name, "maxItems": 4},
            },
            "required": ["brand", "ram_gb", "ssd", "color", "ports"],
        },
    ),
]


async def run(
    url: str, model: str, bodies: list[dict[str, Any]], concurrency: int
) -> tuple[list[int], float]:
    """Send every body to /v1/chat/completions; (completion tokens per request, wall seconds)."""
    import aiohttp

    semaphore = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)

    async def one(session: aiohttp.ClientSession, body: dict[str, Any]) -> int:
        async with (
            semaphore,
            session.post(url + "/v1/chat/completions", json={"model": model, **body}) as resp,
        ):
            out = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{resp.status}: {out}")
            return int(out["usage"]["completion_tokens"])

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        lengths = await asyncio.gather(*(one(session, b) for b in bodies))
        return list(lengths), time.perf_counter() - start


def bodies(num: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(constrained bodies, their unconstrained twins without max_tokens yet)."""
    constrained, plain = [], []
    for i in range(num):
        prompt, schema = SCHEMAS[i % len(SCHEMAS)]
        common = {
            "messages": [{"role": "user", "content": prompt + " Answer in JSON."}],
            "temperature": 0.7,
            "seed": i,
        }
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": f"s{i % len(SCHEMAS)}", "schema": schema},
        }
        constrained.append({**common, "max_tokens": MAX_TOKENS, "response_format": fmt})
        plain.append({**common, "ignore_eos": True})
    return constrained, plain


def bench(url: str, pairs: int) -> dict[str, dict[str, float]]:
    model = first_model_id(url)
    warm, _ = bodies(len(SCHEMAS))  # compile each schema once; no run pays for it
    asyncio.run(run(url, model, warm, len(SCHEMAS)))
    results = {}
    for name, num, concurrency in WORKLOADS:
        constrained, plain = bodies(num)
        lengths, t_first = asyncio.run(run(url, model, constrained, concurrency))
        for body, n in zip(plain, lengths, strict=True):
            body["max_tokens"] = n
        tokens = sum(lengths)
        # Alternate plain and constrained runs; each pair gives a cost, and the median of
        # the pairs is reported (a single pair varies by several percent on two shared cores).
        costs, constrained_tok_s, plain_tok_s = [], [], []
        for _ in range(pairs):
            plain_lengths, t_plain = asyncio.run(run(url, model, plain, concurrency))
            assert plain_lengths == lengths, "the unconstrained twins must produce as many tokens"
            # A seeded request repeats itself but for float noise between batch shapes, so a
            # constrained run's token count is its own.
            again, t_again = asyncio.run(run(url, model, constrained, concurrency))
            constrained_tok_s.append(sum(again) / t_again)
            plain_tok_s.append(tokens / t_plain)
            costs.append(1 - constrained_tok_s[-1] / plain_tok_s[-1])
        cost = statistics.median(costs)
        results[name] = {
            "requests": num,
            "concurrency": concurrency,
            "output_tokens": tokens,
            "constrained_tok_s": statistics.median(constrained_tok_s),
            "plain_tok_s": statistics.median(plain_tok_s),
            "cost": cost,
            "pair_costs": costs,
        }
        print(
            f"{name}: {num} requests at concurrency {concurrency}, {tokens} output tokens:"
            f" constrained {results[name]['constrained_tok_s']:.1f} tok/s, plain"
            f" {results[name]['plain_tok_s']:.1f} tok/s (medians of {pairs} alternating runs),"
            f" cost {100 * cost:.1f}% (pairs: {', '.join(f'{100 * c:.1f}' for c in costs)};"
            " target < 10%)",
            flush=True,
        )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=3, help="plain/constrained run pairs")
    parser.add_argument("--result-file", default=None, help="write every figure here as JSON")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with tempfile.TemporaryDirectory(prefix="treadle-structured-bench-") as tmp:
        server = Server(Path(tmp) / "server.log", ["--max-model-len", "1024"])
        try:
            server.wait_healthy()
            results = bench(server.url, args.pairs)
        except BaseException:
            print(server.output()[-4000:], file=sys.stderr)
            raise
        finally:
            server.stop()
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
