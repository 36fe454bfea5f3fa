"""Tensor parallelism: the control-path cost of the shared-memory broadcast, and TP 1 vs TP N.

- A no-op `collective_rpc` round trip with TP 2 (tiny model: only the control path matters).
- The same round trip carrying a realistic `SchedulerOutput` of 64 running requests.
- Offline throughput of the default model at TP 1 and TP 3 (its 9 heads do not split in 2),
  and of a random model of the same size whose heads do split in 2 (hidden 512, 30 layers, 8
  heads, 4 KV heads, tied 49152 vocab: ~120M parameters) at TP 1 and TP 2 (target: TP 2 at
  least half of TP 1). On a 2-core machine TP cannot speed the model up: this reports the cost
  honestly.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[int(0.99 * (len(ordered) - 1))]


def control_path() -> None:
    from conftest import build_tiny_model
    from treadle.config import EngineConfig, ModelConfig, ParallelConfig
    from treadle.core.engine_core import make_executor
    from treadle.sampling_params import SamplingParams
    from treadle.wire.worker import CachedRequestData, NewRequestData, SchedulerOutput

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "tiny", "llama")
        config = EngineConfig(model=ModelConfig(str(path)), parallel=ParallelConfig(2))
        executor = make_executor(config)
        try:
            sched = SchedulerOutput(
                new_requests=[
                    NewRequestData(
                        f"new-{i}", list(range(128)), 128, SamplingParams(), [i, i + 1], 0
                    )
                    for i in range(4)
                ],
                cached_requests=[CachedRequestData(f"r{i}", [], 128 + i) for i in range(64)],
                num_scheduled_tokens={f"r{i}": 1 for i in range(64)},
                total_num_scheduled_tokens=64,
            )
            for label, args in (("no-op", ()), ("64-request SchedulerOutput", (sched,))):
                for _ in range(200):
                    executor.collective_rpc("check_health", args)
                samples = []
                for _ in range(2000):
                    start = time.perf_counter()
                    executor.collective_rpc("check_health", args)
                    samples.append((time.perf_counter() - start) * 1e6)
                p50, p99 = _percentiles(samples)
                print(f"  collective_rpc TP 2, {label:28s} p50 {p50:8.1f} us   p99 {p99:8.1f} us")
        finally:
            executor.shutdown()


def throughput(tp: int, prompts: list[list[int]], model: str | None = None) -> float:
    from treadle import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", tensor_parallel_size=tp)
    try:
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        llm.generate(
            [{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2), use_tqdm=False
        )
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
    finally:
        llm.shutdown()


def main() -> None:
    print("tensor parallelism (benchmarks/tp_bench.py)")
    control_path()
    prompts = [[(13 * i + j) % 30000 + 100 for j in range(128)] for i in range(32)]
    tp1 = throughput(1, prompts)
    tp3 = throughput(3, prompts)
    print(
        f"  default model, 32 x 128 in / 64 out: TP 1 {tp1:.1f} tok/s, TP 3 {tp3:.1f} tok/s, "
        f"ratio {tp3 / tp1:.2f}"
    )
    from conftest import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(
            Path(tmp) / "even-heads",
            "llama",
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
        tp1 = throughput(1, prompts, str(path))
        tp2 = throughput(2, prompts, str(path))
    print(
        f"  same-size model with 8 heads, 32 x 128 in / 64 out: TP 1 {tp1:.1f} tok/s, "
        f"TP 2 {tp2:.1f} tok/s, ratio {tp2 / tp1:.2f} (target >= 0.5)"
    )


if __name__ == "__main__":
    main()
