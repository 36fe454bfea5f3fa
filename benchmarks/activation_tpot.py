"""Single-stream TPOT with float32 and with int8 activations (`--cpu-activation-dtype`), side by
side, per ISA level (each level in its own process with TREADLE_CPU_ISA set).

Both engines are loaded in one process (in-process engine cores) and take turns: per round,
each generates one 32-token prompt to 1 token and to 1 + NEW tokens (greedy, ignore_eos); the
difference over NEW is that round's time per output token. Printed: the median over rounds of
the wall time and of the process's CPU time per token (the CPU time does not count the time
the OS gives this process's threads to other work: on a busy machine, run with --threads 1
and read that column), and the ratios float32 / int8.

    .venv/bin/python benchmarks/activation_tpot.py [--isa avx2] [--threads 1] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(threads: int, rounds: int, new_tokens: int) -> dict[str, tuple[float, float]]:
    from treadle import LLM, SamplingParams

    prompt = {"prompt_token_ids": list(range(1000, 1032))}
    engines = {
        act: LLM(dtype="float32", cpu_activation_dtype=act, cpu_threads=threads)
        for act in ("float32", "int8")
    }
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=1 + new_tokens, ignore_eos=True)
    for llm in engines.values():  # warm up
        llm.generate(prompt, many, use_tqdm=False)
    per_token: dict[str, tuple[list[float], list[float]]] = {a: ([], []) for a in engines}
    for _ in range(rounds):
        for act, llm in engines.items():
            spent = []
            for params in (one, many):
                wall, cpu = time.perf_counter(), time.process_time()
                llm.generate(prompt, params, use_tqdm=False)
                spent.append((time.perf_counter() - wall, time.process_time() - cpu))
            per_token[act][0].append((spent[1][0] - spent[0][0]) / new_tokens * 1e3)
            per_token[act][1].append((spent[1][1] - spent[0][1]) / new_tokens * 1e3)
    for llm in engines.values():
        llm.shutdown()
    return {a: (statistics.median(w), statistics.median(c)) for a, (w, c) in per_token.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--isa", default=None, help="one level; default: every level this CPU runs")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.threads, args.rounds, args.new_tokens)))
        return 0
    from treadle.model.cpu_kernels import available_isas
    from treadle.model.linear_method import GGUF_MAX_ROWS

    for isa in [args.isa] if args.isa else available_isas():
        if not GGUF_MAX_ROWS[isa]:
            print(f"\n{isa}: the GGUF blocks are not used at this level; skipped")
            continue
        env = dict(os.environ, TREADLE_CPU_ISA=isa, TREADLE_LOGGING_LEVEL="WARNING")
        env["TREADLE_ENABLE_MULTIPROCESSING"] = "0"
        cmd = [sys.executable, __file__, "--child", "--threads", str(args.threads)]
        cmd += ["--rounds", str(args.rounds), "--new-tokens", str(args.new_tokens)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        r = json.loads(out.stdout.strip().splitlines()[-1])
        (fw, fc), (iw, ic) = r["float32"], r["int8"]
        print(
            f"{isa} ({args.threads} threads, median of {args.rounds}): TPOT wall float32 "
            f"{fw:.2f} ms, int8 {iw:.2f} ms ({fw / iw:.2f}x); CPU time per token float32 "
            f"{fc:.2f} ms, int8 {ic:.2f} ms ({fc / ic:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
