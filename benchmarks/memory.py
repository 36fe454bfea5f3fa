"""Peak memory of a single-stream `treadle serve` beside llama.cpp's `llama-server`, in one run.

Each server starts with the same context (`--max-model-len` / `-c`, 2048 by default) and a KV
cache of that many tokens (treadle: `--kv-cache-memory` sized for them), then serves one
request of `--new-tokens` tokens (greedy, ignore_eos, llama.cpp's `/completion`, which both
serve). Reported per process: VmHWM (peak resident set) and VmRSS after the request, from
/proc/PID/status; for treadle the API server and the engine core separately (two processes,
each with its own PyTorch), and the engine core's start-up memory line. llama.cpp's figures
come from `.peers/llama-server-native` (`make bench-peers`) where it exists.

Target (issue 24): the engine core's peak <= 2x llama-server's.

    .venv/bin/python benchmarks/memory.py [--max-model-len 2048] [--serve-args "..."]
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from peer_bench import LlamaServer  # noqa: E402
from serve_bench import Server  # noqa: E402
from treadle.config import resolve_model  # noqa: E402
from treadle.model.loader import read_arch  # noqa: E402
from treadle.worker.worker import kv_bytes_per_block  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The history of the river city begins with a small market by the water, where"


def vm(pid: int) -> dict[str, float]:
    """VmHWM and VmRSS of a process, MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) / 1024
    return out


def complete(url: str, new_tokens: int) -> int:
    body = {"prompt": PROMPT, "n_predict": new_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as resp:
        answer = json.load(resp)
    return int(answer.get("tokens_predicted", new_tokens))


def treadle_roles(server: Server) -> dict[str, int]:
    """The pids of the API server and the engine core (by process title)."""
    root = psutil.Process(server.proc.pid)
    found = {"APIServer": root.pid}
    for p in root.children(recursive=True):
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        for role in ("APIServer", "EngineCore"):
            if role in title:
                found[role] = p.pid
    return found


def measure_treadle(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    arch = read_arch(resolve_model(None))
    kv = kv_bytes_per_block(arch, "float32", 1) * args.max_model_len
    serve_args = ["--max-model-len", str(args.max_model_len), "--kv-cache-memory", str(kv)]
    server = Server(tmp / "treadle.log", serve_args + shlex.split(args.serve_args))
    try:
        server.wait_healthy()
        tokens = complete(server.url, args.new_tokens)
        time.sleep(0.5)
        result: dict[str, Any] = {role: vm(pid) for role, pid in treadle_roles(server).items()}
        lines = re.findall(r"Memory of this process: .*", server.output())
        result.update(tokens=tokens, kv_cache_mib=kv / 2**20, log=lines[-1] if lines else None)
    finally:
        server.stop()
    return result


def measure_llama(binary: Path, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    gguf = resolve_model(None).path
    extra = args.llama_extra.split()
    server = LlamaServer(binary, gguf, 1, tmp / "llama.log", args.max_model_len, extra=extra)
    try:
        server.wait_healthy()
        tokens = complete(server.url, args.new_tokens)
        time.sleep(0.5)
        return {"llama-server": vm(server.proc.pid), "tokens": tokens}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-model-len", type=int, default=2048, help="and llama.cpp's -c")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--serve-args", default="", help="extra `treadle serve` flags")
    parser.add_argument("--peers", default=str(ROOT / ".peers"), help="where llama-server-* are")
    parser.add_argument("--result-file", default=None, help="the figures as JSON")
    parser.add_argument(
        "--llama-extra", default="", help="more llama-server arguments (e.g. --no-repack)"
    )
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="treadle-memory-") as tmp:
        results["treadle"] = measure_treadle(args, Path(tmp))
        binary = Path(args.peers) / "llama-server-native"
        if binary.exists():
            results["llama.cpp"] = measure_llama(binary, args, Path(tmp))
    t = results["treadle"]
    print(
        f"single stream, context {args.max_model_len}, {t['tokens']} new tokens; "
        f"treadle's KV cache {t['kv_cache_mib']:.0f} MiB (float32)"
    )
    print(f"  engine core's start-up line: {t['log']}")
    rows = [("treadle engine core", t.get("EngineCore")), ("treadle API server", t["APIServer"])]
    llama = results.get("llama.cpp")
    if llama:
        rows.append(("llama-server", llama["llama-server"]))
    for name, fig in rows:
        if fig:
            print(
                f"  {name:20s} peak (VmHWM) {fig['VmHWM']:7.1f} MiB   now {fig['VmRSS']:7.1f} MiB"
            )
    if llama and t.get("EngineCore"):
        ratio = t["EngineCore"]["VmHWM"] / llama["llama-server"]["VmHWM"]
        print(f"  engine core / llama-server peak: {ratio:.2f}x (target <= 2x)")
    else:
        print(f"  (no llama-server at {args.peers}: `make bench-peers` builds it)")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
