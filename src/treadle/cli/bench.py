"""`treadle bench serve`: load an OpenAI-compatible completions server with random token-id
prompts and report throughput and latency the way `vllm bench serve` does.

The pure parts (`random_prompts`, `arrival_gaps`, `compute_metrics`, `format_table`) take and
return plain values so they can be tested without a server; `run_benchmark` is the only part that
talks HTTP (aiohttp, one streamed request per prompt)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Token ids drawn for prompts: inside every common vocabulary and clear of the special tokens
# at the bottom of it, so the benchmark needs no tokenizer.
PROMPT_TOKEN_RANGE = (1000, 20000)


@dataclass(slots=True)
class RequestResult:
    """One benchmark request. Times are in seconds from the moment the request was sent."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0  # until the first chunk with non-empty text
    itl: list[float] = field(default_factory=list)  # between successive non-empty text chunks
    latency: float = 0.0  # until the end of the stream
    error: str = ""


def random_prompts(num: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = PROMPT_TOKEN_RANGE
    return [[rng.randrange(lo, hi) for _ in range(input_len)] for _ in range(num)]


def arrival_gaps(num: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before sending each request: all 0 for an infinite rate, else Poisson
    arrivals (exponential gaps) with mean rate `request_rate` per second."""
    if math.isinf(request_rate):
        return [0.0] * num
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {request_rate}")
    rng = random.Random(seed)
    return [rng.expovariate(request_rate) for _ in range(num)]


def _stats_ms(values: list[float]) -> tuple[float, float, float]:
    """(mean, median, p99) in ms; zeros for no values, as vLLM reports them."""
    if not values:
        return 0.0, 0.0, 0.0
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    return float(arr.mean()), float(np.median(arr)), float(np.percentile(arr, 99))


def compute_metrics(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """vLLM's serving metrics from per-request records. Token totals, throughputs and latencies
    count successful requests only; TPOT = (e2e - ttft) / (output_tokens - 1) over requests with
    more than one output token; ITL pools the gaps of all requests."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    per_second = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": per_second(len(ok)),
        "output_throughput": per_second(total_output),
        "total_token_throughput": per_second(total_input + total_output),
    }
    for name, values in (
        ("ttft", [r.ttft for r in ok]),
        ("tpot", tpots),
        ("itl", [gap for r in ok for gap in r.itl]),
        ("e2el", [r.latency for r in ok]),
    ):
        mean, median, p99 = _stats_ms(values)
        metrics[f"mean_{name}_ms"] = mean
        metrics[f"median_{name}_ms"] = median
        metrics[f"p99_{name}_ms"] = p99
    metrics["first_error"] = failed[0].error if failed else None
    return metrics


_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def format_table(metrics: dict[str, Any], max_concurrency: int | None = None) -> str:
    """The result table, laid out as `vllm bench serve` prints it."""
    lines = [f"{' Serving Benchmark Result ':=^50}"]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40} {f'{value:.2f}' if isinstance(value, float) else value:<10}")

    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    row("Benchmark duration (s):", float(metrics["duration"]))
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", float(metrics["request_throughput"]))
    row("Output token throughput (tok/s):", float(metrics["output_throughput"]))
    row("Total token throughput (tok/s):", float(metrics["total_token_throughput"]))
    for key, short, title in _SECTIONS:
        lines.append(f"{title:-^50}")
        row(f"Mean {short} (ms):", float(metrics[f"mean_{key}_ms"]))
        row(f"Median {short} (ms):", float(metrics[f"median_{key}_ms"]))
        row(f"P99 {short} (ms):", float(metrics[f"p99_{key}_ms"]))
    lines.append("=" * 50)
    if metrics.get("first_error"):
        lines.append(f"First error: {metrics['first_error']}")
    return "\n".join(lines)


# -- HTTP ------------------------------------------------------------------------------------------


