"""Speculative decoding (issue 27): output tok/s of greedy requests with and without
`--speculative-config` (n-gram, and with `--methods draft` a draft model: `--draft`, by
default the model itself, the upper bound of acceptance) on the prompts shipped in `benchmarks/data/spec_prompts.json`
(repetitive: code edits, JSON to fill, quoting; random: open-ended), default model, offline,
in one process.

Side by side: every engine (plain, then n-gram at each k) is loaded once, and each round runs
the same workload on all of them in turn, so that load from other processes falls on all
alike; the ratios to plain are per round, and the medians are reported. Workloads: single
stream (the prompts one after another) and concurrency C (C requests at once, the prompts
repeated; `--waves` x C requests, C at once: the one that ends first lets the next one in, as
with C clients, where a request that speculation finishes early is worth as much as its
tokens; in one batch of C, `--waves 1`, the batch takes as long as its slowest request).
Outputs are checked identical to plain. Also the acceptance rate.
`--always-propose` makes every speculating engine verify every proposal it can (its plan
sees steps of any size cost the same and the draft cost nothing): what speculation costs
where the plan would not propose. `--control` adds a second plain engine, run last in each
round: its ratio to plain is the noise of the comparison (and of a place in the round).

Beside it, where `.peers/llama-server-native` exists (`make bench-peers`), llama.cpp's
llama-server on the same prompts and model, single stream, without speculation and with its
n-gram speculation (`--spec-type ngram-simple`, lookup of `--spec-ngram-simple-size-n` 3
tokens, drafts of up to k tokens), in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")
os.environ["TREADLE_ENABLE_MULTIPROCESSING"] = "0"

sys.path.insert(0, str(Path(__file__).parent))
from peer_bench import ROOT, LlamaServer, free_port  # noqa: E402
from treadle import LLM, SamplingParams  # noqa: E402
from treadle.config import ModelConfig, resolve_model  # noqa: E402
from treadle.core.spec_decode import StepTimes  # noqa: E402

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


def draft_model(k: int, path: str) -> dict[str, object]:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


class FlatTimes(StepTimes):
    """`--always-propose`: a step costs `value` seconds, whatever its rows."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def record(self, rows: int, seconds: float) -> None:
        pass

    def table(self, first: int, last: int) -> list[float]:
        return [self.value] * (last - first + 1)


def timed(
    llm: LLM, prompts: list[str], tokens: int, concurrency: int, waves: int
) -> tuple[float, list]:
    """Output tok/s and the outputs' tokens. Concurrency C > 1: `waves` x C requests, at
    most C at once (the engines' max_num_seqs): one that ends lets the next one in."""
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    if concurrency == 1:
        outs = [llm.generate([p], greedy, use_tqdm=False)[0] for p in prompts]
    else:
        batch = [prompts[i % len(prompts)] for i in range(concurrency * waves)]
        outs = llm.generate(batch, greedy, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens_out = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens_out)) / seconds, tokens_out


class SpecLlamaServer(LlamaServer):
    """llama-server, one slot, with `extra` arguments (its speculation)."""

    def __init__(self, binary: Path, gguf: str, log_path: Path, extra: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        cmd = [str(binary), "-m", gguf, "-t", "2", "-np", "1", "-c", "4096", *extra]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)


