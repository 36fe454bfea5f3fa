"""LoRA adapters on `treadle serve` of the default model (issue 40): output tok/s of 64
requests at concurrency 16 spread over 4 adapters (rank 16, every attention and MLP
projection) against the same requests on the base model alone, and the engine core's memory
each loaded adapter costs.

Run: `python benchmarks/lora_bench.py` (part of `make bench`). The adapters are made with
`peft` on an HF float32 copy of the default model (transformers reads the GGUF), in a
temporary folder."""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from lora_helpers import TARGETS_ATTN, TARGETS_MLP, make_adapter  # noqa: E402
from serve_helpers import RemoteServer  # noqa: E402
from treadle.config import default_model_path, resolve_model  # noqa: E402
from treadle.tokenizer import load_tokenizer  # noqa: E402


def hf_copy(out: Path) -> Path:
    """The default model as an HF float32 directory (what peft builds adapters on)."""
    from transformers import AutoModelForCausalLM

    gguf = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
    )
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(model.state_dict())
    fresh.save_pretrained(out)
    load_tokenizer(resolve_model(None)).save_pretrained(out)
    return out


def throughput(client: openai.OpenAI, models: list[str], requests: int, tokens: int) -> float:
    def one(i: int) -> int:
        out = client.completions.create(
            model=models[i % len(models)],
            prompt=f"Write a short story about a robot, number {i}.",
            max_tokens=tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return out.usage.completion_tokens if out.usage else 0

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        total = sum(pool.map(one, range(requests)))
    return total / (time.perf_counter() - start)


def engine_rss(server: RemoteServer) -> int:
    return psutil.Process(server.pid_of("treadle::EngineCore_DP0")).memory_info().rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = hf_copy(root / "smollm2-f32")
        adapters = [
            make_adapter(base, root / "adapters" / f"a{i}", 16, TARGETS_ATTN + TARGETS_MLP, i)
            for i in range(4)
        ]
        # a0 from the command line; a1..a3 loaded while serving (from a0's folder, the one
        # the load endpoint takes), so that the engine's memory shows what each costs.
        server = RemoteServer(
            [
                *(default_model_path(), "--enable-lora", "--max-loras", "4"),
                *("--max-lora-rank", "16", "--lora-modules", f"a0={adapters[0]}"),
            ],
            root,
            env={"TREADLE_ALLOW_RUNTIME_LORA_UPDATING": "1"},
        )
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
            base_name = client.models.list().data[0].id
            before = engine_rss(server)
            names = ["a0"]
            for i, path in enumerate(adapters[1:], start=1):
                r = httpx.post(
                    server.url + "/v1/load_lora_adapter",
                    json={"lora_name": f"a{i}", "lora_path": str(path)},
                    timeout=60,
                )
                if r.status_code != 200:
                    raise SystemExit(f"loading a{i}: {r.text}")
                names.append(f"a{i}")
            per_adapter = (engine_rss(server) - before) / (len(adapters) - 1) / 2**20
            throughput(client, [base_name], 16, 8)  # warm up
            throughput(client, names, 16, 8)
            plains, spreads = [], []
            for _ in range(args.rounds):  # (alternating: the machine's other load hits both)
                plains.append(throughput(client, [base_name], args.requests, args.tokens))
                spreads.append(throughput(client, names, args.requests, args.tokens))
                print(
                    f"{args.requests} requests x {args.tokens} tokens at concurrency 16: base "
                    f"{plains[-1]:.1f} tok/s, over 4 adapters {spreads[-1]:.1f} tok/s "
                    f"({spreads[-1] / plains[-1]:.2f}x)",
                    flush=True,
                )
            print(
                f"best of {args.rounds} rounds: base {max(plains):.1f} tok/s, over 4 adapters "
                f"{max(spreads):.1f} tok/s ({max(spreads) / max(plains):.2f}x)"
            )
            print(f"engine core memory per loaded adapter (rank 16): {per_adapter:.1f} MiB")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
