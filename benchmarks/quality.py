"""Numerics of `--cpu-activation-dtype int8`, or of `--kv-cache-dtype float16|bfloat16|int8`,
against the exact float32 path (issue 24 items 2 and 3): greedy agreement on the reference
prompts of tests/model/test_reference.py, and perplexity on a fixed text, per ISA level.

For each level this CPU runs where the GGUF blocks are used (each in its own process with
TREADLE_CPU_ISA set), the default model generates NEW_TOKENS greedy tokens per prompt on the
exact path (float32 activations and KV cache) and on the other (int8 activations by default;
float32 activations and the given KV cache dtype with --kv-cache-dtype), one prompt at a time
(as the reference tests: single-row decode steps, the fused path) and all at once (batched
steps). Printed per level: the tokens before the first divergence, summed over prompts / all
tokens, the position-wise equal tokens and the first divergence of each prompt; then the
perplexity of both on data/perplexity.txt (one prompt, its prompt logprobs: every position
reads the KV cache the prefill wrote).

    .venv/bin/python benchmarks/quality.py [--isa avx2] [--new-tokens 32] [--kv-cache-dtype int8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

TEXT = Path(__file__).parent / "data" / "perplexity.txt"

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


def generate(
    path: tuple[str, str], new_tokens: int, batched: bool
) -> tuple[list[list[int]], float | None]:
    """Greedy outputs of the reference prompts on `path` (activations, KV cache dtype), and
    (one at a time only) the perplexity of the fixed text."""
    from treadle import LLM, SamplingParams

    activations, kv_cache_dtype = path
    llm = LLM(dtype="float32", cpu_activation_dtype=activations, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ppl = None
    if batched:
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
        ppl = perplexity(llm)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], ppl


def perplexity(llm: object) -> float:
    """exp of the mean negative log-likelihood of data/perplexity.txt's tokens after its first."""
    from treadle import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate(TEXT.read_text(), params, use_tqdm=False)[0]  # type: ignore[attr-defined]
    ids, logprobs = out.prompt_token_ids, out.prompt_logprobs
    nll = [-logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0]
    return math.exp(sum(nll) / len(nll))


def agreement(exact: list[list[int]], other: list[list[int]]) -> dict[str, object]:
    """Tokens before the first divergence and position-wise equal tokens, over all prompts."""
    firsts, same, total = [], 0, 0
    for a, b in zip(exact, other, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        firsts.append(first)
        same += sum(x == y for x, y in zip(a, b, strict=True))
        total += len(a)
    return {"prefix": sum(firsts), "same": same, "total": total, "first_divergence": firsts}


def measure(new_tokens: int, kv_cache_dtype: str | None) -> dict[str, dict[str, object]]:
    exact_path = ("float32", "auto")
    other_path = ("int8", "auto") if kv_cache_dtype is None else ("float32", kv_cache_dtype)
    results = {}
    for batched in (False, True):
        exact, ppl_exact = generate(exact_path, new_tokens, batched)
        other, ppl_other = generate(other_path, new_tokens, batched)
        results["batched" if batched else "one at a time"] = agreement(exact, other)
        if not batched:
            results["perplexity"] = {"exact": ppl_exact, "other": ppl_other}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--isa", default=None, help="one level; default: every level this CPU runs")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("float16", "bfloat16", "int8"),
        default=None,
        help="compare this KV cache (float32 activations) instead of int8 activations",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.new_tokens, args.kv_cache_dtype)))
        return 0
    other = (
        "int8 activations" if args.kv_cache_dtype is None else f"the {args.kv_cache_dtype} KV cache"
    )
    from treadle.model.cpu_kernels import available_isas
    from treadle.model.linear_method import GGUF_MAX_ROWS

    for isa in [args.isa] if args.isa else available_isas():
        if not GGUF_MAX_ROWS[isa]:
            print(f"\n{isa}: the GGUF blocks are not used at this level; skipped")
            continue
        env = dict(os.environ, TREADLE_CPU_ISA=isa, TREADLE_LOGGING_LEVEL="WARNING")
        env.setdefault("TREADLE_ENABLE_MULTIPROCESSING", "0")
        cmd = [sys.executable, __file__, "--child", "--new-tokens", str(args.new_tokens)]
        if args.kv_cache_dtype:
            cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        print(f"\n{isa}: {other} against float32, greedy, default model")
        results = json.loads(out.stdout.strip().splitlines()[-1])
        ppl = results.pop("perplexity")
        for mode, r in results.items():
            print(
                f"  {mode:13s} before the first divergence {r['prefix']}/{r['total']} "
                f"({100 * r['prefix'] / r['total']:.1f}%), position-wise equal {r['same']}/"
                f"{r['total']} ({100 * r['same'] / r['total']:.1f}%); first divergence per "
                f"prompt {r['first_divergence']}"
            )
        change = 100 * (ppl["other"] / ppl["exact"] - 1)
        print(
            f"  perplexity on {TEXT.name}: float32 {ppl['exact']:.4f}, {other} "
            f"{ppl['other']:.4f} ({change:+.2f}%)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
