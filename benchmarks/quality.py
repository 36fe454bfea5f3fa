"""Numerics of `--cpu-activation-dtype int8` against the exact float32 path (issue 24 item 2):
greedy agreement on the reference prompts of tests/model/test_reference.py, per ISA level.

For each level this CPU runs where the GGUF blocks are used (each in its own process with
TREADLE_CPU_ISA set), the default model generates NEW_TOKENS greedy tokens per prompt with
float32 and with int8 activations, one prompt at a time (as the reference tests: single-row
decode steps, the fused path) and all at once (batched steps). Printed per level: the tokens
before the first divergence, summed over prompts / all tokens, the position-wise equal tokens
and the first divergence of each prompt. (Perplexity on a fixed text, item 2's second figure,
is not measured here yet.)

    .venv/bin/python benchmarks/quality.py [--isa avx2] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# tests/model/test_reference.py's prompts (token ids below 49152).
PROMPTS = [
    [504, 3575, 282, 4649, 314],
    [19556, 28, 957, 1462, 314],
    [1],
    [339, 1303, 1300, 253, 3412, 281, 2821, 2428, 30, 378, 1234, 314, 3270, 28, 357, 3256],
    list(range(100, 140)),
    [9690, 11, 2054],
    list(range(2000, 2077, 3)),
    [42] * 20,
]


def generate(activations: str, new_tokens: int, batched: bool) -> list[list[int]]:
    from treadle import LLM, SamplingParams

    llm = LLM(dtype="float32", cpu_activation_dtype=activations)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    if batched:
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(exact: list[list[int]], other: list[list[int]]) -> dict[str, object]:
    """Tokens before the first divergence and position-wise equal tokens, over all prompts."""
    firsts, same, total = [], 0, 0
    for a, b in zip(exact, other, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        firsts.append(first)
        same += sum(x == y for x, y in zip(a, b, strict=True))
        total += len(a)
    return {"prefix": sum(firsts), "same": same, "total": total, "first_divergence": firsts}


def measure(new_tokens: int) -> dict[str, dict[str, object]]:
    results = {}
    for batched in (False, True):
        exact = generate("float32", new_tokens, batched)
        int8 = generate("int8", new_tokens, batched)
        results["batched" if batched else "one at a time"] = agreement(exact, int8)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--isa", default=None, help="one level; default: every level this CPU runs")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.new_tokens)))
        return 0
    from treadle.model.cpu_kernels import available_isas
    from treadle.model.linear_method import GGUF_MAX_ROWS

    for isa in [args.isa] if args.isa else available_isas():
        if not GGUF_MAX_ROWS[isa]:
            print(f"\n{isa}: the GGUF blocks are not used at this level; skipped")
            continue
        env = dict(os.environ, TREADLE_CPU_ISA=isa, TREADLE_LOGGING_LEVEL="WARNING")
        env.setdefault("TREADLE_ENABLE_MULTIPROCESSING", "0")
        cmd = [sys.executable, __file__, "--child", "--new-tokens", str(args.new_tokens)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        print(f"\n{isa}: int8 activations against float32, greedy, default model")
        for mode, r in json.loads(out.stdout.strip().splitlines()[-1]).items():
            print(
                f"  {mode:13s} before the first divergence {r['prefix']}/{r['total']} "
                f"({100 * r['prefix'] / r['total']:.1f}%), position-wise equal {r['same']}/"
                f"{r['total']} ({100 * r['same'] / r['total']:.1f}%); first divergence per "
                f"prompt {r['first_divergence']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
