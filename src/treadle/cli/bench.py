"""`treadle bench serve`: load an OpenAI-compatible server the way `vllm bench serve` does, with
its flag names, printed table and result-JSON keys, and optionally draw an HTML report.

The parts live beside this file: `bench_datasets` (what to send), `bench_client` (sending it),
`bench_metrics` (the numbers), `bench_plot` (the report); this module is the command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from treadle.cli.bench_client import count_tokens, detokenize, first_model_id, run_benchmark
from treadle.cli.bench_datasets import (
    DatasetError,
    SampleRequest,
    load_sharegpt,
    sample_random,
    sample_sharegpt,
)
from treadle.cli.bench_metrics import (
    RequestResult,
    compute_metrics,
    format_table,
    parse_percentile_metrics,
    parse_percentiles,
    summary_rows,
)

BACKENDS = {  # vLLM's --backend names: the endpoint each one streams from by default
    "vllm": "/v1/completions",
    "openai": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}
DATASETS = ("random", "sharegpt")
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "errors")


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    p = kinds.add_parser(
        "serve",
        help="load a running OpenAI-compatible server and report throughput and latency",
        description="Stream prompts to a completions or chat completions endpoint and report "
        "throughput and TTFT / TPOT / ITL / E2EL as `vllm bench serve` does, with its flag "
        "names and result-JSON keys. Exits 1 when no request succeeded, 2 on bad arguments.",
        allow_abbrev=False,
    )
    server = p.add_argument_group("server")
    server.add_argument(
        "--backend",
        default="openai",
        choices=sorted(BACKENDS),
        help="openai (default) and vllm: /v1/completions; openai-chat: /v1/chat/completions, "
        "each prompt's text as one user message",
    )
    server.add_argument("--base-url", default=None, help="server address (default --host/--port)")
    server.add_argument("--host", default="127.0.0.1", help="server host (default 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="server port (default 8000)")
    server.add_argument(
        "--endpoint",
        default=None,
        help="endpoint path (default /v1/completions as vLLM's; /v1/chat/completions with "
        "--backend openai-chat, which vLLM makes you write)",
    )
    server.add_argument("--model", default=None, help="model name (default: the server's first)")
    server.add_argument(
        "--served-model-name",
        default=None,
        help="the name requests send as `model`, as vLLM's (default --model); --model is then "
        "only the result's model_id",
    )
    server.add_argument(
        "--tokenizer",
        default=None,
        help="a local tokenizer (model directory or .gguf file) that counts and decodes the "
        "prompts' tokens, as vLLM's; default: the server's own, through /tokenize and /detokenize",
    )
    server.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")

    data = p.add_argument_group("dataset")
    data.add_argument(
        "--dataset-name",
        default="random",
        metavar="{random,sharegpt}",
        help="random (default): random token ids (their text for openai-chat); sharegpt: the "
        "first human turn of each conversation in --dataset-path",
    )
    data.add_argument(
        "--dataset-path",
        default=None,
        help="a local ShareGPT JSON file (a list of {conversations: [{from: human, value}, "
        "{from: gpt, value}, ...]}); nothing is downloaded",
    )
    data.add_argument("--num-prompts", type=int, default=1000, help="requests (default 1000)")
    data.add_argument(
        "--seed", type=int, default=0, help="seed of prompts, sampling and arrivals (default 0)"
    )
    data.add_argument(
        "--input-len", type=int, default=None, help="sets --random-input-len (vLLM's)"
    )
    data.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="sets --random-output-len and --sharegpt-output-len (vLLM's)",
    )
    data.add_argument(
        "--random-input-len", type=int, default=1024, help="prompt tokens (default 1024)"
    )
    data.add_argument("--random-output-len", type=int, default=128, help="max_tokens (default 128)")
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="draw each length uniformly from [len x (1 - r), len x (1 + r)], r in [0, 1) "
        "(default 0)",
    )
    data.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="max_tokens of every ShareGPT request (default: the token count of the gpt answer)",
    )

    load = p.add_argument_group("load")
    load.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight (default: all)"
    )
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="mean requests per second, Poisson arrivals (default inf: all at once)",
    )
    load.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos: always max_tokens (always on with --dataset-name random, as vLLM)",
    )
    load.add_argument("--disable-tqdm", action="store_true", help="no progress bar")

    out = p.add_argument_group("results")
    out.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help="comma-separated metrics whose rows are printed, of ttft, tpot, itl, e2el "
        "(default ttft,tpot,itl)",
    )
    out.add_argument(
        "--metric-percentiles",
        default="99",
        help="comma-separated percentiles to report, e.g. 25,50,99 (default 99)",
    )
    out.add_argument("--save-result", action="store_true", help="write the results as JSON")
    out.add_argument(
        "--save-detailed",
        action="store_true",
        help="also write per-request input_lens, output_lens, start_times, ttfts, itls, errors",
    )
    out.add_argument("--result-dir", default=None, help="directory of the JSON (default .)")
    out.add_argument(
        "--result-filename",
        default=None,
        help="file name of the JSON (default LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json)",
    )
    out.add_argument("--label", default=None, help="prefix of that file name (default --backend)")
    out.add_argument("--result-file", default=None, help="write the JSON to this path instead")
    out.add_argument(
        "--plot",
        default=None,
        metavar="FILE.html",
        help="write one self-contained HTML report: the table, output tokens/s per second, "
        "TTFT/TPOT/ITL/E2EL histograms and a request timeline (inline SVG)",
    )
    out.add_argument(
        "--plot-timeline",
        action="store_true",
        help="vLLM's flag: the same report beside the result JSON, as NAME.timeline.html",
    )
    p.set_defaults(func=bench_serve)


def _result_path(args: argparse.Namespace, model: str, date: str) -> str | None:
    """vLLM's `compute_result_filename`, or --result-file as given."""
    if args.result_file:
        return str(args.result_file)
    if not (args.save_result or args.plot_timeline):
        return None
    name = args.result_filename
    if name is None:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        base = model.split("/")[-1]
        name = (
            f"{args.label or args.backend}-{args.request_rate}qps{concurrency}-{base}-{date}.json"
        )
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return str(name)


