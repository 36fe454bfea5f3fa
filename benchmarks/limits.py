"""What this machine allows, measured in the same run as the figures compared against it
(issue 24 item 8):

- memory bandwidth: a STREAM-like read (sum) of 1 GiB of float32 on `threads` threads, best of
  five; single-stream decode reads every weight once per token, so bytes per token / bandwidth
  is the fastest a token can be;
- compute peak: float32 GEMM (2048^3, best of five) on the same threads; batched decode does
  2 x parameters FLOPs per token.

`python benchmarks/limits.py` prints both for this machine.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from treadle.config import resolve_model
from treadle.model.gguf_file import GGUFFile


def read_bandwidth(threads: int, gib: float = 1.0) -> float:
    """Bytes per second that `threads` threads read (a sum over `gib` GiB of float32)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - start)
        return data.numel() * 4 / best
    finally:
        torch.set_num_threads(before)


def float32_peak(threads: int, n: int = 2048) -> float:
    """FLOP/s of a float32 n x n x n GEMM on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm up
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        return 2 * n**3 / best
    finally:
        torch.set_num_threads(before)


def model_bytes_and_params(gguf: str) -> tuple[int, int]:
    """Bytes a decode step reads (every tensor of the GGUF once: the tied embedding is the LM
    head) and the parameter count."""
    tensors = GGUFFile(gguf).tensors
    return sum(t.data.nbytes for t in tensors), sum(math.prod(t.shape) for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    bw = read_bandwidth(args.threads)
    peak = float32_peak(args.threads)
    nbytes, params = model_bytes_and_params(resolve_model(None).path)
    print(f"read bandwidth, {args.threads} threads: {bw / 1e9:.1f} GB/s")
    print(f"float32 GEMM peak, {args.threads} threads: {peak / 1e9:.0f} GFLOP/s")
    print(
        f"default model: {nbytes / 1e6:.1f} MB read per token -> at most "
        f"{bw / nbytes:.0f} tok/s single stream ({nbytes / bw * 1e3:.2f} ms a token); "
        f"{params / 1e6:.0f}M parameters -> at most {peak / (2 * params):.0f} tok/s batched"
    )


if __name__ == "__main__":
    main()
