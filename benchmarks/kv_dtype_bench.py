"""Decode time per output token at long context for each `--kv-cache-dtype` (issue 24 item 3),
side by side, per ISA level (each level in its own process with TREADLE_CPU_ISA set).

At a few thousand tokens of context a single-stream decode step reads more KV cache than
weights (the default model: 45 KiB of float32 K and V per token, so 176 MiB at 4,000 tokens,
against ~96 MB of GGUF weights), so a 16-bit cache should cut the step by about a quarter to a
third and int8 a little more. One engine per dtype is loaded in one process (in-process engine
cores) and they take turns: per round and context length, each generates the same prompt to 1
token and to 1 + NEW tokens (greedy, ignore_eos; the prompt's blocks are prefix-cache hits
after the warm-up, so both calls prefill the same few tokens); the difference over NEW is that
round's time per output token. First the attention kernel alone (`measure_kernel`: the KV
bytes it reads, nothing else), then the engines. Printed per context: the KV bytes per token,
the median over rounds of the wall and CPU time per token, and each dtype's ratio to float32.
CPU time is the steadier on a shared machine (it does not count time the OS gave to other
processes); with --threads 1 (the default) it is the CPU time of the thread that runs the
model, where every kernel runs (the process's total also counts the other engines' idle
threads).

    .venv/bin/python benchmarks/kv_dtype_bench.py [--isa avx2] [--threads 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

KV_DTYPES = ("auto", "float16", "bfloat16", "int8")  # auto: float32 on the CPU


def prompt_of(n: int) -> dict[str, list[int]]:
    """n fixed token ids spread over the vocabulary (no repeats for a model to lock onto)."""
    return {"prompt_token_ids": [100 + (i * 7919) % 40000 for i in range(n)]}


def measure(
    threads: int, rounds: int, new_tokens: int, contexts: list[int]
) -> dict[str, dict[str, list[float]]]:
    from treadle import LLM, SamplingParams

    engines = {
        kv: LLM(kv_cache_dtype=kv, cpu_threads=threads, kv_cache_memory="768MiB")
        for kv in KV_DTYPES
    }
    cpu_clock = time.thread_time if threads == 1 else time.process_time
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=1 + new_tokens, ignore_eos=True)
    out: dict[str, dict[str, list[float]]] = {}
    for n in contexts:
        prompt = prompt_of(n)
        for llm in engines.values():  # warm up: the prompt's blocks into the prefix cache
            llm.generate(prompt, many, use_tqdm=False)
        samples: dict[str, tuple[list[float], list[float]]] = {kv: ([], []) for kv in engines}
        for _ in range(rounds):
            for kv, llm in engines.items():
                spent = []
                for params in (one, many):
                    wall, cpu = time.perf_counter(), cpu_clock()
                    llm.generate(prompt, params, use_tqdm=False)
                    spent.append((time.perf_counter() - wall, cpu_clock() - cpu))
                samples[kv][0].append((spent[1][0] - spent[0][0]) / new_tokens * 1e3)
                samples[kv][1].append((spent[1][1] - spent[0][1]) / new_tokens * 1e3)
        for kv, (wall, cpu) in samples.items():
            out[f"{n}:{kv}"] = {"wall": wall, "cpu": cpu}
    for kv, llm in engines.items():
        worker = llm.engine_core.executor.worker  # type: ignore[union-attr]
        out[f"bytes:{kv}"] = {"per_token": [worker.runner.kv_bytes_per_block() / 16]}
        llm.shutdown()
    return out


def measure_kernel(contexts: list[int], rounds: int) -> dict[str, dict[str, list[float]]]:
    """The attention kernel alone, as a decode step of the default model calls it: one query
    token, 9 query heads over 3 KV heads of 64, a context of n tokens in 16-token blocks, once
    per layer over 30 layers' caches (so the step reads the whole KV from memory, not from
    a cache level): the thread's CPU ms per step, per dtype."""
    import torch

    from treadle.model import cpu_kernels
    from treadle.model.attention import kv_row_shape, to_cache_rows

    torch.set_num_threads(1)
    kernels = cpu_kernels.load()
    assert kernels is not None
    layers, kv, heads, d, bs = 30, 3, 9, 64, 16
    q, out = torch.randn(1, heads, d), torch.empty(1, heads * d)
    result: dict[str, dict[str, list[float]]] = {}
    for n in contexts:
        nb = -(-n // bs)
        table = torch.randperm(nb).view(1, nb)
        lens = torch.tensor([n], dtype=torch.int32)
        for name in ("float32", "float16", "bfloat16", "int8"):
            dtype, width = kv_row_shape(name, d)
            caches = []
            for _ in range(layers):
                pair = torch.empty(2, kv, nb, bs, width, dtype=dtype)
                pair.copy_(to_cache_rows(torch.randn(2, kv, nb, bs, d), pair))
                caches.append(pair)
            steps = []
            for _ in range(rounds * 4):
                start = time.thread_time()
                for pair in caches:
                    kernels.paged_decode_attention(q, pair[0], pair[1], table, lens, n, out, 0.125)
                steps.append((time.thread_time() - start) * 1e3)
            result[f"{n}:{'auto' if name == 'float32' else name}"] = {"cpu": steps}
            del caches
    return result


def report_kernel(isa: str, result: dict[str, dict[str, list[float]]], contexts: list[int]) -> None:
    print(f"\n{isa}: the attention kernel alone, 30 layers' KV from memory, CPU ms per step")
    for n in contexts:
        base = statistics.median(result[f"{n}:auto"]["cpu"])
        print(f"  context {n:5d}  " + ", ".join(
            f"{kv} {statistics.median(result[f'{n}:{kv}']['cpu']):.2f} ms "
            f"({statistics.median(result[f'{n}:{kv}']['cpu']) / base:.2f}x)"
            for kv in KV_DTYPES
        ))  # fmt: skip


def report(isa: str, result: dict[str, dict[str, list[float]]], contexts: list[int]) -> None:
    per_token = {kv: result[f"bytes:{kv}"]["per_token"][0] for kv in KV_DTYPES}
    print(f"\n{isa}: single-stream decode, default model, median ms per output token")
    print("  KV bytes per token: " + ", ".join(
        f"{kv} {per_token[kv] / 1024:.2f} KiB ({per_token['auto'] / per_token[kv]:.2f}x fewer)"
        for kv in KV_DTYPES
    ))  # fmt: skip
    for n in contexts:
        base = {k: statistics.median(result[f"{n}:auto"][k]) for k in ("wall", "cpu")}
        for kv in KV_DTYPES:
            r = result[f"{n}:{kv}"]
            wall, cpu = statistics.median(r["wall"]), statistics.median(r["cpu"])
            print(
                f"  context {n:5d}  {kv:8s} wall {wall:6.2f} ms ({wall / base['wall']:.2f}x "
                f"float32)  cpu {cpu:6.2f} ms ({cpu / base['cpu']:.2f}x)  "
                f"[cpu per round: {', '.join(f'{x:.1f}' for x in r['cpu'])}]"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--isa", default=None, help="one level; default: native and avx2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--contexts", default="2000,4000")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.child:
        kernel = measure_kernel(contexts, args.rounds)
        result = measure(args.threads, args.rounds, args.new_tokens, contexts)
        print(json.dumps({"kernel": kernel, "engine": result}))
        return 0
    from treadle.model.cpu_kernels import available_isas

    native = available_isas()[0]
    levels = [args.isa] if args.isa else list(dict.fromkeys([native, "avx2"]))
    for isa in levels:
        if isa not in available_isas():
            print(f"\n{isa}: this CPU does not run it; skipped")
            continue
        env = dict(os.environ, TREADLE_CPU_ISA=isa, TREADLE_LOGGING_LEVEL="WARNING")
        env.setdefault("TREADLE_ENABLE_MULTIPROCESSING", "0")
        cmd = [sys.executable, __file__, "--child", "--threads", str(args.threads),
               "--rounds", str(args.rounds), "--new-tokens", str(args.new_tokens),
               "--contexts", args.contexts]  # fmt: skip
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        both = json.loads(out.stdout.strip().splitlines()[-1])
        report_kernel(isa, both["kernel"], contexts)
        report(isa, both["engine"], contexts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
