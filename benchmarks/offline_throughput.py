"""Offline throughput: treadle's `LLM.generate` beside transformers' `generate`, in one run.

Workloads (default model, same dtype for both):
- batch: 64 prompts of ~128 tokens, 128 new tokens each (ignore_eos), submitted at once;
  transformers runs them in static batches of 16 (left-padded), as a user would write it.
- single stream: one 32-token prompt, 256 new tokens.
Prints each figure and the ratios treadle / transformers. With TREADLE_CPU_ISA=avx2 both run
as on an AVX2-only CPU (treadle's kernels, PyTorch's, oneDNN's and MKL's all capped at AVX2).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

import treadle  # noqa: E402, F401 - before any tensor op: TREADLE_CPU_ISA caps PyTorch
from treadle.model.cpu_kernels import detect_isa, select_isa  # noqa: E402


def make_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(100, 40000) for _ in range(length + rng.randrange(-8, 9))]
        for _ in range(num)
    ]


def bench_treadle(prompts: list[list[int]], new_tokens: int, dtype: str, llm=None):  # type: ignore[no-untyped-def]
    from treadle import LLM, SamplingParams

    llm = llm or LLM(dtype=dtype)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(
        [{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=2), use_tqdm=False
    )
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return llm, elapsed, out_tokens


def bench_transformers(prompts: list[list[int]], new_tokens: int, dtype: str, batch: int):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    from treadle.config import resolve_model

    source = resolve_model(None)
    torch_dtype = torch.float32 if dtype in ("auto", "float32") else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(
        source.directory, gguf_file=source.gguf_file, dtype=torch_dtype
    ).eval()
    model.generation_config.eos_token_id = None
    out_tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            group = prompts[i : i + batch]
            width = max(len(p) for p in group)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
            out_tokens += (out.shape[1] - width) * len(group)
    return time.perf_counter() - start, out_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    prompts = make_prompts(args.num_prompts, args.input_len)
    in_tokens = sum(len(p) for p in prompts)
    single = make_prompts(1, 32, seed=1)
    single[0] = single[0][:32]
    results: dict[str, float] = {}

    llm, t, n = bench_treadle(prompts, args.output_len, args.dtype)
    results["treadle_batch_output_tok_s"] = n / t
    results["treadle_batch_total_tok_s"] = (n + in_tokens) / t
    _, t, n = bench_treadle(single, 256, args.dtype, llm)
    results["treadle_single_tok_s"] = n / t
    del llm

    if not args.skip_transformers:
        t, n = bench_transformers(prompts, args.output_len, args.dtype, batch=16)
        results["transformers_batch16_output_tok_s"] = n / t
        results["transformers_batch16_total_tok_s"] = (n + in_tokens) / t
        t, n = bench_transformers(single, 256, args.dtype, batch=1)
        results["transformers_single_tok_s"] = n / t
        results["ratio_batch_output"] = (
            results["treadle_batch_output_tok_s"] / results["transformers_batch16_output_tok_s"]
        )
        results["ratio_single"] = (
            results["treadle_single_tok_s"] / results["transformers_single_tok_s"]
        )

    print(
        f"\noffline throughput, dtype={args.dtype}, {args.num_prompts} x ~{args.input_len} in / "
        f"{args.output_len} out, at {select_isa()} (this CPU: {detect_isa()}, "
        f"PyTorch: {torch.backends.cpu.get_cpu_capability()})"
    )
    for key, value in results.items():
        print(f"  {key:40s} {value:10.2f}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"dtype": args.dtype, **results}, f, indent=2)


if __name__ == "__main__":
    main()
