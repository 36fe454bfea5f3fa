"""Where the GGUF-block kernel stops beating oneDNN's packed float32 GEMM, per ISA level, and
what int8 activations (`--cpu-activation-dtype int8`) gain on the blocks.

For the default model's linear shapes (one decoder layer's qkv, o, gate_up and down projections,
Q4_1 blocks, and the Q8_0 LM head), times a step's worth of products at 1 to 128 rows on the
blocks with float32 activations (`GGUFLinear`), on the blocks with int8 activations, and on
oneDNN's packed weight (`PackedLinear`), alternating the three so that all see the same
machine, and prints the ratios per row count. Each level runs in its own
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


def measure(
    isa: str,
    threads: int,
    repeats: int,
    rows_list: list[int],
    stat: str = "median",
    clock: str = "wall",
) -> dict[str, dict[int, tuple[float, float, float]]]:
    """In this process (TREADLE_CPU_ISA already set):
    {shape set: {rows: (blocks ms, int8 blocks ms, packed ms)}}."""
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
        int8 = kernels.with_activations("int8")
        return (
            linear_method.GGUFLinear(kernels, quant, dense, 1 << 20),
            linear_method.GGUFLinear(int8, quant, dense, 1 << 20),
            dense,
        )

    # cpu: this process's CPU time, blind to the time the OS gives its threads to others (a
    # busy machine), but it also counts threads that spin: use it with --threads 1
    now = time.process_time if clock == "cpu" else time.perf_counter
    results: dict[str, dict[int, tuple[float, float, float]]] = {}
    for label, shapes in (("layer", LAYER), ("lm_head", HEAD)):
        pairs = [methods(*s) for s in shapes]
        results[label] = {}
        for rows in rows_list:
            xs = [torch.randn(rows, s[0]) for s in shapes]
            times: tuple[list[float], ...] = ([], [], [])
            for _ in range(repeats):
                for which in (0, 1, 2):  # alternate: all see the same machine
                    start = now()
                    for _ in range(5):
                        for pair, x in zip(pairs, xs, strict=True):
                            pair[which].apply(x, None)
                    times[which].append((now() - start) / 5 * 1e3)
            pick = min if stat == "min" else statistics.median
            results[label][rows] = (pick(times[0]), pick(times[1]), pick(times[2]))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--isa", default=None, help="one level; default: every level this CPU runs")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: see measure")
    parser.add_argument(
        "--stat", choices=["median", "min"], default="median", help="min: on a busy machine"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        rows_list = [int(r) for r in args.rows.split(",")]
        print(
            json.dumps(
                measure(args.isa, args.threads, args.repeats, rows_list, args.stat, args.clock)
            )
        )
        return 0
    from treadle.model.cpu_kernels import available_isas

    for isa in [args.isa] if args.isa else available_isas():
        env = dict(os.environ, TREADLE_CPU_ISA=isa, TREADLE_LOGGING_LEVEL="WARNING")
        cmd = [sys.executable, __file__, "--child", "--isa", isa, "--threads", str(args.threads)]
        cmd += ["--rows", args.rows, "--stat", args.stat, "--clock", args.clock]
        out = subprocess.run(
            cmd + ["--repeats", str(args.repeats)], env=env, capture_output=True, text=True
        )
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        results = json.loads(out.stdout)
        print(
            f"\n{isa} ({args.threads} threads, {args.stat} {args.clock} time): ms per call set; GGUF blocks (float32 "
            "activations), blocks with int8 activations, oneDNN packed; ratios: blk/int8, "
            "packed/blk"
        )
        print(f"{'rows':>5s}  {'layer blk':>9s} {'int8':>7s} {'packed':>7s} {'b/i8':>5s} "
              f"{'p/b':>5s}   {'head blk':>8s} {'int8':>7s} {'packed':>7s} {'b/i8':>5s} "
              f"{'p/b':>5s}")  # fmt: skip
        for rows in [int(r) for r in args.rows.split(",")]:
            lb, li, lp = results["layer"][str(rows)]
            hb, hi, hp = results["lm_head"][str(rows)]
            print(
                f"{rows:5d}  {lb:9.3f} {li:7.3f} {lp:7.3f} {lb / li:5.2f} {lp / lb:5.2f}   "
                f"{hb:8.3f} {hi:7.3f} {hp:7.3f} {hb / hi:5.2f} {hp / hb:5.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
