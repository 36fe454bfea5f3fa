"""Restart time of a dead engine core, served (issue 14): `treadle serve` (default model), a
number of greedy streams in flight, kill -9 of the engine core, and the time from the kill to
the first token of a resumed stream (and to the last stream's first resumed token), several
rounds in one run. Beside it, the server's own start: launch to a healthy /health.
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


def engine_pid(server: Server) -> int:
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if child.cmdline()[0].strip() == "treadle::EngineCore_DP0":
                return child.pid
        except (psutil.NoSuchProcess, IndexError):
            continue
    raise LookupError("no engine core")


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


def one_round(url: str, engine: int, streams: int, max_tokens: int) -> dict[str, float]:
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
    os.kill(engine, signal.SIGKILL)
    for t in threads:
        t.join()
    firsts = [next(x for x in t if x > killed) for t in times]
    return {"first_resumed_token_s": min(firsts) - killed, "all_resumed_s": max(firsts) - killed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--result-file", default=None, help="write every figure here as JSON")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    results: dict[str, Any] = {"rounds": []}
    with tempfile.TemporaryDirectory(prefix="treadle-restart-bench-") as tmp:
        server = Server(Path(tmp) / "server.log", ["--max-engine-restarts", str(args.rounds)])
        try:
            results["healthy_s"] = server.wait_healthy()
            for r in range(args.rounds):
                figures = one_round(server.url, engine_pid(server), args.streams, args.max_tokens)
                results["rounds"].append(figures)
                print(
                    f"round {r + 1}: kill -9 -> first resumed token {figures['first_resumed_token_s']:.2f} s,"
                    f" every stream resumed {figures['all_resumed_s']:.2f} s",
                    flush=True,
                )
        except BaseException:
            print(server.output()[-4000:], file=sys.stderr)
            raise
        finally:
            server.stop()
    first = statistics.median(r["first_resumed_token_s"] for r in results["rounds"])
    every = statistics.median(r["all_resumed_s"] for r in results["rounds"])
    print(
        f"restart ({args.streams} streams in flight, median of {args.rounds}): kill -9 -> first "
        f"resumed token {first:.2f} s, every stream resumed {every:.2f} s; start to healthy "
        f"{results['healthy_s']:.2f} s",
        flush=True,
    )
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
