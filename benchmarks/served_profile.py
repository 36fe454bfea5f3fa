"""Where a served batched run's time goes, process by process: `treadle serve` under `treadle
bench serve`'s client (peer_bench's workloads: 128 random tokens in, 128 out, greedy,
ignore_eos, streamed), and for each workload:

- the CPU time (user, system) and minor page faults of every process of the server's tree and
  of this client, from before to after the run;
- the engine core's steps, each timed around `EngineCore.step` by a hook this script puts on
  the server's PYTHONPATH (a `sitecustomize` that wraps `step` and `Scheduler.schedule` in the
  engine core process only; nothing else changes): how many, how long, how many prompt
  tokens and decode rows each had, the time between steps (the busy loop, IO), and a
  histogram of the decode rows.

    .venv/bin/python benchmarks/served_profile.py --workloads c16,c64 \
        --serve-args "--max-num-batched-tokens 512"

Shares are what to read on a busy machine; say its load (printed per workload).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")

import psutil  # noqa: E402

from serve_bench import Server  # noqa: E402
from treadle.cli.bench_client import run_benchmark  # noqa: E402
from treadle.cli.bench_datasets import random_prompts  # noqa: E402
from treadle.cli.bench_metrics import compute_metrics  # noqa: E402
from treadle.config import DEFAULT_MODEL_NAME  # noqa: E402

# name: (requests, concurrency, seed), as peer_bench.py's
WORKLOADS = {"c16": (64, 16, 1), "c64": (128, 64, 0)}

HOOK = """
import os, sys, threading, time

def _patch():
    while getattr(sys.modules.get("treadle.core.engine_core"), "EngineCore", None) is None:
        time.sleep(0.05)
    import json
    from treadle.core import engine_core, scheduler
    records, last = [], [None]
    schedule, step = scheduler.Scheduler.schedule, engine_core.EngineCore.step

    def timed_schedule(self):
        out = schedule(self)
        prompt = decode = 0
        for rid, n in out.num_scheduled_tokens.items():
            r = self.requests[rid]  # (its num_computed_tokens already counts these n)
            if r.num_computed_tokens - n >= r.num_prompt_tokens:
                decode += n
            else:
                prompt += n
        last[0] = (prompt, decode)
        return out

    def timed_step(self):
        last[0] = None
        start = time.perf_counter()
        out = step(self)
        if last[0] is not None:
            records.append((start, time.perf_counter() - start, *last[0]))
        if records and not self.has_unfinished_requests():
            with open(os.environ["TREADLE_PROFILE_STEPS"], "a") as f:
                f.write(json.dumps(records) + "\\n")
            records.clear()
        return out

    scheduler.Scheduler.schedule = timed_schedule
    engine_core.EngineCore.step = timed_step

if os.environ.get("TREADLE_PROFILE_STEPS") and "--multiprocessing-fork" in sys.argv:
    threading.Thread(target=_patch, daemon=True).start()
"""


def snapshot(procs: list[psutil.Process]) -> dict[int, tuple[str, float, float, int]]:
    """pid -> (name, user s, system s, minor faults)."""
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            stat = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            name = p.name() if p.pid == os.getpid() else " ".join(p.cmdline())[:40]
            out[p.pid] = (name, t.user, t.system, int(stat[7]))
        except (psutil.Error, OSError):
            pass
    return out


def steps_summary(records: list[list[float]], wall: float) -> list[str]:
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0, 0])
    rows: collections.Counter[int] = collections.Counter()
    for _, took, prompt, decode in records:
        kind = "decode only" if prompt == 0 else ("prompt only" if decode == 0 else "mixed")
        k = kinds[kind]
        k[0], k[1], k[2], k[3] = k[0] + 1, k[1] + took, k[2] + prompt, k[3] + decode
        if prompt == 0:
            rows[int(decode)] += 1
    span = records[-1][0] + records[-1][1] - records[0][0]
    busy = sum(r[1] for r in records)
    lines = [
        f"  steps {len(records)} in {span:.2f} s: in step() {busy:.2f} s, between steps "
        f"{span - busy:.2f} s ({(span - busy) / wall:.1%} of the run)"
    ]
    for kind, (n, took, prompt, decode) in sorted(kinds.items()):
        lines.append(
            f"  {kind:12s} {int(n):5d} steps {took:7.2f} s ({took / wall:5.1%}) "
            f"{took / n * 1e3:7.1f} ms each; prompt tokens {int(prompt)}, decode rows {int(decode)}"
        )
    top = ", ".join(f"{r} rows x{c}" for r, c in rows.most_common(6))
    lines.append(f"  decode-only steps by rows: {top}")
    return lines


def profile(name: str, server: Server, steps_file: Path) -> dict[str, Any]:
    num, concurrency, seed = WORKLOADS[name]
    prompts = random_prompts(num, 128, seed=seed)
    steps_file.write_text("")
    procs = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(True)]
    procs.append(psutil.Process())
    before = snapshot(procs)
    start = time.perf_counter()
    records, duration = asyncio.run(
        run_benchmark(
            server.url,
            DEFAULT_MODEL_NAME,
            prompts,
            128,
            max_concurrency=concurrency,
            ignore_eos=True,
            disable_tqdm=True,
            fresh_connections=True,
        )
    )
    wall = time.perf_counter() - start
    after = snapshot(procs)
    metrics = compute_metrics(records, duration)
    print(
        f"\n{name}: {metrics['output_throughput']:.1f} output tok/s, TTFT p50 "
        f"{metrics['median_ttft_ms']:.0f} ms, TPOT p50 {metrics['median_tpot_ms']:.1f} ms, "
        f"{wall:.2f} s; load {os.getloadavg()[0]:.1f}"
    )
    for pid, (pname, user, system, faults) in after.items():
        _, user0, system0, faults0 = before.get(pid, (pname, 0.0, 0.0, 0))
        cpu = user - user0 + system - system0
        print(
            f"  cpu {cpu:7.2f} s ({cpu / wall:6.1%} of the run; system {system - system0:5.2f}) "
            f"minor faults {faults - faults0:8d}  {pname}"
        )
    time.sleep(0.5)  # the engine writes its steps once idle
    steps = [r for line in steps_file.read_text().splitlines() for r in json.loads(line)]
    for line in steps_summary(steps, wall) if steps else ["  (no steps recorded)"]:
        print(line)
    return {"metrics": metrics, "wall_s": wall, "steps": len(steps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workloads", default="c16,c64")
    parser.add_argument("--serve-args", default="", help="more `treadle serve` flags")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="treadle-served-profile-") as tmp_dir:
        tmp = Path(tmp_dir)
        (tmp / "sitecustomize.py").write_text(HOOK)
        steps_file = tmp / "steps.jsonl"
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(tmp), os.environ.get("PYTHONPATH", "")) if p
        )
        os.environ["TREADLE_PROFILE_STEPS"] = str(steps_file)
        server = Server(tmp / "serve.log", args.serve_args.split())
        try:
            server.wait_healthy()
            warm = random_prompts(2, 16, 99)
            asyncio.run(run_benchmark(server.url, DEFAULT_MODEL_NAME, warm, 4, disable_tqdm=True))
            for name in args.workloads.split(","):
                profile(name, server, steps_file)
        except BaseException:
            print(server.output()[-4000:], file=sys.stderr)
            raise
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
