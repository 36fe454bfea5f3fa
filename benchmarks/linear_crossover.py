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

`--variant LABEL=REF[:DEFINES]` (repeatable) instead times the blocks' kernel alone (float32 or,
with `--int8`, int8 activations) as built from the `csrc/` of git ref REF (`.`: the working
tree), with extra -D flags (e.g. `new=.:-DFEW_MAX_ROWS=16`, `old=main`), all variants
alternating in one process, and prints each one's ms per call set and its ratio to the first:
before/after, and the few-rows/tile-GEMM crossover (`FEW_MAX_ROWS`, `I8_MAX_ROWS`).

    .venv/bin/python benchmarks/linear_crossover.py --isa avx2 --rows 1,2,3,5,9 \
        --variant old=main --variant new=.

With `--decode-steps`, the variants run whole decode steps of the default model instead: the
fused decode call of M rows (M requests of 64 tokens of context, as a speculative step of one
request verifies k + 1 rows) and the LM head, each variant's model in turn, the fastest round
(a round: the median of 5 steps) per variant and M; printed with the cost relative to the same
variant's 1-row step and the ratio to the first variant at the same M. `--activations int8x2`
runs the default activations there (`--int8`: int8), and `--one-request --context N` makes the
M rows one request's last M positions of N tokens (a speculative verify step).

    .venv/bin/python benchmarks/linear_crossover.py --decode-steps --threads 1 --repeats 3 \
        --rows 1,2,3,5,9 --variant old=main --variant new=.
    .venv/bin/python benchmarks/linear_crossover.py --decode-steps --activations int8x2 \
        --one-request --context 512 --rows 1,5,9 --variant old=HEAD --variant new=.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

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
            linear_method.GGUFLinear(
                int8, linear_method.for_activations(quant, int8), dense, 1 << 20
            ),
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


def build_variant(isa: str, ref: str, defines: list[str], into: str) -> str:
    """The kernels' library for `isa` from the csrc/ of git ref `ref` ('.': the working tree),
    compiled with the level's flags and `defines` into the directory `into`."""
    from treadle.model import kernel_build as kb

    src = Path(into) / f"src-{len(os.listdir(into))}"
    src.mkdir()
    for name in kb.SOURCES:
        if ref == ".":
            text = (kb.CSRC / name).read_text()
        else:
            shown = subprocess.run(
                ["git", "show", f"{ref}:src/treadle/model/csrc/{name}"],
                capture_output=True, text=True, cwd=kb.CSRC,
            )  # fmt: skip
            if shown.returncode != 0:  # a header that ref does not have (nor include)
                continue
            text = shown.stdout
        (src / name).write_text(text)
    out = src / "kernel.so"
    cc, _ = kb.compiler()
    flags = kb.LEVEL_CC_FLAGS[isa][0]
    cmd = [cc, *kb.COMMON_CC_FLAGS, *flags, *defines, str(src / "cpu_kernels.c"), "-o", str(out)]
    subprocess.run(cmd, check=True)
    return str(out)


