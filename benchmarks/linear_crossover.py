"""Where the GGUF-block kernel stops beating oneDNN's packed float32 GEMM, per ISA level.

For the default model's linear shapes (one decoder layer's qkv, o, gate_up and down projections,
Q4_1 blocks, and the Q8_0 LM head), times a step's worth of products at 1 to 128 rows on the
blocks (`GGUFLinear`) and on oneDNN's packed weight (`PackedLinear`), alternating the two so that
both see the same machine, and prints the ratio per row count. Each level runs in its own
process with TREADLE_CPU_ISA set, so that oneDNN and PyTorch are capped at the same level
(`envs.apply_cpu_isa_caps`). `linear_method.GGUF_MAX_ROWS` holds the crossovers measured here
and in the engine.

    .venv/bin/python benchmarks/linear_crossover.py [--isa avx2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROWS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128]
# (in, out, GGUF type) of the default model (SmolLM2-135M): qkv, o, gate_up, down; LM head.
LAYER = [(576, 960, "Q4_1"), (576, 576, "Q4_1"), (576, 3072, "Q4_1"), (1536, 576, "Q4_1")]
HEAD = [(576, 49152, "Q8_0")]


def measure(isa: str, threads: int, repeats: int) -> dict[str, dict[int, tuple[float, float]]]:
    """In this process (TREADLE_CPU_ISA already set): {shape set: {rows: (blocks ms, packed ms)}}."""
    import numpy as np
    import torch

    from treadle.model import cpu_kernels, linear_method
    from treadle.model.quantized import GGUFBlocks, QuantizedWeight

    torch.set_num_threads(threads)
    kernels = cpu_kernels.kernels_for(isa)
    rng = np.random.default_rng(0)

    def methods(k: int, n: int, kind: str) -> tuple[linear_method.LinearMethod, ...]:
        nbytes = 20 if kind == "Q4_1" else 34
        raw = rng.integers(0, 256, (n, k // 32, nbytes), dtype=np.uint8)
        raw[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # sane scales
        if kind == "Q4_1":
            raw[..., 2:4] = np.frombuffer(np.float16(-0.05).tobytes(), np.uint8)
        quant = QuantizedWeight.build(
            [GGUFBlocks(kind, raw.reshape(n, -1))], n, torch.device("cpu")
        )
        assert quant is not None
        weight = torch.randn(n, k) * 0.02
        packed = linear_method.pack_weight(weight)
        assert packed is not None, "oneDNN packing is unavailable here"
        dense = linear_method.PackedLinear(weight, packed)
        return linear_method.GGUFLinear(kernels, quant, dense, 1 << 20), dense

    results: dict[str, dict[int, tuple[float, float]]] = {}
    for label, shapes in (("layer", LAYER), ("lm_head", HEAD)):
        pairs = [methods(*s) for s in shapes]
        results[label] = {}
        for rows in ROWS:
            xs = [torch.randn(rows, s[0]) for s in shapes]
            times: tuple[list[float], list[float]] = ([], [])
            for _ in range(repeats):
                for which in (0, 1):  # alternate: both see the same machine
                    start = time.perf_counter()
                    for _ in range(5):
                        for pair, x in zip(pairs, xs, strict=True):
                            pair[which].apply(x, None)
                    times[which].append((time.perf_counter() - start) / 5 * 1e3)
            results[label][rows] = (statistics.median(times[0]), statistics.median(times[1]))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--isa", default=None, help="one level; default: every level this CPU runs")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.isa, args.threads, args.repeats)))
        return 0
    from treadle.model.cpu_kernels import available_isas

    for isa in [args.isa] if args.isa else available_isas():
        env = dict(os.environ, TREADLE_CPU_ISA=isa, TREADLE_LOGGING_LEVEL="WARNING")
        cmd = [sys.executable, __file__, "--child", "--isa", isa, "--threads", str(args.threads)]
        out = subprocess.run(
            cmd + ["--repeats", str(args.repeats)], env=env, capture_output=True, text=True
        )
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        results = json.loads(out.stdout)
        print(f"\n{isa} ({args.threads} threads): ms per call set, GGUF blocks vs oneDNN packed")
        print(f"{'rows':>5s}  {'layer blk':>9s} {'packed':>8s} {'ratio':>6s}   "
              f"{'head blk':>9s} {'packed':>8s} {'ratio':>6s}")  # fmt: skip
        for rows in ROWS:
            lb, lp = results["layer"][str(rows)]
            hb, hp = results["lm_head"][str(rows)]
            print(
                f"{rows:5d}  {lb:9.3f} {lp:8.3f} {lp / lb:6.2f}   {hb:9.3f} {hp:8.3f} {hp / hb:6.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
