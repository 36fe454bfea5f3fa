"""`treadle bench serve` against a real server: vLLM's command lines, both backends, both
datasets, the result JSON and the HTML report (the parts alone: tests/cli/test_bench_*.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx

TREADLE = str(Path(sys.executable).parent / "treadle")


def test_bench_serve_end_to_end(server_factory, tiny_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model = str(tiny_model_factory("llama"))
    server = server_factory(["--model", model, "--max-model-len", "256"])
    host, port = server.url.removeprefix("http://").split(":")

    # Issue 28: vLLM's pair of command lines, the model's path on both sides (it was a 404
    # for every request: the server answered only to the path's last part).
    result_dir = tmp_path / "results"
    proc = subprocess.run(
        [TREADLE, "bench", "serve", "--backend", "vllm", "--model", model]
        + ["--host", host, "--port", port, "--dataset-name", "random", "--num-prompts", "4"]
        + ["--random-input-len", "8", "--random-output-len", "4", "--disable-tqdm"]
        + ["--save-result", "--result-dir", str(result_dir), "--result-filename", "path.json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((result_dir / "path.json").read_text())
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["model_id"] == model
    models = httpx.get(server.url + "/v1/models").json()
    # accepted under its path (vLLM's name for it), listed under its short name: no path shown
    assert [card["id"] for card in models["data"]] == [os.path.basename(model)]

    # vLLM's --tokenizer: a local tokenizer turns the random token ids into chat text.
    proc = subprocess.run(
        [TREADLE, "bench", "serve", "--backend", "openai-chat", "--model", model]
        + ["--tokenizer", model, "--base-url", server.url, "--num-prompts", "3"]
        + ["--random-input-len", "8", "--random-output-len", "4", "--disable-tqdm"]
        + ["--save-result", "--result-dir", str(result_dir), "--result-filename", "tok.json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((result_dir / "tok.json").read_text())
    assert result["completed"] == 3 and result["tokenizer_id"] == model
    proc = subprocess.run(
        [TREADLE, "bench", "serve", "--base-url", server.url, "--tokenizer", "org/not-here"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "--tokenizer 'org/not-here'" in proc.stdout + proc.stderr

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
            "--save-detailed",
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
    assert result["output_lens"] == [8] * 8 and len(result["start_times"]) == 8
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0

    # vLLM's command line, word for word.
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
    (saved,) = result_dir.glob("vllm-*.json")
    assert saved.name.startswith("vllm-infqps-") and saved.suffix == ".json"
    result = json.loads(saved.read_text())
    assert result["backend"] == "vllm" and result["model_id"] == result["model"]
    assert result["completed"] == 8 and result["total_input_tokens"] == 8 * 64
    assert result["total_output_tokens"] == 8 * 16 and "p50_itl_ms" in result
    assert (
        "ttfts" not in result and len(result["latencies"]) == 8
    )  # vLLM's, without --save-detailed

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

    # ShareGPT through the chat endpoint, with vLLM's percentile flags, JSON and timeline plot,
    # and treadle's --plot. The "Hi" pair is too short for vLLM's filter; 3 requests of 2
    # valid pairs repeat one.
    answer = "Sure. Here is a longer answer with quite a few words in it, to be counted."
    conversations = [
        [("human", "Hi"), ("gpt", answer)],
        [
            ("system", "Be brief."),
            ("human", "What is the capital of France, and why?"),
            ("gpt", answer),
        ],
        [
            ("human", "Write one sentence about the sea and the sky."),
            ("gpt", answer),
            ("human", "Another?"),
        ],
    ]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(
        json.dumps(
            [
                {"id": str(i), "conversations": [{"from": f, "value": v} for f, v in turns]}
                for i, turns in enumerate(conversations)
            ]
        )
    )
    plot = tmp_path / "plots" / "report.html"
    line = [
        *("--backend", "openai-chat", "--base-url", server.url, "--disable-tqdm"),
        *("--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--num-prompts", "3"),
        *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "25,50,99"),
        *("--save-result", "--result-dir", str(result_dir), "--result-filename", "sg.json"),
        *("--plot", str(plot), "--plot-timeline"),
    ]
    proc = subprocess.run(
        [TREADLE, "bench", "serve", *line], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "P25 TTFT (ms):" in proc.stdout and "Peak concurrent requests:" in proc.stdout
    result = json.loads((result_dir / "sg.json").read_text())
    assert result["completed"] == 3 and result["failed"] == 0
    assert result["backend"] == result["endpoint_type"] == "openai-chat"
    assert result["dataset_name"] == "sharegpt" and result["request_rate"] == "inf"
    for key in (
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "max_output_tokens_per_s",
        "max_concurrent_requests",
    ):
        assert result[key] > 0, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p25", "p50", "p99"):
            assert result[f"{stat}_{metric}_ms"] >= 0, (stat, metric)
    assert result["mean_ttft_ms"] > 0 and result["total_input_tokens"] > 3 * 4
    for report in (plot, result_dir / "sg.timeline.html"):
        page = report.read_text()
        assert page.startswith("<!DOCTYPE html>") and "<script" not in page
        assert '<svg id="throughput"' in page and 'data-series="output_tokens_per_s"' in page
        assert all(f'<svg id="hist-{m}"' in page for m in ("ttft", "tpot", "itl", "e2el"))
        assert "Successful requests:" in page and "sharegpt" in page
