"""Single-stream speed with another process busy on the same CPU (issue 24 item 7).

Phases, one server each (default flags unless said), single stream, greedy, 64 output tokens
of a fixed 64-token prompt, over HTTP, streamed: median TPOT of `--requests` requests.
  quiet, 1 thread   `--cpu-threads 1` on the quiet machine: the bar (today's acceptance: the
                    default under load within 1.5x of this)
  quiet             default threads, quiet machine
  busy              default threads, one `while True: pass` process beside it
  recovery          after the busy loop stops: seconds until a request is back within 1.25x of
                    the quiet default's TPOT
The same phases for llama.cpp's llama-server (`-t 2`) where `.peers/llama-server-native` (or
`--llama-server`) exists (`make bench-peers` builds it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")

from peer_bench import ROOT, LlamaServer  # noqa: E402
from serve_bench import Server  # noqa: E402
from treadle.config import resolve_model  # noqa: E402

PROMPT = [(i * 37) % 2000 + 100 for i in range(64)]  # fixed token ids
OUTPUT_LEN = 64


def stream_tpot(url: str, model: str, max_tokens: int = OUTPUT_LEN) -> float:
    """Median gap between streamed tokens of one greedy request, in ms."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    req = urllib.request.Request(
        url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    stamps = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps[1:-1], stamps[2:], strict=True)]  # after the first
    return statistics.median(gaps) * 1000 if gaps else float("nan")


def median_tpot(url: str, model: str, requests: int) -> float:
    return statistics.median(stream_tpot(url, model) for _ in range(requests))


def busy_loop() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def phases(url: str, model: str, requests: int) -> dict[str, float]:
    out: dict[str, float] = {}
    stream_tpot(url, model, 8)  # warm up
    out["quiet"] = median_tpot(url, model, requests)
    neighbour = busy_loop()
    try:
        time.sleep(2)
        out["busy"] = median_tpot(url, model, requests)
    finally:
        neighbour.kill()
        neighbour.wait()
    stopped = time.perf_counter()
    while time.perf_counter() - stopped < 60:
        if stream_tpot(url, model, 16) <= 1.25 * out["quiet"]:
            break
        time.sleep(0.25)
    out["recovery_s"] = time.perf_counter() - stopped
    return out


def bench_treadle(gguf: str, requests: int, tmp: Path) -> dict[str, float]:
    one = Server(tmp / "treadle-1.log", [gguf, "--cpu-threads", "1"])
    try:
        one.wait_healthy()
        model = served_name(one.url)
        stream_tpot(one.url, model, 8)
        quiet_one = median_tpot(one.url, model, requests)
    finally:
        one.stop()
    server = Server(tmp / "treadle.log", [gguf])
    try:
        server.wait_healthy()
        result = phases(server.url, served_name(server.url), requests)
    finally:
        server.stop()
    changes = [
        line.split("] ", 1)[-1]
        for line in (tmp / "treadle.log").read_text().splitlines()
        if "Model threads" in line
    ]
    print("  treadle's thread changes:", *changes, sep="\n    ", flush=True)
    return {"quiet_1thread": quiet_one, **result}


def served_name(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        return str(json.load(resp)["data"][0]["id"])


def bench_llama(
    binary: Path, gguf: str, requests: int, tmp: Path, extra: list[str]
) -> dict[str, float]:
    server = LlamaServer(binary, gguf, 1, tmp / "llama.log", extra=extra)
    try:
        server.wait_healthy()
        return phases(server.url, "model", requests)
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3, help="requests per phase (median)")
    parser.add_argument("--llama-server", type=Path, default=ROOT / ".peers/llama-server-native")
    parser.add_argument(
        "--llama-extra", default="", help="more llama-server arguments (e.g. --no-repack)"
    )
    args = parser.parse_args()
    gguf = resolve_model(None).path
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print("treadle ...", flush=True)
        results["treadle"] = bench_treadle(gguf, args.requests, tmp)
        if args.llama_server.exists():
            print("llama.cpp ...", flush=True)
            results["llama.cpp"] = bench_llama(
                args.llama_server, gguf, args.requests, tmp, args.llama_extra.split()
            )
        else:
            print(f"(no {args.llama_server}: `make bench-peers` builds llama.cpp's server)")
    print(f"\nsingle-stream TPOT, ms (cpu: {os.cpu_count()} cores)")
    print(f"{'':12s} {'quiet 1 thr':>11s} {'quiet':>8s} {'busy':>8s} {'recovery':>9s}")
    for name, r in results.items():
        one = r.get("quiet_1thread", float("nan"))
        print(f"{name:12s} {one:11.1f} {r['quiet']:8.1f} {r['busy']:8.1f} {r['recovery_s']:8.1f}s")
    t = results["treadle"]
    print(
        f"treadle busy / own quiet 1-thread: {t['busy'] / t['quiet_1thread']:.2f} (target <= 1.5)"
    )
    if "llama.cpp" in results:
        print(f"treadle busy / llama.cpp busy: {t['busy'] / results['llama.cpp']['busy']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
