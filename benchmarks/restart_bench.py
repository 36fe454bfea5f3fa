"""Restart time of a dead engine core, served (issue 14): `treadle serve` (default model), a
number of greedy streams in flight, kill -9 of the engine core (or `--victim Worker_TP1` with
`--serve-args "-tp 3"`), and the time from the kill to the first token of a resumed stream, to
the last stream's first resumed token, and to /health/ready 200 again; several rounds in one
run. Beside it, the server's own start: launch to a healthy /health (the load time).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")

import httpx  # noqa: E402
import psutil  # noqa: E402

from serve_bench import Server  # noqa: E402


def victim_pid(server: Server, title: str) -> int:
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if child.cmdline()[0].strip() == f"treadle::{title}":
                return child.pid
        except (psutil.NoSuchProcess, IndexError):
            continue
    raise LookupError(f"no {title} process")


def ready(url: str) -> bool:
    return httpx.get(url + "/health/ready", timeout=10).status_code == 200


def ready_again(url: str, killed: float) -> float:
    """Seconds from the kill to /health/ready 200, once it has been 503."""
    while ready(url):
        if time.perf_counter() - killed > 10:
            raise RuntimeError("/health/ready never said 503 after the kill")
        time.sleep(0.02)
    while not ready(url):
        time.sleep(0.05)
    return time.perf_counter() - killed


def stream(url: str, prompt: str, max_tokens: int, times: list[float]) -> None:
    """A greedy streamed completion; appends the arrival time of each chunk to `times`."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with httpx.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=600
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                if "error" in json.loads(line[6:]):
                    raise RuntimeError(line)
                times.append(time.perf_counter())


def one_round(url: str, victim: int, streams: int, max_tokens: int) -> dict[str, float]:
    times: list[list[float]] = [[] for _ in range(streams)]
    threads = [
        threading.Thread(target=stream, args=(url, f"Tell me story {i}.", max_tokens, times[i]))
        for i in range(streams)
    ]
    for t in threads:
        t.start()
    while min(len(t) for t in times) < 8:
        time.sleep(0.01)
    killed = time.perf_counter()
    os.kill(victim, signal.SIGKILL)
    ready_s = ready_again(url, killed)
    for t in threads:
        t.join()
    firsts = [next(x for x in t if x > killed) for t in times]
    return {
        "first_resumed_token_s": min(firsts) - killed,
        "all_resumed_s": max(firsts) - killed,
        "ready_again_s": ready_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--result-file", default=None, help="write every figure here as JSON")
    parser.add_argument("--serve-args", default="", help='more `treadle serve` flags, e.g. "-tp 3"')
    parser.add_argument("--victim", default="EngineCore_DP0", help="the process title to kill")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    results: dict[str, Any] = {"rounds": []}
    with tempfile.TemporaryDirectory(prefix="treadle-restart-bench-") as tmp:
        flags = ["--max-engine-restarts", str(args.rounds), *args.serve_args.split()]
        server = Server(Path(tmp) / "server.log", flags)
        try:
            results["healthy_s"] = server.wait_healthy()
            for r in range(args.rounds):
                victim = victim_pid(server, args.victim)
                figures = one_round(server.url, victim, args.streams, args.max_tokens)
                results["rounds"].append(figures)
                print(
                    f"round {r + 1}: kill -9 {args.victim} -> first resumed token "
                    f"{figures['first_resumed_token_s']:.2f} s, every stream resumed "
                    f"{figures['all_resumed_s']:.2f} s, /health/ready 200 "
                    f"{figures['ready_again_s']:.2f} s",
                    flush=True,
                )
        except BaseException:
            print(server.output()[-4000:], file=sys.stderr)
            raise
        finally:
            server.stop()
    first = statistics.median(r["first_resumed_token_s"] for r in results["rounds"])
    every = statistics.median(r["all_resumed_s"] for r in results["rounds"])
    ready_s = statistics.median(r["ready_again_s"] for r in results["rounds"])
    print(
        f"restart ({args.serve_args or 'default'}, {args.streams} streams in flight, kill -9 "
        f"{args.victim}, median of {args.rounds}): first resumed token {first:.2f} s, every "
        f"stream resumed {every:.2f} s, /health/ready 200 again {ready_s:.2f} s; start to "
        f"healthy (the load time) {results['healthy_s']:.2f} s",
        flush=True,
    )
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
