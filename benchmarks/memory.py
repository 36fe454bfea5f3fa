"""Memory of a single-stream `treadle serve`, every process of its tree, beside llama.cpp's
`llama-server`, in one run.

Each server starts with the same context (`--max-model-len` / `-c`, 2048 by default) and a KV
cache of that many tokens (treadle: `--kv-cache-memory` sized for them), then serves one
request of `--new-tokens` tokens (greedy, ignore_eos, llama.cpp's `/completion`, which both
serve). Every process of each server's tree (treadle: the API server, the engine core, the
multiprocessing resource tracker, a DP coordinator or workers when the flags start them) is
read from /proc/PID/smaps_rollup: RSS, and PSS (a page shared by N processes counts 1/N in
each, so the tree's PSS sum counts the Python binary and shared libraries once), idle after
start-up and at their highest while the stream runs (sampled every 20 ms), and VmHWM (the
kernel's own peak RSS) from /proc/PID/status. The tree's totals are what a user's machine
holds. llama.cpp's figures come from `.peers/llama-server-native` (`make bench-peers`) where
it exists.

Targets (issue 41): the tree's peak <= 2x llama-server's; the API server's idle RSS <= 150 MiB.

    .venv/bin/python benchmarks/memory.py [--max-model-len 2048] [--serve-args "..."]
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from peer_bench import LlamaServer  # noqa: E402
from serve_bench import Server  # noqa: E402
from treadle.config import resolve_model  # noqa: E402
from treadle.ipc.memory import MIB, process_memory  # noqa: E402
from treadle.model.arch_files import read_arch  # noqa: E402
from treadle.worker.start_checks import kv_bytes_per_block  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The history of the river city begins with a small market by the water, where"
Figures = dict[str, dict[str, float]]  # process name -> {rss, pss, peak_rss, peak_pss, hwm}


def complete(url: str, new_tokens: int) -> int:
    body = {"prompt": PROMPT, "n_predict": new_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as resp:
        answer = json.load(resp)
    return int(answer.get("tokens_predicted", new_tokens))


def _name(proc: psutil.Process) -> str:
    try:
        cmdline = proc.cmdline()
    except psutil.Error:
        return f"pid {proc.pid}"
    title = cmdline[0] if cmdline else ""
    if title.startswith("treadle::"):
        return title.removeprefix("treadle::").strip()
    if any("resource_tracker" in part for part in cmdline):
        return "resource tracker"
    return Path(title).name or f"pid {proc.pid}"


def _hwm(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def look(root: int) -> dict[int, tuple[str, float, float]]:
    """pid -> (name, RSS MiB, PSS MiB) for `root` and all its descendants alive now."""
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return {}
    out = {}
    for proc in procs:
        memory = process_memory(proc.pid)
        if memory is not None:
            out[proc.pid] = (_name(proc), memory.rss / MIB, memory.pss / MIB)
    return out


def measure_tree(root: int, load: Callable[[], int]) -> tuple[Figures, dict[str, float], int]:
    """Each process's idle RSS/PSS, its highest while `load()` runs, and its VmHWM; the tree's
    totals (idle, and the highest sum seen at one moment); what `load` returned."""
    idle = look(root)
    peaks = {pid: [rss, pss] for pid, (_, rss, pss) in idle.items()}
    names = {pid: name for pid, (name, _, _) in idle.items()}
    tree_peak = [sum(v[1] for v in idle.values()), sum(v[2] for v in idle.values())]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            now = look(root)
            tree_peak[0] = max(tree_peak[0], sum(v[1] for v in now.values()))
            tree_peak[1] = max(tree_peak[1], sum(v[2] for v in now.values()))
            for pid, (name, rss, pss) in now.items():
                names.setdefault(pid, name)
                peak = peaks.setdefault(pid, [0.0, 0.0])
                peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = load()
    finally:
        done.set()
        sampler.join()
    figures: Figures = {}
    for pid, name in names.items():
        _, rss, pss = idle.get(pid, (name, 0.0, 0.0))
        key = name if name not in figures else f"{name} ({pid})"
        figures[key] = {
            "rss": rss,
            "pss": pss,
            "peak_rss": peaks[pid][0],
            "peak_pss": peaks[pid][1],
            "hwm": _hwm(pid),
        }
    totals = {
        "rss": sum(v[1] for v in idle.values()),
        "pss": sum(v[2] for v in idle.values()),
        "peak_rss": tree_peak[0],
        "peak_pss": tree_peak[1],
        "hwm": sum(f["hwm"] for f in figures.values()),
    }
    return figures, totals, result


def measure_treadle(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    arch = read_arch(resolve_model(None))
    kv = kv_bytes_per_block(arch, "float32", 1) * args.max_model_len
    serve_args = ["--max-model-len", str(args.max_model_len), "--kv-cache-memory", str(kv)]
    server = Server(tmp / "treadle.log", serve_args + shlex.split(args.serve_args))
    try:
        server.wait_healthy()
        deadline = time.monotonic() + 30  # the API server says its idle memory once serving
        while "Idle memory:" not in server.output() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        figures, totals, tokens = measure_tree(
            server.proc.pid, lambda: complete(server.url, args.new_tokens)
        )
        lines = re.findall(r"Idle memory: .*", server.output())
    finally:
        server.stop()
    return {
        "processes": figures,
        "tree": totals,
        "tokens": tokens,
        "kv_cache_mib": kv / MIB,
        "log": lines[-1] if lines else None,
    }


def measure_llama(binary: Path, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    gguf = resolve_model(None).path
    extra = args.llama_extra.split()
    server = LlamaServer(binary, gguf, 1, tmp / "llama.log", args.max_model_len, extra=extra)
    try:
        server.wait_healthy()
        time.sleep(0.5)
        figures, totals, tokens = measure_tree(
            server.proc.pid, lambda: complete(server.url, args.new_tokens)
        )
    finally:
        server.stop()
    return {"processes": figures, "tree": totals, "tokens": tokens}


def print_table(name: str, result: dict[str, Any]) -> None:
    print(f"  {name}: MiB       idle RSS   idle PSS   stream RSS  stream PSS   VmHWM")
    rows = [*result["processes"].items(), ("whole tree", result["tree"])]
    for proc, f in rows:
        print(
            f"    {proc:22s} {f['rss']:8.1f}   {f['pss']:8.1f}   {f['peak_rss']:9.1f}"
            f"   {f['peak_pss']:9.1f}   {f['hwm']:7.1f}"
        )


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
    print(f"  API server's start-up line: {t['log']}")
    print_table("treadle", t)
    llama = results.get("llama.cpp")
    if llama:
        print_table("llama-server", llama)
        for key, what in (("peak_pss", "stream PSS"), ("hwm", "VmHWM")):
            ratio = t["tree"][key] / llama["tree"][key]
            print(f"  treadle's tree / llama-server's, {what}: {ratio:.2f}x (target <= 2x)")
    else:
        print(f"  (no llama-server at {args.peers}: `make bench-peers` builds it)")
    api = next((f for name, f in t["processes"].items() if name.startswith("APIServer_")), None)
    if api:
        print(f"  API server idle RSS {api['rss']:.1f} MiB (target <= 150)")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
