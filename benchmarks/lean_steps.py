"""Decode steps of M rows on the lean runner's model (`LeanModel`), in one process: the layers'
`decode_layers_f32` call and the LM head, per row count, each row at the same context length
(its K/V read from a cache of zeros), median of 20 steps after 5 of warm-up. With `--gate-up`
also the 30 layers' gate|up product alone (576 -> 3072) per row count, as integer-dot
instructions a second (a row of int8x2 is 2 x 576 x 3072 / 64 `vpdpbusd`-sized products per
layer): what docs/performance.md's kernel figures are.

    .venv/bin/python benchmarks/lean_steps.py 1 2 5 16 64 [--context 300] [--threads 2]
        [--activations int8x2] [--gate-up]

The ISA level is this CPU's best or `TREADLE_CPU_ISA`'s; the model is the default GGUF.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from treadle.config import resolve_model
from treadle.model import kernel_lib
from treadle.model.arch_files import read_arch
from treadle.model.gguf_file import GGUFFile
from treadle.model.lean_model import LeanModel
from treadle.worker.lean_worker import _library

BLOCK = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("rows", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--context", type=int, default=300, help="tokens before each row")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--activations", default="int8x2", choices=["int8x2", "int8", "float32"])
    ap.add_argument("--gate-up", action="store_true", help="also the gate|up product alone")
    args = ap.parse_args()
    source = resolve_model(None)
    isa = kernel_lib.select_isa()
    arch = read_arch(source)
    model = LeanModel(
        GGUFFile(source.path), arch, isa, _library(isa), args.activations, args.context + 8
    )
    per_row = args.context // BLOCK + 2
    model.initialize_cache(max(args.rows) * per_row, BLOCK, "float32")
    print(f"ISA {isa}, {args.activations}, {args.threads} threads, context {args.context}")
    rng = np.random.default_rng(0)
    for m in args.rows:
        tables = np.arange(m * per_row, dtype=np.int64).reshape(m, per_row)
        ids = rng.integers(0, model.vocab_size, m).astype(np.int64)
        positions = np.full(m, args.context, np.int64)
        slots = tables[:, args.context // BLOCK] * BLOCK + args.context % BLOCK
        lens = np.full(m, args.context + 1, np.int32)
        layers, head = [], []
        for step in range(25):
            t0 = time.perf_counter()
            hidden = model.forward(ids, positions, slots, tables, lens, args.threads)
            t1 = time.perf_counter()
            model.logits(hidden, args.threads)
            if step >= 5:
                layers.append(t1 - t0)
                head.append(time.perf_counter() - t1)
        a, b = statistics.median(layers) * 1e3, statistics.median(head) * 1e3
        print(f"{m:4d} rows: layers {a:7.2f} ms, LM head {b:6.2f} ms, step {a + b:7.2f} ms")
    if args.gate_up:
        k, n = arch.hidden_size, 2 * arch.intermediate_size
        parts = 2 if args.activations == "int8x2" else 1
        for m in args.rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            y = np.empty((m, n), np.float32)
            times = []
            for _ in range(12):
                t0 = time.perf_counter()
                for layer in model.layers:
                    model._linear(
                        x.ctypes.data, k, m, k, layer.gate_up, layer.gate_up_kind, n,
                        y.ctypes.data, n, args.threads,
                    )  # fmt: skip
                times.append(time.perf_counter() - t0)
            t = statistics.median(times[2:])
            products = len(model.layers) * m * k * n * parts / 64
            print(f"{m:4d} rows gate|up: {t * 1e3:7.2f} ms, {products / t / 1e9:5.2f} G a second")


if __name__ == "__main__":
    main()