async def _send(
    session: Any, url: str, body: dict[str, Any], headers: dict[str, str], prompt_len: int
) -> RequestResult:
    """Send one streamed completion request; never raises (a failure is recorded instead)."""
    result = RequestResult(prompt_len=prompt_len)
    chunks, usage_tokens = 0, None
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    err = data["error"]
                    result.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    return result
                if data.get("usage"):
                    usage_tokens = data["usage"].get("completion_tokens")
                choices = data.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
        result.latency = time.perf_counter() - start
        if chunks == 0:
            result.ttft = result.latency
        result.output_tokens = usage_tokens if usage_tokens is not None else chunks
        result.success = True
    except Exception as e:  # whatever goes wrong is this request's failure, not the run's
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_benchmark(
    base_url: str,
    model: str,
    prompts: list[list[int]],
    output_len: int,
    *,
    endpoint: str = "/v1/completions",
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    ignore_eos: bool = False,
    seed: int = 0,
    disable_tqdm: bool = False,
    api_key: str | None = None,
    fresh_connections: bool = False,
) -> tuple[list[RequestResult], float]:
    """Send every prompt as a streamed completion; returns the records (in prompt order) and the
    wall time in seconds from the first send to the last finish. `fresh_connections`: one
    connection per request, for servers that close kept-alive ones after a few requests
    (llama.cpp's llama-server)."""
    import aiohttp
    from tqdm import tqdm

    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=fresh_connections)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    bar = tqdm(total=len(prompts), disable=disable_tqdm, desc="Requests")

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> RequestResult:
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if ignore_eos:
            body["ignore_eos"] = True
        async with semaphore or contextlib.nullcontext():
            result = await _send(session, url, body, headers, len(prompt))
        bar.update(1)
        return result

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(
            prompts, arrival_gaps(len(prompts), request_rate, seed), strict=True
        ):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(session, prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def first_model_id(base_url: str, api_key: str | None = None) -> str:
    """The first model id the server lists at /v1/models."""
    import urllib.request

    req = urllib.request.Request(base_url.rstrip("/") + "/v1/models")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return str(json.load(resp)["data"][0]["id"])


# -- CLI -------------------------------------------------------------------------------------------


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    p = kinds.add_parser(
        "serve",
        help="load a running OpenAI-compatible server and report throughput and latency",
        description="Stream random token-id prompts to a completions endpoint and report "
        "throughput and TTFT / TPOT / ITL / E2EL as `vllm bench serve` does. Exits 1 when no "
        "request succeeded.",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="completions endpoint path (default /v1/completions)",
    )
    p.add_argument("--num-prompts", type=int, default=100, help="number of requests (default 100)")
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight (default: all)"
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="mean requests per second, Poisson arrivals (default inf: all at once)",
    )
    p.add_argument(
        "--random-input-len", type=int, default=128, help="prompt tokens per request (default 128)"
    )
    p.add_argument(
        "--random-output-len", type=int, default=128, help="max_tokens per request (default 128)"
    )
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: always full length")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the prompts and arrival times (default 0)"
    )
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    p.add_argument("--result-file", default=None, help="write the results here as JSON")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=bench_serve)


def bench_serve(args: argparse.Namespace) -> int:
    if args.endpoint.rstrip("/").endswith("chat/completions"):
        print(
            "treadle bench serve: error: token-id prompts need a completions endpoint",
            file=sys.stderr,
        )
        return 2
    try:
        model = args.model or first_model_id(args.base_url, args.api_key)
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(
            f"treadle bench serve: error: cannot list models at {args.base_url}: {e}",
            file=sys.stderr,
        )
        return 2
    prompts = random_prompts(args.num_prompts, args.random_input_len, args.seed)
    print(
        f"Model {model}, {args.num_prompts} requests of {args.random_input_len} in / "
        f"{args.random_output_len} out, request rate {args.request_rate}, "
        f"max concurrency {args.max_concurrency}"
    )
    results, duration = asyncio.run(
        run_benchmark(
            args.base_url,
            model,
            prompts,
            args.random_output_len,
            endpoint=args.endpoint,
            max_concurrency=args.max_concurrency,
            request_rate=args.request_rate,
            ignore_eos=args.ignore_eos,
            seed=args.seed,
            disable_tqdm=args.disable_tqdm,
            api_key=args.api_key,
        )
    )
    metrics = compute_metrics(results, duration)
    print(format_table(metrics, args.max_concurrency))
    if args.result_file:
        keys = "base_url endpoint num_prompts max_concurrency random_input_len random_output_len"
        config = {key: getattr(args, key) for key in (*keys.split(), "ignore_eos", "seed")}
        # JSON has no infinity; vLLM writes the rate as the string "inf" too.
        rate = args.request_rate
        config["request_rate"] = "inf" if math.isinf(rate) else rate
        per_request = {
            "input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_tokens for r in results],
            "ttfts": [r.ttft for r in results],
            "itls": [r.itl for r in results],
            "errors": [r.error for r in results],
        }
        with open(args.result_file, "w") as f:
            json.dump({"model": model, **config, **metrics, **per_request}, f, indent=2)
    return 0 if metrics["completed"] else 1
