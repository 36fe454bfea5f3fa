"""Where a batched decode step's time goes: the engine core in this process, N requests at once.

Runs the default model offline (`TREADLE_ENABLE_MULTIPROCESSING=0`), `--rows` requests of
~128-token prompts and `--new` new tokens each, all submitted at once, and times each piece of
every step whose rows are all decode tokens and number exactly N (the steady state of
concurrency N): the scheduler, the model runner's input preparation, the fused layer stack (one
C call), the LM head, the sampler, the engine's update and output path. Prints ms per step and
each piece's share. Shares are what to compare on a busy machine, not absolute times.

    .venv/bin/python benchmarks/step_profile.py --rows 16,64
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

os.environ["TREADLE_ENABLE_MULTIPROCESSING"] = "0"
os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")

import treadle  # noqa: E402
from treadle.core.engine_core import EngineCore  # noqa: E402
from treadle.core.scheduler import Scheduler  # noqa: E402
from treadle.model.cpu_kernels import select_isa  # noqa: E402
from treadle.model.fused_decode import FusedDecoder  # noqa: E402
from treadle.model.llama import LlamaForCausalLM  # noqa: E402
from treadle.worker.model_runner import ModelRunner  # noqa: E402
from treadle.worker.sampler import Sampler  # noqa: E402

PIECES = {
    "schedule": (Scheduler, "schedule"),
    "execute_model": (ModelRunner, "execute_model"),
    "prepare": (ModelRunner, "_prepare"),
    "fused layers": (FusedDecoder, "forward"),
    "model forward": (LlamaForCausalLM, "forward"),
    "lm head": (LlamaForCausalLM, "compute_logits"),
    "sampler": (Sampler, "__call__"),
    "update_from_output": (Scheduler, "update_from_output"),
}

_current: dict[str, float] = defaultdict(float)


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _current[name] += time.perf_counter() - start

    return timed


def install() -> dict[int, list[dict[str, float]]]:
    steps: dict[int, list[dict[str, float]]] = defaultdict(list)
    for name, (cls, attr) in PIECES.items():
        setattr(cls, attr, _wrap(name, getattr(cls, attr)))
    schedule = Scheduler.schedule

    def schedule_and_note(self: Scheduler) -> Any:
        out = schedule(self)
        counts = list(out.num_scheduled_tokens.values())
        _current["_rows"] = len(counts) if counts and max(counts) == 1 else -1
        return out

    Scheduler.schedule = schedule_and_note  # type: ignore[method-assign]
    step = EngineCore.step

    def timed_step(self: EngineCore) -> Any:
        _current.clear()
        start = time.perf_counter()
        out = step(self)
        _current["step"] = time.perf_counter() - start
        rows = int(_current.pop("_rows", -1))
        if rows > 0:
            steps[rows].append(dict(_current))
        return out

    EngineCore.step = timed_step  # type: ignore[method-assign]
    return steps


def report(rows: int, samples: list[dict[str, float]]) -> None:
    samples = samples[len(samples) // 4 :]  # past the first steps (caches, page faults)
    if not samples:
        print(f"{rows} rows: no decode-only steps")
        return
    mean = {k: sum(s.get(k, 0.0) for s in samples) / len(samples) for k in samples[0]}
    step = mean["step"]
    fused, head, sampler = mean.get("fused layers", 0), mean.get("lm head", 0), mean["sampler"]
    execute = mean["execute_model"]
    forward = mean.get("model forward", 0)
    parts = {
        "fused layer stack (C)": fused,
        "model forward outside it (embedding, rope)": forward - fused,
        "lm head (C, 49,152 x 576 Q8_0)": head,
        "sampler": sampler,
        "input prep (_prepare)": mean.get("prepare", 0),
        "rest of execute_model": execute - forward - head - sampler - mean.get("prepare", 0),
        "scheduler.schedule": mean["schedule"],
        "update_from_output": mean["update_from_output"],
        "rest of the engine step (outputs)": step
        - execute
        - mean["schedule"]
        - mean["update_from_output"],
    }
    print(f"{rows} rows, {len(samples)} steps: {step * 1e3:.2f} ms a step, "
          f"{rows / step:.0f} tok/s in decode")  # fmt: skip
    for name, t in parts.items():
        print(f"  {name:45s} {t * 1e3:7.2f} ms  {100 * t / step:5.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="16,64")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=128)
    args = parser.parse_args()
    steps = install()
    llm = treadle.LLM()
    print(f"ISA level: {select_isa()}, activations int8x2 (default), {os.cpu_count()} CPUs")
    rng = random.Random(0)
    params = treadle.SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [100, 200, 300]}], params, use_tqdm=False)
    for n in map(int, args.rows.split(",")):
        prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt)] for _ in range(n)]
        steps.clear()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        report(n, steps.get(n, []))


if __name__ == "__main__":
    main()
