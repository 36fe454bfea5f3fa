"""Soak: `treadle serve` (default model) under steady mixed load; does any process's memory grow?

Runs `--concurrency` clients for `--minutes`, each sending one request after another: chat and
completions, streamed and not, prompts of random text (so the prefix cache churns), 8-160 new
tokens, some with logprobs, `n=2`, stop strings, seeds or JSON-schema structured outputs. Every
`--sample-s` seconds it records the RSS of the API server and the engine core (psutil), and
prints a line. At the end: each process's RSS at 1 minute, at 5 minutes and at the end, the
growth after minute 5 (target: within 5% over 30 minutes, issue 28), and the requests done.

    .venv/bin/python benchmarks/soak.py --minutes 30 --concurrency 32 [--serve-args "..."]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")

import httpx  # noqa: E402
import psutil  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from serve_bench import Server  # noqa: E402

WORDS = [
    "the",
    "a",
    "river",
    "mountain",
    "city",
    "engine",
    "token",
    "stream",
    "model",
    "cache",
    "block",
    "prefix",
    "request",
    "server",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "seven",
    "blue",
    "green",
    "paper",
    "window",
    "garden",
    "music",
    "history",
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def request_body(rng: random.Random, model: str) -> tuple[str, dict[str, Any]]:
    """One random request: (path, JSON body)."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 300)))
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": rng.randint(8, 160),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "stream": rng.random() < 0.6,
    }
    kind = rng.random()
    if kind < 0.1:
        body["seed"] = rng.randint(0, 1000)
    elif kind < 0.2:
        body["n"] = 2
    elif kind < 0.3:
        body["stop"] = ["river", "\n\n"]
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": text}]
        if rng.random() < 0.15:
            body["logprobs"], body["top_logprobs"] = True, 3
        elif rng.random() < 0.1:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA},
            }
        return "/v1/chat/completions", body
    body["prompt"] = text
    if rng.random() < 0.15:
        body["logprobs"] = 2
    return "/v1/completions", body


async def client_loop(
    url: str, model: str, seed: int, deadline: float, counts: defaultdict[str, int]
) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        while time.monotonic() < deadline:
            path, body = request_body(rng, model)
            try:
                if body["stream"]:
                    async with http.stream("POST", path, json=body) as resp:
                        async for _ in resp.aiter_lines():
                            pass
                        status = resp.status_code
                else:
                    status = (await http.post(path, json=body)).status_code
            except httpx.HTTPError as e:
                counts["errors"] += 1
                print(f"client {seed}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            counts["ok" if status == 200 else f"http_{status}"] += 1


def processes(server: Server) -> dict[str, psutil.Process]:
    found = {}
    for p in [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(True)]:
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        for role in ("APIServer", "EngineCore"):
            if role in title:
                found[role] = p
    found.setdefault("APIServer", psutil.Process(server.proc.pid))  # one API server: the CLI
    return found


async def soak(server: Server, minutes: float, concurrency: int, sample_s: float) -> dict:
    url = server.url
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    procs = processes(server)
    counts: defaultdict[str, int] = defaultdict(int, ok=0, errors=0)
    start = time.monotonic()
    deadline = start + minutes * 60
    tasks = [
        asyncio.create_task(client_loop(url, model, i, deadline, counts))
        for i in range(concurrency)
    ]
    samples: list[dict[str, float]] = []
    while time.monotonic() < deadline:
        await asyncio.sleep(sample_s)
        row = {"t": time.monotonic() - start, "done": float(counts["ok"])}
        for role, p in procs.items():
            row[role] = p.memory_info().rss / 2**20
        samples.append(row)
        print(
            f"t={row['t']:7.0f} s  requests ok {counts['ok']:6d}  "
            + "  ".join(f"{r} RSS {row[r]:8.1f} MiB" for r in procs),
            flush=True,
        )
    await asyncio.gather(*tasks)
    return {"samples": samples, "counts": dict(counts)}


def at(samples: list[dict[str, float]], t: float, role: str) -> float:
    return min(samples, key=lambda s: abs(s["t"] - t))[role]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sample-s", type=float, default=15)
    parser.add_argument("--serve-args", default="", help="extra `treadle serve` flags")
    parser.add_argument("--result-file", default=None, help="every sample as JSON")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with tempfile.TemporaryDirectory(prefix="treadle-soak-") as tmp:
        server = Server(Path(tmp) / "server.log", shlex.split(args.serve_args))
        try:
            print(f"server healthy after {server.wait_healthy():.1f} s at {server.url}")
            result = asyncio.run(soak(server, args.minutes, args.concurrency, args.sample_s))
        except BaseException:
            print(server.output()[-4000:], file=sys.stderr)
            raise
        finally:
            server.stop()
    samples = result["samples"]
    print(f"\n{args.minutes:g} min at concurrency {args.concurrency}: {result['counts']}")
    end = samples[-1]["t"]
    for role in ("APIServer", "EngineCore"):
        five = at(samples, min(300.0, end / 2), role)
        print(
            f"  {role:10s} RSS at 1 min {at(samples, 60, role):8.1f} MiB, at 5 min {five:8.1f}, "
            f"at the end {samples[-1][role]:8.1f}: {100 * (samples[-1][role] / five - 1):+.1f}% "
            "after 5 min (target within 5%)"
        )
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
