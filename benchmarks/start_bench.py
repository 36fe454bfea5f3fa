"""Start to ready, as a user meets it (issue 41 item 4): seconds from launching `treadle serve`
(default model and flags) to the first completion that succeeds, beside llama.cpp's
`llama-server` on the same GGUF when `.peers/llama-server-native` exists (`make bench-peers`).

- cold: the first start on a machine, with an empty `TREADLE_CACHE_DIR` (treadle compiles its
  CPU kernels for this CPU and converts the GGUF vocabulary once, then caches both);
- warm: later starts (both cached), `--warm` of them, alternating with llama-server's.

Each start waits the way scripts do, `until curl -sf /health; do sleep 0.05; done`, then sends
one completion; "ready" is that completion's answer. Targets: warm <= 3 s, cold <= 8 s.

    .venv/bin/python benchmarks/start_bench.py [--warm 5] [--no-cold]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from peer_bench import LlamaServer  # noqa: E402
from serve_bench import Server  # noqa: E402
from treadle.config import resolve_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / ".peers" / "llama-server-native"


def first_success(url: str, started: float, timeout: float = 300.0) -> float:
    """Polls /health every 50 ms until 200, then sends one completion: seconds from `started`
    to its answer (a failed completion is reported, not retried: /health 200 means ready)."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    body = {"prompt": "Hello", "max_tokens": 4, "n_predict": 4, "temperature": 0}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        if resp.status != 200:
            raise RuntimeError(f"first completion after /health 200 answered {resp.status}")
    return time.perf_counter() - started


def treadle_start(cache_dir: str | None) -> float:
    if cache_dir is not None:
        os.environ["TREADLE_CACHE_DIR"] = cache_dir
    else:
        os.environ.pop("TREADLE_CACHE_DIR", None)
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        server = Server(Path(log.name))
        try:
            while not server.url:  # the port is the OS's choice: read it from the log
                if server.proc.poll() is not None:
                    raise RuntimeError(server.output())
                time.sleep(0.02)
                m = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", server.output())
                server.url = m.group(1) if m else ""
            return first_success(server.url, server.started)
        finally:
            server.stop()


def llama_start() -> float:
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        server = LlamaServer(LLAMA, resolve_model(None).path, 1, Path(log.name))
        try:
            return first_success(server.url, server.started)
        finally:
            server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm", type=int, default=5, help="warm starts of each server")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold start")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"load average {load:.2f}; {'with' if LLAMA.exists() else 'without'} llama-server")
    if not args.no_cold:
        with tempfile.TemporaryDirectory() as cache:
            cold = treadle_start(cache)
        print(f"treadle cold (empty cache): {cold:.2f} s")
    treadle_start(None)  # fills the user's cache if it is empty
    ours, theirs = [], []
    for i in range(args.warm):
        ours.append(treadle_start(None))
        line = f"warm {i + 1}: treadle {ours[-1]:.2f} s"
        if LLAMA.exists():
            theirs.append(llama_start())
            line += f", llama-server {theirs[-1]:.2f} s"
        print(line, flush=True)
    print(f"treadle warm median {statistics.median(ours):.2f} s (target <= 3 s)")
    if theirs:
        print(f"llama-server warm median {statistics.median(theirs):.2f} s")
    subprocess.run(["uptime"], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
