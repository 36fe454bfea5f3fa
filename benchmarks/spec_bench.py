"""N-gram speculative decoding (issue 27): output tok/s of greedy single streams with and
without `--speculative-config` on the prompts shipped in `benchmarks/data/spec_prompts.json`
(repetitive: code edits, JSON to fill, quoting; random: open-ended), default model, offline,
in one process, side by side; outputs checked identical. Also the acceptance rate.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")
os.environ["TREADLE_ENABLE_MULTIPROCESSING"] = "0"

from treadle import LLM, SamplingParams  # noqa: E402

PROMPTS = json.loads((Path(__file__).parent / "data" / "spec_prompts.json").read_text())


def run(
    spec: dict[str, object] | None, prompts: list[str], tokens: int
) -> tuple[float, list[list[int]], tuple[int, int]]:
    llm = LLM(max_model_len=2048, speculative_config=spec)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        start = time.perf_counter()
        outs = [llm.generate([p], greedy, use_tqdm=False)[0] for p in prompts]  # single stream
        seconds = time.perf_counter() - start
        s = llm.engine_core.scheduler
        return (
            sum(len(o.outputs[0].token_ids) for o in outs) / seconds,
            [list(o.outputs[0].token_ids) for o in outs],
            (s.spec_draft_tokens, s.spec_accepted_tokens),
        )
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=8, help="num_speculative_tokens")
    args = ap.parse_args()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    for kind, prompts in PROMPTS.items():
        plain, plain_out, _ = run(None, prompts, args.tokens)
        ngram, ngram_out, (drafted, accepted) = run(spec, prompts, args.tokens)
        rate = accepted / drafted if drafted else 0.0
        print(
            f"{kind}: plain {plain:.1f} tok/s, ngram k={args.k} {ngram:.1f} tok/s "
            f"({ngram / plain:.2f}x), acceptance {rate:.0%}, identical: {plain_out == ngram_out}",
            flush=True,
        )


if __name__ == "__main__":
    main()
