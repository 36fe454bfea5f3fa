"""Decode steps of M rows with the default activations (int8x2), kernels built from two git refs,
alternating in one process: `linear_crossover.py --decode-steps` with int8x2 instead of int8.

    .venv/bin/python benchmarks/decode_ab.py --rows 16,64 --context 192 \
        --variant old=HEAD --variant new=.

Prints each variant's fastest round (median of 5 steps: the fused layer stack and the LM head)
per M and its ratio to the first variant. Run it with TREADLE_CPU_ISA=avx2 for that level.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import linear_crossover  # noqa: E402
from treadle.model import loader  # noqa: E402
from treadle.model.cpu_kernels import select_isa  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="16,64")
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--variant", action="append", default=[], help="LABEL=REF[:DEFINES]")
    args = parser.parse_args()
    load = loader.load_model

    def load_int8x2(*a, **k):  # type: ignore[no-untyped-def]
        return load(*a[:-1], "int8x2", **k)

    loader.load_model = load_int8x2  # type: ignore[assignment]
    rows = [int(r) for r in args.rows.split(",")]
    isa = select_isa()
    best = linear_crossover.measure_decode_steps(
        isa, args.threads, args.repeats, rows, args.variant, True, args.context
    )
    labels = list(best)
    print(f"ISA {isa}, int8x2, {args.threads} threads, context {args.context}")
    for m in rows:
        base = best[labels[0]][m]
        cells = "  ".join(f"{v} {best[v][m]:8.2f} ms ({best[v][m] / base:.3f})" for v in labels)
        print(f"M={m:3d}  {cells}")


if __name__ == "__main__":
    main()
