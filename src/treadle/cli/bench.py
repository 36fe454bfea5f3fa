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
import os
import random
import sys
import time
from collections.abc import Callable
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


def random_lengths(num: int, length: int, range_ratio: float, seed: int) -> list[int]:
    """vLLM's `--random-range-ratio`: lengths drawn uniformly from
    [length x (1 - ratio), length x (1 + ratio)] (at least 1); all `length` for 0."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    lo, hi = max(1, math.floor(length * (1 - range_ratio))), math.ceil(length * (1 + range_ratio))
    return [rng.randint(lo, hi) for _ in range(num)]


def arrival_gaps(num: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before sending each request: all 0 for an infinite rate, else Poisson
    arrivals (exponential gaps) with mean rate `request_rate` per second."""
    if math.isinf(request_rate):
        return [0.0] * num
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {request_rate}")
    rng = random.Random(seed)
    return [rng.expovariate(request_rate) for _ in range(num)]


def _stats_ms(
    values: list[float], percentiles: tuple[float, ...] = (99,)
) -> tuple[float, float, float, dict[str, float]]:
    """(mean, median, std, {"p99": ...}) in ms; zeros for no values, as vLLM reports them."""
    names = [f"p{p:g}" for p in percentiles]
    if not values:
        return 0.0, 0.0, 0.0, dict.fromkeys(names, 0.0)
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    found = {name: float(np.percentile(arr, p)) for name, p in zip(names, percentiles, strict=True)}
    return float(arr.mean()), float(np.median(arr)), float(arr.std()), found


def compute_metrics(
    results: list[RequestResult],
    duration: float,
    percentiles: tuple[float, ...] = (99,),
) -> dict[str, Any]:
    """vLLM's serving metrics from per-request records. Token totals, throughputs and latencies
    count successful requests only; TPOT = (e2e - ttft) / (output_tokens - 1) over requests with
    more than one output token; ITL pools the gaps of all requests. `percentiles`
    (`--metric-percentiles`): `p{N}_{metric}_ms` keys, p99 always."""
    percentiles = tuple(sorted({*percentiles, 99}))
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
        mean, median, std, found = _stats_ms(values, percentiles)
        metrics[f"mean_{name}_ms"] = mean
        metrics[f"median_{name}_ms"] = median
        metrics[f"std_{name}_ms"] = std
        for p, value in found.items():
            metrics[f"{p}_{name}_ms"] = value
    metrics["first_error"] = failed[0].error if failed else None
    return metrics


