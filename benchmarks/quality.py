"""Numerics of `--cpu-activation-dtype int8x2` (the default) or `int8`, or of
`--kv-cache-dtype float16|bfloat16|int8`, against the exact float32 path (issue 24 items 2
and 3): greedy agreement on the reference prompts of tests/model/test_reference.py, and
perplexity on a fixed text, per ISA level, beside llama.cpp's `llama-perplexity` on the same text and GGUF where it is built.

For each level this CPU runs where the GGUF blocks are used (each in its own process with
TREADLE_CPU_ISA set), the default model runs both paths (exact: float32 activations and KV
cache; other: --activations (int8x2 by default), or float32 activations and the given KV cache
dtype with --kv-cache-dtype). Printed per level:

- greedy agreement, teacher-forced: the exact path's greedy continuation of each prompt
  (NEW_TOKENS) is read by both paths as one prompt; at each of its positions, is the other
  path's most likely next token the exact path's? One flip does not count every later token
  (the figure item 2's 98% is about; a near tie of the two best logits is where they differ);
- greedy, free running: the tokens before the first divergence (summed over prompts), the
  position-wise equal tokens and each prompt's first divergence, one prompt at a time (the
  fused single-row decode) and all at once (batched steps);
- perplexity of data/perplexity.txt: over the whole text as one prompt, and as llama.cpp's
  `llama-perplexity -c CTX` computes it (chunks of CTX tokens, each scored on its second
  half), beside that program's figure.

    .venv/bin/python benchmarks/quality.py [--isa avx2] [--new-tokens 64] [--activations int8]
        [--kv-cache-dtype int8] [--ctx 256] [--llama-perplexity .peers/llama-perplexity-native]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

TEXT = Path(__file__).parent / "data" / "perplexity.txt"
PEER = Path(__file__).parent.parent / ".peers" / "llama-perplexity-native"

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


def run_path(
    path: tuple[str, str], new_tokens: int, ctx: int, forced: list[list[int]] | None
) -> dict[str, Any]:
    """One path (activations, KV cache dtype): greedy outputs one at a time and batched, the
    most likely next token at each position of `forced` (prompt + the exact path's output;
    default: this path's own one-at-a-time output), and the text's perplexity (whole, and in
    llama-perplexity's chunks, with the most likely token at each scored position)."""
    from treadle import LLM, SamplingParams

    activations, kv_cache_dtype = path
    # Steps of at most 64 tokens: int8x2's products of 256 rows or more would run on float32
    # (`linear_method.ExpandedLinear`), and its perplexity then measure float32's.
    llm = LLM(
        dtype="float32",
        cpu_activation_dtype=activations,
        kv_cache_dtype=kv_cache_dtype,
        max_num_batched_tokens=64,
    )
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    single = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    single = [list(t) for t in single]
    if forced is None:
        forced = [p + t for p, t in zip(PROMPTS, single, strict=True)]
    top1 = [scan(llm, ids, len(p) - 1)[1] for p, ids in zip(PROMPTS, forced, strict=True)]
    ids = list(llm.get_tokenizer().encode(TEXT.read_text(), add_special_tokens=False))
    whole = scan(llm, ids, 0)[0]
    chunks = [ids[i : i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]
    scans = [scan(llm, c, ctx // 2) for c in chunks]
    llm.shutdown()
    scored = [x for nll, _ in scans for x in nll]
    return {
        "single": single,
        "batched": [list(t) for t in batched],
        "forced": forced,
        "top1": top1,
        "ppl_whole": math.exp(sum(whole) / len(whole)),
        "ppl_chunks": math.exp(sum(scored) / len(scored)),
        "chunk_ids": chunks,
        "chunk_top1": [t for _, top in scans for t in top],
    }


def scan(llm: Any, ids: list[int], first: int) -> tuple[list[float], list[int]]:
    """The negative log-likelihoods of ids[first + 1:] and the most likely token at each of
    those positions (llama-perplexity scores a chunk's tokens after its middle one: the
    model always has some context)."""
    from treadle import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    per_position = list(out.prompt_logprobs)[first + 1 :]
    nll = [-d[t].logprob for d, t in zip(per_position, ids[first + 1 :], strict=True)]
    top1 = [next(t for t, lp in d.items() if lp.rank == 1) for d in per_position]
    return nll, top1


def free_running(exact: list[list[int]], other: list[list[int]]) -> dict[str, object]:
    """Tokens before the first divergence and position-wise equal tokens, over all prompts."""
    firsts, same, total = [], 0, 0
    for a, b in zip(exact, other, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        firsts.append(first)
        same += sum(x == y for x, y in zip(a, b, strict=True))
        total += len(a)
    return {"prefix": sum(firsts), "same": same, "total": total, "first_divergence": firsts}


def teacher_forced(exact: list[list[int]], other: list[list[int]]) -> dict[str, object]:
    """Positions where both paths' most likely next token is the same, given the same prefix."""
    flips = [
        sum(x != y for x, y in zip(a, b, strict=True)) for a, b in zip(exact, other, strict=True)
    ]
    total = sum(map(len, exact))
    return {"same": total - sum(flips), "total": total, "flips_per_prompt": flips}


def measure(
    new_tokens: int, activations: str, kv_cache_dtype: str | None, ctx: int
) -> dict[str, Any]:
    exact_path = ("float32", "auto")
    other_path = (activations, "auto") if kv_cache_dtype is None else ("float32", kv_cache_dtype)
    exact = run_path(exact_path, new_tokens, ctx, None)
    other = run_path(other_path, new_tokens, ctx, exact["forced"])
    # The exact path's own prefill against its decode: both read the same bits unless a
    # kernel sums differently per row count (then the figure says how often that flips one).
    self_check = teacher_forced(exact["single"], exact["top1"])
    return {
        "teacher_forced": teacher_forced(exact["top1"], other["top1"]),
        "exact_prefill_vs_decode": self_check,
        "one at a time": free_running(exact["single"], other["single"]),
        "batched": free_running(exact["batched"], other["batched"]),
        "perplexity": {k: (exact[k], other[k]) for k in ("ppl_whole", "ppl_chunks")},
        "chunk_ids": exact["chunk_ids"],
        "text_top1": (exact["chunk_top1"], other["chunk_top1"]),
    }


def llama_perplexity(binary: Path, ctx: int) -> dict[str, Any] | str:
    """llama-perplexity's estimate on the same text and GGUF, its token ids and its most likely
    token at each scored position (read back from the log-probabilities it saves with
    --kl-divergence-base: per position two floats, then a uint16 per vocabulary entry, larger
    for likelier); or why there is none."""
    import numpy as np

    if not binary.exists():
        return f"not run: {binary} is not built (make bench-peers)"
    from treadle.config import default_model_path

    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "logits.bin"
        cmd = [str(binary), "-m", default_model_path(), "-f", str(TEXT), "-c", str(ctx)]
        cmd += ["-b", str(ctx), "-t", str(os.cpu_count() or 1), "--no-repack"]
        out = subprocess.run(cmd + ["--kl-divergence-base", str(saved)], capture_output=True)
        found = re.search(rb"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
        if not found or not saved.exists():
            return f"failed (exit {out.returncode})"
        raw = saved.read_bytes()
    assert raw[:8] == b"_logits_", "not a llama-perplexity logits file"
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw, np.int32, 3, 8)
    tokens = np.frombuffer(raw, np.int32, n_chunk * n_ctx, 20).reshape(n_chunk, n_ctx)
    row = 2 * ((n_vocab + 1) // 2) + 4  # uint16s per scored position
    start = 20 + tokens.nbytes
    probs = np.frombuffer(raw, np.uint16, n_chunk * (n_ctx - 1 - n_ctx // 2) * row, start)
    top1 = probs.reshape(-1, row)[:, 4 : 4 + n_vocab].argmax(axis=1)
    return {"ppl": float(found.group(1)), "chunk_ids": tokens.tolist(), "top1": top1.tolist()}


def report(isa: str, other: str, results: dict[str, Any], peer: dict[str, Any] | str) -> None:
    print(f"\n{isa}: {other} against float32, greedy, default model")
    tf = results["teacher_forced"]
    print(
        f"  teacher-forced, reference prompts: the same next token at {tf['same']}/{tf['total']} "
        f"positions ({100 * tf['same'] / tf['total']:.1f}%); flips per prompt "
        f"{tf['flips_per_prompt']}"
    )
    sc = results["exact_prefill_vs_decode"]
    print(f"  (float32's prefill against its own decode: {sc['same']}/{sc['total']} the same)")
    exact_top1, other_top1 = results["text_top1"]
    print(f"  teacher-forced, {TEXT.name}'s scored positions: {same_share(exact_top1, other_top1)}")
    for mode in ("one at a time", "batched"):
        r = results[mode]
        print(
            f"  free running, {mode:13s}: before the first divergence {r['prefix']}/{r['total']} "
            f"({100 * r['prefix'] / r['total']:.1f}%), position-wise equal {r['same']}/"
            f"{r['total']} ({100 * r['same'] / r['total']:.1f}%); first divergence per "
            f"prompt {r['first_divergence']}"
        )
    chunks = len(results["chunk_ids"])
    ctx = len(results["chunk_ids"][0])
    for key, what in (("ppl_whole", "the whole text"), ("ppl_chunks", f"{chunks} x {ctx} tokens")):
        exact, theirs = results["perplexity"][key]
        print(
            f"  perplexity of {TEXT.name}, {what}: float32 {exact:.4f}, {other} {theirs:.4f} "
            f"({100 * (theirs / exact - 1):+.2f}%)"
        )
    if isinstance(peer, str):
        print(f"  llama-perplexity -c {ctx}: {peer}")
    elif peer["chunk_ids"] != results["chunk_ids"]:
        print(f"  llama-perplexity -c {ctx}: {peer['ppl']:.4f}, but its token ids are not ours")
    else:
        exact = results["perplexity"]["ppl_chunks"][0]
        print(
            f"  llama-perplexity -c {ctx}, same text, GGUF and token ids: {peer['ppl']:.4f} "
            f"({100 * (peer['ppl'] / exact - 1):+.2f}% from float32); its most likely token "
            f"against float32's: {same_share(exact_top1, peer['top1'])}"
        )


def same_share(a: list[int], b: list[int]) -> str:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    return f"the same at {same}/{len(a)} ({100 * same / len(a):.1f}%)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--isa", default=None, help="one level; default: every level this CPU runs")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=256, help="llama-perplexity's -c")
    parser.add_argument("--llama-perplexity", type=Path, default=PEER)
    parser.add_argument(
        "--activations",
        choices=("int8x2", "int8"),
        default="int8x2",
        help="the activations to compare with float32's (int8x2: the default path)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("float16", "bfloat16", "int8"),
        default=None,
        help="compare this KV cache (float32 activations) instead of --activations",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.new_tokens, args.activations, args.kv_cache_dtype, args.ctx)))
        return 0
    other = (
        f"{args.activations} activations"
        if args.kv_cache_dtype is None
        else f"the {args.kv_cache_dtype} KV cache"
    )
    from treadle.model.cpu_kernels import available_isas
    from treadle.model.linear_method import GGUF_MAX_ROWS

    peer = llama_perplexity(args.llama_perplexity, args.ctx)
    for isa in [args.isa] if args.isa else available_isas():
        if not GGUF_MAX_ROWS[isa]:
            print(f"\n{isa}: the GGUF blocks are not used at this level; skipped")
            continue
        env = dict(os.environ, TREADLE_CPU_ISA=isa, TREADLE_LOGGING_LEVEL="WARNING")
        env.setdefault("TREADLE_ENABLE_MULTIPROCESSING", "0")
        cmd = [sys.executable, __file__, "--child", "--new-tokens", str(args.new_tokens)]
        cmd += ["--ctx", str(args.ctx), "--activations", args.activations]
        if args.kv_cache_dtype:
            cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        report(isa, other, json.loads(out.stdout.strip().splitlines()[-1]), peer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
