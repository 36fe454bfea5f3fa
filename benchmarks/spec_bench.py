"""N-gram speculative decoding (issue 27): output tok/s of greedy requests with and without
`--speculative-config` on the prompts shipped in `benchmarks/data/spec_prompts.json`
(repetitive: code edits, JSON to fill, quoting; random: open-ended), default model, offline,
in one process.

Side by side: every engine (plain, then n-gram at each k) is loaded once, and each round runs
the same workload on all of them in turn, so that load from other processes falls on all
alike; the ratios to plain are per round, and the medians are reported. Workloads: single
stream (the prompts one after another) and concurrency C (C requests at once, the prompts
repeated). Outputs are checked identical to plain. Also the acceptance rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")
os.environ["TREADLE_ENABLE_MULTIPROCESSING"] = "0"

from treadle import LLM, SamplingParams  # noqa: E402

PROMPTS: dict[str, list[str]] = json.loads(
    (Path(__file__).parent / "data" / "spec_prompts.json").read_text()
)


def ngram(k: int) -> dict[str, object]:
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }


def timed(llm: LLM, prompts: list[str], tokens: int, concurrency: int) -> tuple[float, list]:
    """Output tok/s and the outputs' tokens."""
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    if concurrency == 1:
        outs = [llm.generate([p], greedy, use_tqdm=False)[0] for p in prompts]
    else:
        batch = [prompts[i % len(prompts)] for i in range(concurrency)]
        outs = llm.generate(batch, greedy, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens_out = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens_out)) / seconds, tokens_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("-k", type=int, nargs="+", default=[2, 4, 8], help="num_speculative_tokens")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", nargs="+", default=list(PROMPTS))
    args = ap.parse_args()
    engines: dict[str, LLM] = {"plain": LLM(max_model_len=2048)}
    for k in args.k:
        engines[f"ngram k={k}"] = LLM(max_model_len=2048, speculative_config=ngram(k))
    try:
        for llm in engines.values():  # warm up
            llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        for kind in args.kinds:
            prompts = PROMPTS[kind]
            for c in args.concurrency:
                speeds: dict[str, list[float]] = {name: [] for name in engines}
                identical = True
                for _ in range(args.rounds):
                    reference = None
                    for name, llm in engines.items():
                        speed, out = timed(llm, prompts, args.tokens, c)
                        speeds[name].append(speed)
                        reference = out if reference is None else reference
                        identical &= out == reference
                plain = speeds["plain"]
                line = [f"{kind}, concurrency {c}: plain {statistics.median(plain):.1f} tok/s"]
                for name, llm in engines.items():
                    if name == "plain":
                        continue
                    ratios = [s / p for s, p in zip(speeds[name], plain, strict=True)]
                    s = llm.engine_core.scheduler
                    rate = s.spec_accepted_tokens / max(1, s.spec_draft_tokens)
                    line.append(
                        f"{name} {statistics.median(speeds[name]):.1f} "
                        f"({statistics.median(ratios):.2f}x, acc {rate:.0%} so far)"
                    )
                line.append(f"identical: {identical}")
                print("; ".join(line), flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()


if __name__ == "__main__":
    main()