_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def format_table(
    metrics: dict[str, Any],
    max_concurrency: int | None = None,
    shown: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el"),
    percentiles: tuple[float, ...] = (99,),
) -> str:
    """The result table, laid out as `vllm bench serve` prints it; `shown`
    (`--percentile-metrics`) and `percentiles` (`--metric-percentiles`) pick the latency rows."""
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
        if key not in shown:
            continue
        lines.append(f"{title:-^50}")
        row(f"Mean {short} (ms):", float(metrics[f"mean_{key}_ms"]))
        row(f"Median {short} (ms):", float(metrics[f"median_{key}_ms"]))
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", float(metrics[f"p{p:g}_{key}_ms"]))
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
                text = (
                    choices[0].get("text") or (choices[0].get("delta") or {}).get("content")
                    if choices
                    else None
                )
                if text:
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
    prompts: list[list[int]] | list[str],
    output_len: int | list[int],
    *,
    endpoint: str = "/v1/completions",
    chat: bool = False,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    ignore_eos: bool = False,
    seed: int = 0,
    disable_tqdm: bool = False,
    api_key: str | None = None,
    fresh_connections: bool = False,
    prompt_lens: list[int] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every prompt as a streamed completion; returns the records (in prompt order) and the
    wall time in seconds from the first send to the last finish. `output_len`: max_tokens
    of every request, or of each; `chat`: prompts are texts sent as one user message to a chat
    completions endpoint (vLLM's openai-chat backend). `fresh_connections`: one
    connection per request, for servers that close kept-alive ones after a few requests
    (llama.cpp's llama-server). `prompt_lens`: the prompts' token counts when they are texts."""
    import aiohttp
    from tqdm import tqdm

    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=fresh_connections)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    bar = tqdm(total=len(prompts), disable=disable_tqdm, desc="Requests")

    lens = output_len if isinstance(output_len, list) else [output_len] * len(prompts)

    async def one(
        session: aiohttp.ClientSession, prompt: list[int] | str, max_tokens: int, prompt_len: int
    ) -> RequestResult:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if ignore_eos:
            body["ignore_eos"] = True
        async with semaphore or contextlib.nullcontext():
            result = await _send(session, url, body, headers, prompt_len)
        bar.update(1)
        return result

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens, prompt_len, gap in zip(
            list[Any](prompts),
            lens,
            prompt_lens or [len(p) for p in prompts],
            arrival_gaps(len(prompts), request_rate, seed),
            strict=True,
        ):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(session, prompt, max_tokens, prompt_len)))
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


BACKENDS = {  # vLLM's --backend names: the endpoint each one streams from
    "vllm": "/v1/completions",
    "openai": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    p = kinds.add_parser(
        "serve",
        help="load a running OpenAI-compatible server and report throughput and latency",
        description="Stream random token-id prompts to a completions endpoint (or their text to "
        "a chat endpoint) and report throughput and TTFT / TPOT / ITL / E2EL as `vllm bench "
        "serve` does, with its flag names. Exits 1 when no request succeeded.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--backend",
        default="vllm",
        choices=sorted(BACKENDS),
        help="vllm and openai: /v1/completions with token-id prompts; openai-chat: "
        "/v1/chat/completions with the prompts' text (from the server's /detokenize)",
    )
    p.add_argument("--base-url", default=None, help="server address (default from --host/--port)")
    p.add_argument("--host", default="127.0.0.1", help="server host (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="server port (default 8000)")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument(
        "--endpoint", default=None, help="endpoint path (default: the backend's, see --backend)"
    )
    p.add_argument(
        "--dataset-name",
        default="random",
        choices=["random"],
        help="random: random token ids of --random-input-len (the only dataset so far)",
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
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="draw each length uniformly from [len x (1 - r), len x (1 + r)] (default 0)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: always full length")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the prompts and arrival times (default 0)"
    )
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    p.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help="comma-separated metrics whose percentiles are printed, of ttft, tpot, itl, e2el "
        "(default ttft,tpot,itl, as vLLM's)",
    )
    p.add_argument(
        "--metric-percentiles",
        default="99",
        help="comma-separated percentiles to report, e.g. 50,90,99 (default 99)",
    )
    p.add_argument("--save-result", action="store_true", help="write the results as JSON")
    p.add_argument(
        "--result-dir", default=None, help="directory of --save-result's file (default: .)"
    )
    p.add_argument(
        "--result-filename",
        default=None,
        help="file name of --save-result (default: BACKEND-RATEqps-concurrencyN-MODEL-DATE.json)",
    )
    p.add_argument("--result-file", default=None, help="write the results to this JSON file")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=bench_serve)


def _detokenize(base_url: str, prompts: list[list[int]], api_key: str | None) -> list[str]:
    """The text of token-id prompts, from the server's /detokenize (vLLM's and treadle's)."""
    import urllib.request

    texts = []
    for ids in prompts:
        req = urllib.request.Request(
            base_url.rstrip("/") + "/detokenize",
            data=json.dumps({"tokens": ids}).encode(),
            headers={"Content-Type": "application/json"},
        )
        if api_key:
            req.add_header("Authorization", f"Bearer {api_key}")
        with urllib.request.urlopen(req, timeout=30) as resp:
            texts.append(str(json.load(resp)["prompt"]))
    return texts


def _result_path(args: argparse.Namespace, model: str) -> str | None:
    if args.result_file:
        return str(args.result_file)
    if not args.save_result:
        return None
    name = args.result_filename
    if name is None:
        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        date = time.strftime("%Y%m%d-%H%M%S")
        name = f"{args.backend}-{rate}qps{concurrency}-{model.split('/')[-1]}-{date}.json"
    directory = args.result_dir or "."
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, name)


def _csv(text: str, kind: Callable[[str], Any]) -> tuple[Any, ...]:
    return tuple(kind(item.strip()) for item in text.split(",") if item.strip())


def bench_serve(args: argparse.Namespace) -> int:
    def error(message: str) -> int:
        print(f"treadle bench serve: error: {message}", file=sys.stderr)
        return 2

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    endpoint = args.endpoint or BACKENDS[args.backend]
    chat = endpoint.rstrip("/").endswith("chat/completions")
    if chat and args.backend != "openai-chat":
        return error("token-id prompts need a completions endpoint (or --backend openai-chat)")
    try:
        shown = _csv(args.percentile_metrics, str)
        percentiles = _csv(args.metric_percentiles, float)
        unknown = set(shown) - {"ttft", "tpot", "itl", "e2el"}
        if unknown:
            return error(f"--percentile-metrics: unknown {', '.join(sorted(unknown))}")
        input_lens = random_lengths(
            args.num_prompts, args.random_input_len, args.random_range_ratio, args.seed
        )
        output_lens = random_lengths(
            args.num_prompts, args.random_output_len, args.random_range_ratio, args.seed + 1
        )
    except ValueError as e:
        return error(str(e))
    try:
        model = args.model or first_model_id(base_url, args.api_key)
    except (OSError, ValueError, KeyError, IndexError) as e:
        return error(f"cannot list models at {base_url}: {e}")
    longest = max(input_lens, default=0)
    token_prompts = [
        p[:n]
        for p, n in zip(
            random_prompts(args.num_prompts, longest, args.seed), input_lens, strict=True
        )
    ]
    prompts: list[list[int]] | list[str] = token_prompts
    if chat:
        try:
            prompts = _detokenize(base_url, token_prompts, args.api_key)
        except (OSError, ValueError, KeyError) as e:
            return error(f"cannot detokenize the prompts at {base_url}/detokenize: {e}")
    print(
        f"Model {model}, backend {args.backend} ({endpoint}), {args.num_prompts} requests of "
        f"{args.random_input_len} in / {args.random_output_len} out (range ratio "
        f"{args.random_range_ratio}), request rate {args.request_rate}, "
        f"max concurrency {args.max_concurrency}"
    )
    results, duration = asyncio.run(
        run_benchmark(
            base_url,
            model,
            prompts,
            output_lens,
            endpoint=endpoint,
            chat=chat,
            max_concurrency=args.max_concurrency,
            request_rate=args.request_rate,
            ignore_eos=args.ignore_eos,
            seed=args.seed,
            disable_tqdm=args.disable_tqdm,
            api_key=args.api_key,
            prompt_lens=input_lens,
        )
    )
    metrics = compute_metrics(results, duration, percentiles)
    print(format_table(metrics, args.max_concurrency, shown, percentiles))
    path = _result_path(args, model)
    if path:
        # JSON has no infinity; vLLM writes the rate as the string "inf" too.
        rate = args.request_rate
        config = {
            "date": time.strftime("%Y%m%d-%H%M%S"),
            "backend": args.backend,
            "model_id": model,
            "base_url": base_url,
            "endpoint": endpoint,
            "dataset_name": args.dataset_name,
            "num_prompts": args.num_prompts,
            "request_rate": "inf" if math.isinf(rate) else rate,
            "max_concurrency": args.max_concurrency,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "random_range_ratio": args.random_range_ratio,
            "ignore_eos": args.ignore_eos,
            "seed": args.seed,
        }
        per_request = {
            "input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_tokens for r in results],
            "ttfts": [r.ttft for r in results],
            "itls": [r.itl for r in results],
            "errors": [r.error for r in results],
        }
        with open(path, "w") as f:
            json.dump({"model": model, **config, **metrics, **per_request}, f, indent=2)
        print(f"Results written to {path}")
    return 0 if metrics["completed"] else 1