def measure_variants(
    isa: str, threads: int, repeats: int, rows_list: list[int], variants: list[str], int8: bool
) -> dict[str, dict[str, dict[int, float]]]:
    """In this process: {shape set: {label: {rows: median ms}}}, the variants alternating."""
    import tempfile

    import numpy as np
    import torch

    from treadle.model import linear_method
    from treadle.model.cpu_kernels import Kernels
    from treadle.model.quantized import GGUFBlocks, QuantizedWeight

    torch.set_num_threads(threads)
    libs: dict[str, Kernels] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in variants:
            label, _, rest = spec.partition("=")
            ref, _, defines = rest.partition(":")
            kernels = Kernels(isa, Path(build_variant(isa, ref, defines.split(), tmp)))
            libs[label] = kernels.with_activations("int8") if int8 else kernels
    rng = np.random.default_rng(0)

    def quant(k: int, n: int, kind: str) -> QuantizedWeight:
        nbytes = 20 if kind == "Q4_1" else 34
        raw = rng.integers(0, 256, (n, k // 32, nbytes), dtype=np.uint8)
        raw[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        if kind == "Q4_1":
            raw[..., 2:4] = np.frombuffer(np.float16(-0.05).tobytes(), np.uint8)
        q = QuantizedWeight.build([GGUFBlocks(kind, raw.reshape(n, -1))], n, torch.device("cpu"))
        assert q is not None
        return q

    results: dict[str, dict[str, dict[int, float]]] = {}
    for label, shapes in (("layer", LAYER), ("lm_head", HEAD)):
        quants = [quant(*s) for s in shapes]
        # as each variant's kernels take them (int8: 16 wide where the library runs that)
        laid_out = {
            v: [linear_method.for_activations(q, kernels) for q in quants]
            for v, kernels in libs.items()
        }
        results[label] = {v: {} for v in libs}
        for rows in rows_list:
            xs = [torch.randn(rows, s[0]) for s in shapes]
            times: dict[str, list[float]] = {v: [] for v in libs}
            for _ in range(repeats):
                for v, kernels in libs.items():  # alternate: all see the same machine
                    start = time.perf_counter()
                    for _ in range(5):
                        for q, x in zip(laid_out[v], xs, strict=True):
                            linear_method.on_blocks(kernels, q, x, None)
                    times[v].append((time.perf_counter() - start) / 5 * 1e3)
            for v in libs:
                results[label][v][rows] = statistics.median(times[v])
    return results


def measure_decode_steps(
    isa: str,
    threads: int,
    repeats: int,
    rows_list: list[int],
    variants: list[str],
    int8: bool = False,
    context: int = 64,
    one_request: bool = False,
    activations: str | None = None,
    clock: str = "wall",
) -> dict[str, dict[int, float]]:
    """In this process: {variant: {rows: ms}}, the fastest of `repeats` rounds (each round's
    median of 5 steps), the variants' models taking turns per step size. `clock` "cpu": the
    process's CPU time (on a loaded machine, with one thread: what the step computes, not
    how long it waited for a core; with more threads it counts their spinning too)."""
    import tempfile

    import torch

    from treadle.config import resolve_model
    from treadle.model import cpu_kernels
    from treadle.model.attention import AttentionMetadata
    from treadle.model.cpu_kernels import Kernels
    from treadle.model.loader import load_model, read_arch

    torch.set_num_threads(threads)
    source = resolve_model(None)
    arch = read_arch(source)
    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in variants:
            label, _, rest = spec.partition("=")
            ref, _, defines = rest.partition(":")
            lib = build_variant(isa, ref, defines.split(), tmp)
            cpu_kernels._selected[:] = [Kernels(isa, Path(lib))]  # what the model loads
            models[label] = load_model(
                source,
                arch,
                torch.float32,
                torch.device("cpu"),
                2048,
                activations or ("int8" if int8 else "float32"),
            )
    first = next(iter(models.values()))
    block, ctx = 16, context  # each request: `context` tokens on its own blocks
    per = -(-ctx // block)
    shape = (first.num_kv_heads, per * max(rows_list), block, first.head_dim)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(first.num_layers)]

    now = time.process_time if clock == "cpu" else time.perf_counter

    def step(model, m: int) -> float:  # type: ignore[no-untyped-def]
        if one_request:  # a speculative step: one request's last m positions, its blocks
            table = torch.arange(per).expand(m, per)
            last = torch.arange(ctx - m, ctx)
            slots, lens = last, (last + 1).to(torch.int32)
        else:
            table = torch.arange(per * m).view(m, per)
            slots = table[:, -1] * block + (ctx - 1) % block
            lens, last = torch.full((m,), ctx, dtype=torch.int32), torch.full((m,), ctx - 1)
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decodes=m,
            decode_block_table=table,
            decode_lens=lens,
            decode_max_len=ctx,
        )
        ids, positions = torch.arange(1000, 1000 + m), last
        start = now()
        with torch.inference_mode():
            model.compute_logits(model(ids, positions, caches, meta))
        return now() - start

    best: dict[str, dict[int, float]] = {v: {m: float("inf") for m in rows_list} for v in models}
    order = list(models.items())
    for i in range(repeats):
        for m in rows_list:
            # each round in a turned order: the one that runs first (or last) in a round
            # was seen to be several percent faster on a loaded machine
            for v, model in order[i % len(order) :] + order[: i % len(order)]:
                step(model, m)  # warm
                ms = statistics.median(step(model, m) for _ in range(5)) * 1e3
                best[v][m] = min(best[v][m], ms)
    return best


def print_decode_steps(isa: str, threads: int, results: dict, rows_list: list[int]) -> None:
    labels = list(results)
    print(f"\n{isa} ({threads} threads): ms per decode step of M rows (x: vs the same "
          f"variant's 1-row step; /{labels[0]}: vs {labels[0]} at the same M)")  # fmt: skip
    print(f"{'M':>3s}" + "".join(f" {v:>9s} {'x':>5s} {'/' + labels[0]:>6s}" for v in labels))
    for m in rows_list:
        line = f"{m:3d}"
        for v in labels:
            ms, one = results[v][str(m)], results[v][str(rows_list[0])]
            line += f" {ms:9.2f} {ms / one:5.2f} {ms / results[labels[0]][str(m)]:6.2f}"
        print(line)


def print_variants(isa: str, threads: int, results: dict, rows_list: list[int]) -> None:
    labels = list(results["layer"])
    print(f"\n{isa} ({threads} threads, median wall time): ms per call set, ratio to {labels[0]}")
    head = "".join(f" {'layer ' + v:>14s} {'x':>5s}" for v in labels)
    head += "".join(f" {'head ' + v:>14s} {'x':>5s}" for v in labels)
    print(f"{'rows':>5s}{head}")
    for rows in rows_list:
        line = f"{rows:5d}"
        for label in ("layer", "lm_head"):
            base = results[label][labels[0]][str(rows)]
            for v in labels:
                ms = results[label][v][str(rows)]
                line += f" {ms:14.3f} {ms / base:5.2f}"
        print(line)


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
    parser.add_argument("--variant", action="append", default=[], help="LABEL=REF[:DEFINES]")
    parser.add_argument(
        "--int8", action="store_true", help="variants (and decode steps): int8 activations"
    )
    parser.add_argument(
        "--activations",
        choices=["float32", "int8", "int8x2"],
        default=None,
        help="decode steps: the linear layers' activations (default float32; --int8: int8)",
    )
    parser.add_argument("--decode-steps", action="store_true", help="variants: model steps")
    parser.add_argument(
        "--context", type=int, default=64, help="decode steps: each row's tokens of context"
    )
    parser.add_argument(
        "--one-request",
        action="store_true",
        help="decode steps: the M rows are one request's last M positions (a speculative step)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child and args.decode_steps:
        rows_list = [int(r) for r in args.rows.split(",")]
        steps = measure_decode_steps(
            args.isa,
            args.threads,
            args.repeats,
            rows_list,
            args.variant,
            args.int8,
            args.context,
            args.one_request,
            args.activations,
            args.clock,
        )
        print(json.dumps(steps))
        return 0
    if args.child and args.variant:
        rows_list = [int(r) for r in args.rows.split(",")]
        found = measure_variants(
            args.isa, args.threads, args.repeats, rows_list, args.variant, args.int8
        )
        print(json.dumps(found))
        return 0
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
        cmd += [f"--variant={v}" for v in args.variant] + (["--int8"] if args.int8 else [])
        if args.decode_steps:
            cmd += ["--decode-steps", "--context", str(args.context)]
            cmd += ["--one-request"] if args.one_request else []
            cmd += ["--activations", args.activations] if args.activations else []
        out = subprocess.run(
            cmd + ["--repeats", str(args.repeats)], env=env, capture_output=True, text=True
        )
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        results = json.loads(out.stdout)
        if args.decode_steps:
            print_decode_steps(isa, args.threads, results, [int(r) for r in args.rows.split(",")])
            continue
        if args.variant:
            print_variants(isa, args.threads, results, [int(r) for r in args.rows.split(",")])
            continue
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
