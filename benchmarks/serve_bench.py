"""Serving benchmark: `treadle serve` (default model) under `treadle bench serve`'s client, beside
the offline `LLM.generate` on the same workload, in one run.

- start-up: seconds from launching `treadle serve` to a healthy /health (target < 15 s);
- (a) 64 requests at concurrency 16 and (b) 128 requests at concurrency 64, 128 random tokens in,
  128 out (ignore_eos, greedy), streamed over HTTP;
- offline: the server stopped, `LLM.generate` on the prompts of (b);
- the ratio of output tok/s, served (b) / offline (target >= 0.95).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")

from treadle.cli.bench_client import first_model_id, run_benchmark  # noqa: E402
from treadle.cli.bench_datasets import random_prompts  # noqa: E402
from treadle.cli.bench_metrics import compute_metrics, format_table  # noqa: E402

TREADLE = str(Path(sys.executable).parent / "treadle")
INPUT_LEN, OUTPUT_LEN = 128, 128
RUNS = (("a", 64, 16), ("b", 128, 64))  # (name, requests, max concurrency)


class Server:
    """`treadle serve` on 127.0.0.1 with an OS-chosen port, its output in a log file."""

    def __init__(self, log_path: Path, args: list[str] | None = None) -> None:
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, TREADLE_LOGGING_LEVEL="INFO")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [TREADLE, "serve", *(args or []), "--host", "127.0.0.1", "--port", "0"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.url = ""

    def wait_healthy(self, timeout: float = 300.0) -> float:
        """Seconds from launch to the first 200 from /health/startup (the engines loaded)."""
        import urllib.error
        import urllib.request

        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            if not self.url:
                m = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", self.output())
                self.url = m.group(1) if m else ""
            if self.url:
                try:
                    with urllib.request.urlopen(self.url + "/health/startup", timeout=5) as resp:
                        if resp.status == 200:
                            return time.perf_counter() - self.started
                except (urllib.error.URLError, OSError):
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"server not healthy in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        """SIGTERM by pid, wait, then kill the process group (its engine children) if needed."""
        stop_process(self.proc, whole_group=False)
        self.log.close()


def stop_process(proc: subprocess.Popen[bytes], whole_group: bool) -> None:
    """SIGTERM to a server started in its own session (to its whole process group where
    `whole_group`), wait up to 30 s, SIGKILL it if it is still there, then SIGKILL whatever of
    its group is left. By pid, never by name."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if whole_group:
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # any child left behind


def bench_served(url: str, prompts_b: list[list[int]]) -> dict[str, dict[str, Any]]:
    model = first_model_id(url)
    # One short request first, so that no run pays for first-request set-up.
    asyncio.run(run_benchmark(url, model, random_prompts(2, 16, 99), 4, disable_tqdm=True))
    results: dict[str, dict[str, Any]] = {}
    for name, num, concurrency in RUNS:
        # (a) gets other prompts than (b), so that (b) finds nothing of them in the prefix cache.
        prompts = prompts_b if name == "b" else random_prompts(num, INPUT_LEN, seed=1)
        records, duration = asyncio.run(
            run_benchmark(
                url, model, prompts, OUTPUT_LEN, max_concurrency=concurrency, ignore_eos=True
            )
        )
        metrics = compute_metrics(records, duration)
        print(
            f"\n({name}) {num} requests, max concurrency {concurrency}, {INPUT_LEN} in / {OUTPUT_LEN} out"
        )
        print(format_table(metrics, concurrency))
        results[name] = metrics
    return results


def bench_offline(prompts: list[list[int]]) -> tuple[float, int]:
    from treadle import LLM, SamplingParams

    llm = LLM()
    llm.generate(
        [{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=2), use_tqdm=False
    )
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--result-file", default=None, help="write every figure here as JSON")
    args = parser.parse_args()
    # SIGTERM (a CI timeout) unwinds like Ctrl-C, so the `finally` below still stops the server.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    prompts_b = random_prompts(RUNS[1][1], INPUT_LEN, seed=0)

    with tempfile.TemporaryDirectory(prefix="treadle-serve-bench-") as tmp:
        server = Server(Path(tmp) / "server.log")
        try:
            startup_s = server.wait_healthy()
            print(f"server healthy after {startup_s:.2f} s (target < 15 s) at {server.url}")
            served = bench_served(server.url, prompts_b)
        except BaseException:
            print(server.output()[-4000:], file=sys.stderr)
            raise
        finally:
            server.stop()

    elapsed, out_tokens = bench_offline(prompts_b)
    offline_tok_s = out_tokens / elapsed
    serve_tok_s = served["b"]["output_throughput"]
    ratio = serve_tok_s / offline_tok_s
    print(f"\nworkload (b): {RUNS[1][1]} x {INPUT_LEN} in / {OUTPUT_LEN} out")
    print(f"  {'startup to healthy (s)':40s} {startup_s:10.2f}   (target < 15)")
    print(f"  {'serve output tok/s (b)':40s} {serve_tok_s:10.2f}")
    print(f"  {'offline output tok/s':40s} {offline_tok_s:10.2f}")
    print(f"  {'ratio serve / offline':40s} {ratio:10.3f}   (target >= 0.95)")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(
                {
                    "startup_s": startup_s,
                    "served": served,
                    "offline_output_tok_s": offline_tok_s,
                    "ratio_serve_offline": ratio,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
