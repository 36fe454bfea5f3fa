"""`treadle bench serve`: the metrics on made-up request records, and one run against a real
server."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from treadle.cli.bench import (
    RequestResult,
    arrival_gaps,
    compute_metrics,
    format_table,
    random_lengths,
    random_prompts,
)

TREADLE = str(Path(sys.executable).parent / "treadle")


def _ok(ttft: float, latency: float, tokens: int, prompt_len: int = 10) -> RequestResult:
    itl = [(latency - ttft) / (tokens - 1)] * (tokens - 1) if tokens > 1 else []
    return RequestResult(prompt_len, True, tokens, ttft, itl, latency)


def test_metrics_totals_throughput_and_failures() -> None:
    results = [
        _ok(0.1, 1.1, 11),
        _ok(0.2, 2.2, 21, prompt_len=20),
        RequestResult(30, error="HTTP 400: bad prompt"),
        RequestResult(40, error="ClientConnectorError: refused"),
    ]
    m = compute_metrics(results, duration=4.0)
    assert m["completed"] == 2 and m["failed"] == 2
    assert m["first_error"] == "HTTP 400: bad prompt"
    assert m["total_input_tokens"] == 30  # failed requests are not counted
    assert m["total_output_tokens"] == 32
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(8.0)
    assert m["total_token_throughput"] == pytest.approx(15.5)
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["mean_e2el_ms"] == pytest.approx(1650.0)


def test_tpot_skips_single_token_outputs() -> None:
    # TPOT = (e2e - ttft) / (tokens - 1): 1.0/10 = 100 ms and 2.0/5 = 400 ms; the one-token
    # request has no TPOT but its TTFT and E2EL still count.
    results = [_ok(0.1, 1.1, 11), _ok(0.5, 2.5, 6), _ok(0.3, 0.3, 1)]
    m = compute_metrics(results, duration=3.0)
    assert m["mean_tpot_ms"] == pytest.approx(250.0)
    assert m["median_tpot_ms"] == pytest.approx(250.0)
    assert m["mean_ttft_ms"] == pytest.approx(300.0)
    # ITL pools every gap: 10 of 100 ms and 5 of 400 ms.
    assert m["mean_itl_ms"] == pytest.approx((10 * 100 + 5 * 400) / 15)
    assert m["median_itl_ms"] == pytest.approx(100.0)


def test_percentiles_interpolate_like_numpy() -> None:
    # TTFTs of 1..100 ms: median 50.5, p99 by linear interpolation 99.01.
    results = [RequestResult(1, True, 1, t / 1000, [], t / 1000) for t in range(1, 101)]
    m = compute_metrics(results, duration=1.0)
    assert m["median_ttft_ms"] == pytest.approx(50.5)
    assert m["p99_ttft_ms"] == pytest.approx(99.01)
    assert m["mean_ttft_ms"] == pytest.approx(50.5)


def test_all_failed_reports_zeros_and_the_error() -> None:
    m = compute_metrics([RequestResult(5, error="boom")], duration=0.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["request_throughput"] == 0.0 and m["p99_e2el_ms"] == 0.0
    table = format_table(m, max_concurrency=4)
    assert "Failed requests:" in table and "First error: boom" in table
    assert "Maximum request concurrency:" in table


def test_table_rows_are_vllms() -> None:
    table = format_table(compute_metrics([_ok(0.1, 1.1, 11)], duration=2.0))
    for label in (
        "Successful requests:",
        "Benchmark duration (s):",
        "Total input tokens:",
        "Total generated tokens:",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Total token throughput (tok/s):",
        "Mean TTFT (ms):",
        "Median TPOT (ms):",
        "P99 ITL (ms):",
        "Mean E2EL (ms):",
    ):
        assert label in table
    assert "First error" not in table


def test_prompts_and_arrivals_are_seeded() -> None:
    prompts = random_prompts(3, 7, seed=1)
    assert prompts == random_prompts(3, 7, seed=1) != random_prompts(3, 7, seed=2)
    assert all(len(p) == 7 and all(1000 <= t < 20000 for t in p) for p in prompts)
    assert arrival_gaps(4, math.inf, seed=0) == [0.0] * 4
    gaps = arrival_gaps(2000, 10.0, seed=0)
    assert gaps == arrival_gaps(2000, 10.0, seed=0)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)


def test_range_ratio_and_percentiles_are_vllms() -> None:
    assert random_lengths(5, 64, 0.0, seed=0) == [64] * 5
    lens = random_lengths(500, 64, 0.5, seed=0)
    assert min(lens) >= 32 and max(lens) <= 96 and len(set(lens)) > 10
    with pytest.raises(ValueError, match="range-ratio"):
        random_lengths(1, 64, 1.5, seed=0)
    results = [RequestResult(1, True, 1, t / 1000, [], t / 1000) for t in range(1, 101)]
    m = compute_metrics(results, duration=1.0, percentiles=(50, 90))
    assert m["p50_ttft_ms"] == pytest.approx(50.5) and m["p90_ttft_ms"] == pytest.approx(90.1)
    assert m["p99_ttft_ms"] == pytest.approx(99.01) and m["std_ttft_ms"] > 0
    table = format_table(m, shown=("ttft",), percentiles=(50, 90))
    assert "P90 TTFT (ms):" in table and "TPOT" not in table


def test_bench_serve_end_to_end(server_factory, tiny_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server = server_factory([str(tiny_model_factory("llama")), "--max-model-len", "256"])
    result_file = tmp_path / "result.json"
    proc = subprocess.run(
        [
            TREADLE,
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--num-prompts",
            "8",
            "--max-concurrency",
            "4",
            "--random-input-len",
            "16",
            "--random-output-len",
            "8",
            "--ignore-eos",
            "--disable-tqdm",
            "--result-file",
            str(result_file),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout
    result = json.loads(result_file.read_text())
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_input_tokens"] == 8 * 16
    assert result["total_output_tokens"] == 8 * 8
    assert result["output_lens"] == [8] * 8
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0

    # vLLM's command line, word for word.
    host, port = server.url.removeprefix("http://").split(":")
    result_dir = tmp_path / "results"
    vllm_line = [
        *("--backend", "vllm", "--host", host, "--port", port, "--dataset-name", "random"),
        *("--random-input-len", "64", "--random-output-len", "16", "--num-prompts", "8"),
        *("--save-result", "--result-dir", str(result_dir), "--ignore-eos", "--disable-tqdm"),
        *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"),
    ]
    proc = subprocess.run(
        [TREADLE, "bench", "serve", *vllm_line], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "P50 E2EL (ms):" in proc.stdout
    (saved,) = result_dir.iterdir()
    assert saved.name.startswith("vllm-infqps-") and saved.suffix == ".json"
    result = json.loads(saved.read_text())
    assert result["backend"] == "vllm" and result["model_id"] == result["model"]
    assert result["completed"] == 8 and result["total_input_tokens"] == 8 * 64
    assert result["total_output_tokens"] == 8 * 16 and "p50_itl_ms" in result

    chat = subprocess.run(
        [TREADLE, "bench", "serve", "--backend", "openai-chat", "--base-url", server.url]
        + ["--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "4"]
        + ["--ignore-eos", "--disable-tqdm"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert chat.returncode == 0, chat.stdout + chat.stderr
    assert re.search(r"Total generated tokens:\s+8\b", chat.stdout), chat.stdout