def llama_timed(url: str, prompts: list[str], tokens: int) -> float:
    """Output tok/s of llama-server's /completion, greedy, one prompt after another."""
    start = time.perf_counter()
    total = 0
    for prompt in prompts:
        body = {
            "prompt": prompt,
            "n_predict": tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "cache_prompt": True,
        }
        req = urllib.request.Request(
            url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=600) as resp:
            total += json.load(resp)["tokens_predicted"]
    return total / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("-k", type=int, nargs="+", default=[2, 4, 8], help="num_speculative_tokens")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", nargs="+", default=list(PROMPTS))
    ap.add_argument("--methods", nargs="+", default=["ngram"], choices=["ngram", "draft"])
    ap.add_argument("--draft", default=None, help="the draft model (default: the model itself)")
    ap.add_argument("--always-propose", action="store_true")
    ap.add_argument(
        "--control",
        action="store_true",
        help="a second plain engine, run last in each round: the noise between two equals",
    )
    ap.add_argument(
        "--waves",
        type=int,
        default=4,
        help="concurrency C > 1 runs waves x C requests, C at once (1: one batch of C)",
    )
    ap.add_argument(
        "--cpu-activation-dtype",
        default=ModelConfig.cpu_activation_dtype,
        help="treadle's, for every engine (default: the engine's own, int8x2)",
    )
    ap.add_argument("--llama-server", type=Path, default=ROOT / ".peers/llama-server-native")
    ap.add_argument(
        "--llama-extra",
        default="",
        help="more llama-server arguments for both of its runs (e.g. --no-repack: its AMX "
        "repacking crashes on some Xeons)",
    )
    args = ap.parse_args()
    peers: dict[str, list[str]] = {}  # name -> llama-server's extra arguments
    if args.llama_server.exists():
        k = max(args.k)
        ngram_args = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3"]
        ngram_args += ["--spec-ngram-simple-size-m", str(k), "--spec-draft-n-max", str(k)]
        extra = args.llama_extra.split()
        peers = {"llama.cpp": extra, f"llama.cpp ngram k={k}": [*extra, *ngram_args]}
    else:
        print(f"(no {args.llama_server}: `make bench-peers` builds llama.cpp's server)")
    logs = Path(tempfile.mkdtemp())

    def llama_run(extra: list[str], prompts: list[str]) -> float:
        """A llama-server started for this run only (an idle one still takes CPU time)."""
        server = SpecLlamaServer(args.llama_server, resolve_model(None).path, logs / "l.log", extra)
        try:
            server.wait_healthy()
            return llama_timed(server.url, prompts, args.tokens)
        finally:
            server.stop()

    common = {
        "max_model_len": 2048,
        "cpu_activation_dtype": args.cpu_activation_dtype,
        "max_num_seqs": max(args.concurrency),
    }
    engines: dict[str, LLM] = {"plain": LLM(**common)}  # type: ignore[arg-type]
    draft = args.draft or resolve_model(None).path
    for k in args.k:
        if "ngram" in args.methods:
            engines[f"ngram k={k}"] = LLM(**common, speculative_config=ngram(k))  # type: ignore[arg-type]
        if "draft" in args.methods:
            engines[f"draft k={k}"] = LLM(**common, speculative_config=draft_model(k, draft))  # type: ignore[arg-type]
    if args.control:
        engines["plain again"] = LLM(**common)  # type: ignore[arg-type]
    if args.always_propose:
        for name, llm in engines.items():
            scheduler = llm.engine_core.scheduler
            if name != "plain":
                scheduler.step_times = FlatTimes(1.0)
            if scheduler.draft is not None:
                scheduler.draft.times = FlatTimes(0.0)
    try:
        for llm in engines.values():  # warm up
            llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        for kind in args.kinds:
            prompts = PROMPTS[kind]
            for c in args.concurrency:
                speeds: dict[str, list[float]] = {name: [] for name in engines}
                with_peers = peers if c == 1 else {}
                speeds.update({name: [] for name in with_peers})
                identical = True
                for _ in range(args.rounds):
                    reference = None
                    for name, llm in engines.items():
                        speed, out = timed(llm, prompts, args.tokens, c, args.waves)
                        speeds[name].append(speed)
                        reference = out if reference is None else reference
                        identical &= out == reference
                    for name, extra in with_peers.items():
                        speeds[name].append(llama_run(extra, prompts))
                plain = speeds["plain"]
                line = [f"{kind}, concurrency {c}: plain {statistics.median(plain):.1f} tok/s"]
                for name, llm in engines.items():
                    if name == "plain":
                        continue
                    ratios = [s / p for s, p in zip(speeds[name], plain, strict=True)]
                    s = llm.engine_core.scheduler
                    rate = s.spec_accepted_tokens / max(1, s.spec_draft_tokens)
                    acc = f", acc {rate:.0%} so far" if s.speculative is not None else ""
                    line.append(
                        f"{name} {statistics.median(speeds[name]):.1f} "
                        f"({statistics.median(ratios):.2f}x{acc})"
                    )
                for name in with_peers:
                    ratios = [p / s for s, p in zip(speeds[name], plain, strict=True)]
                    line.append(
                        f"{name} {statistics.median(speeds[name]):.1f} "
                        f"(treadle plain / it: {statistics.median(ratios):.2f}x)"
                    )
                if with_peers:
                    best = {n: statistics.median(v) for n, v in speeds.items() if n in engines}
                    name = max(best, key=best.__getitem__)
                    peer = statistics.median(speeds[next(reversed(with_peers))])
                    line.append(
                        f"treadle best ({name}) / llama.cpp ngram: {best[name] / peer:.2f}x"
                    )
                line.append(f"identical: {identical}")
                print("; ".join(line), flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()


if __name__ == "__main__":
    main()