def _check_args(args: argparse.Namespace) -> None:
    """ValueError for flags that cannot work together, before anything is sent."""
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.sharegpt_output_len = args.output_len
    for flag, value in (
        ("--num-prompts", args.num_prompts),
        ("--max-concurrency", args.max_concurrency),
        ("--random-input-len", args.random_input_len),
        ("--random-output-len", args.random_output_len),
        ("--sharegpt-output-len", args.sharegpt_output_len),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be positive, got {args.request_rate}")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    chat_endpoint = args.endpoint.rstrip("/").endswith("chat/completions")
    if chat_endpoint != (args.backend == "openai-chat"):
        raise ValueError(
            f"--backend {args.backend} does not stream from {args.endpoint}: openai-chat takes "
            "a .../chat/completions endpoint, vllm and openai a completions one"
        )
    if args.dataset_name not in DATASETS:
        raise ValueError(
            f"--dataset-name {args.dataset_name}: treadle has {' and '.join(DATASETS)} "
            "(vLLM's others are not supported)"
        )
    if args.dataset_name == "sharegpt" and args.dataset_path is None:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE (a local JSON file)")
    if args.dataset_name == "random" and args.dataset_path is not None:
        raise ValueError(
            f"--dataset-path {args.dataset_path} goes with --dataset-name sharegpt, not random"
        )


class _Tokens:
    """Token counts and the text of token ids: by the server (/tokenize, /detokenize), or by a
    local tokenizer with --tokenizer (vLLM's flag; never downloaded)."""

    def __init__(self, base_url: str, api_key: str | None, tokenizer: str | None) -> None:
        self.base_url, self.api_key = base_url, api_key
        self.local: Any = None
        if tokenizer is not None:
            from treadle.config import resolve_model
            from treadle.tokenizer import load_tokenizer

            try:
                self.local = load_tokenizer(resolve_model(tokenizer))
            except (OSError, ValueError) as e:
                raise ValueError(f"--tokenizer {tokenizer!r}: {e}") from e

    def count(self, texts: list[str]) -> list[int]:
        if self.local is None:
            return count_tokens(self.base_url, texts, self.api_key)
        return [len(ids) for ids in self.local(texts)["input_ids"]]

    def text(self, prompts: list[list[int]]) -> list[str]:
        if self.local is None:
            return detokenize(self.base_url, prompts, self.api_key)
        return list(self.local.batch_decode(prompts))


def _samples(
    args: argparse.Namespace, tokens: _Tokens, sharegpt: list[tuple[str, str]] | None
) -> list[SampleRequest]:
    """The requests to send; token ids become text for a chat endpoint."""
    if sharegpt is not None:
        return sample_sharegpt(
            sharegpt, args.num_prompts, args.seed, tokens.count, args.sharegpt_output_len
        )
    samples = sample_random(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        args.seed,
    )
    if args.backend == "openai-chat":
        ids = [s.prompt for s in samples if isinstance(s.prompt, list)]
        samples = [
            replace(s, prompt=text) for s, text in zip(samples, tokens.text(ids), strict=True)
        ]
    return samples


def _result_json(
    args: argparse.Namespace,
    model: str,
    date: str,
    base_url: str,
    metrics: dict[str, Any],
    results: list[RequestResult],
) -> dict[str, Any]:
    """vLLM's result JSON: its keys in its order, then treadle's extras (base_url, endpoint, the
    dataset flags, first_error); per-request lists with --save-detailed only."""
    config = {
        "date": date,
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model,
        "tokenizer_id": args.tokenizer or model,  # the server's tokenizer, unless --tokenizer
        "num_prompts": args.num_prompts,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": 1.0,
        "max_concurrency": args.max_concurrency,
    }
    per_request = {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "errors": [r.error for r in results],
    }
    if not args.save_detailed:
        per_request = {k: v for k, v in per_request.items() if k not in DETAILED_KEYS}
    extras = {
        "model": model,
        "base_url": base_url,
        "endpoint": args.endpoint,
        "dataset_name": args.dataset_name,
        "dataset_path": args.dataset_path,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "sharegpt_output_len": args.sharegpt_output_len,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
    }
    return {**config, **metrics, **per_request, **extras}


def _error(message: str) -> int:
    print(f"treadle bench serve: error: {message}", file=sys.stderr)
    return 2


def bench_serve(args: argparse.Namespace) -> int:
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    args.endpoint = args.endpoint or BACKENDS[args.backend]
    if args.dataset_name == "random":  # vLLM: random prompts run to their full length
        args.ignore_eos = True
    try:
        _check_args(args)
        shown = parse_percentile_metrics(args.percentile_metrics)
        percentiles = parse_percentiles(args.metric_percentiles)
        sharegpt = load_sharegpt(args.dataset_path) if args.dataset_name == "sharegpt" else None
    except ValueError as e:  # DatasetError too
        return _error(str(e))
    try:
        model = args.model or first_model_id(base_url, args.api_key)
    except (OSError, ValueError, KeyError, IndexError) as e:
        return _error(f"cannot list models at {base_url}/v1/models: {e}")
    try:
        tokens = _Tokens(base_url, args.api_key, args.tokenizer)
    except ValueError as e:
        return _error(str(e))
    try:
        samples = _samples(args, tokens, sharegpt)
    except DatasetError as e:
        return _error(str(e))
    except (OSError, ValueError, KeyError) as e:
        call = "tokenize" if sharegpt is not None else "detokenize"
        return _error(f"cannot {call} the prompts at {base_url}/{call}: {e}")
    heading = (
        f"Model {model}, backend {args.backend} ({args.endpoint}), {len(samples)} {args.dataset_name}"
        f" requests of {sum(s.prompt_len for s in samples) / len(samples):.0f} prompt tokens"
        f" on average, request rate {args.request_rate}, max concurrency {args.max_concurrency}"
    )
    print(heading)
    results, duration = asyncio.run(
        run_benchmark(
            base_url,
            args.served_model_name or model,
            [s.prompt for s in samples],
            [s.expected_output_len for s in samples],
            endpoint=args.endpoint,
            chat=args.backend == "openai-chat",
            max_concurrency=args.max_concurrency,
            request_rate=args.request_rate,
            ignore_eos=args.ignore_eos,
            seed=args.seed,
            disable_tqdm=args.disable_tqdm,
            api_key=args.api_key,
            prompt_lens=[s.prompt_len for s in samples],
        )
    )
    metrics = compute_metrics(results, duration, percentiles)
    table = (metrics, args.max_concurrency, shown, percentiles, args.request_rate)
    print(format_table(*table))
    date = time.strftime("%Y%m%d-%H%M%S")
    path = _result_path(args, model, date)
    plots = [args.plot] if args.plot else []
    if args.plot_timeline and path:
        plots.append(str(Path(path).with_suffix(".timeline.html")))
    try:
        if path and (args.save_result or args.result_file):
            with open(path, "w") as f:
                json.dump(_result_json(args, model, date, base_url, metrics, results), f, indent=2)
            print(f"Results written to {path}")
        for plot in plots:
            from treadle.cli.bench_plot import write_report

            Path(plot).parent.mkdir(parents=True, exist_ok=True)
            write_report(plot, results, metrics, summary_rows(*table), heading)
            print(f"Report written to {plot}")
    except OSError as e:
        return _error(f"cannot write {e.filename}: {e.strerror}")
    return 0 if metrics["completed"] else 1
