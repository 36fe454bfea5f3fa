"""Pipeline parallelism on one host: -pp 2 vs -tp 2 vs one process, and the stage-to-stage
transfer.

- Transfer: one step's hidden + residual (hidden 576, float32) from one process to another and
  back, over the ZMQ ipc PUSH/PULL that the stages use (`worker/pp_transfer.py`) and, for
  comparison, over a pair of the shared-memory `MessageQueue(1, 1)` that carries the replies
  (pickle protocol 5, buffers out of band): half the round trip per size.
- Throughput: a random model whose heads split in 2 (hidden 512, 30 layers, 8 heads, 4 KV
  heads, tied 49152 vocab: ~120M parameters, as `tp_bench.py`), batched (32 x 128 in / 64
  out) and single-stream TPOT ((time of 65 tokens - time of 1) / 64), for one process, -pp 2
  and -tp 2 side by side in each round, and -pp 2 / -tp 2 with `--distributed-executor-backend
  ray` (when Ray is installed): Ray places the ranks, the steps take the same queues, so the
  per-step overhead of ray against mp should be nil; medians of the rounds.

On 2 cores neither PP nor TP can make one model faster: each of 2 ranks gets one core. What
PP buys is memory (each stage holds 1/pp of the layers and their KV), which pays across hosts.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

HIDDEN = 576
ROWS = (1, 64, 2048)


def _zmq_echo(inbox: str, outbox: str, n: int) -> None:
    from treadle.worker.pp_transfer import StageLink

    link = StageLink(inbox, outbox)
    for _ in range(n):
        link.send(*link.recv())
    link.close()


def _shm_echo(handles: tuple[object, object], n: int, ready: object) -> None:
    from treadle.ipc.shm_broadcast import MessageQueue

    inbox = MessageQueue.create_from_handle(handles[0], 0)  # type: ignore[arg-type]
    back = MessageQueue(1, 1)
    ready.send(back.export_handle())  # type: ignore[attr-defined]
    inbox.wait_until_ready()
    back.wait_until_ready()
    for _ in range(n):
        back.enqueue(inbox.dequeue())
    inbox.close()
    back.close()


def transfer(n: int = 300) -> None:
    import torch
    import zmq

    from treadle.ipc.shm_broadcast import MessageQueue
    from treadle.ipc.zmq_utils import get_open_zmq_ipc_path
    from treadle.worker.pp_transfer import StageLink

    ctx = multiprocessing.get_context("spawn")
    for rows in ROWS:
        hidden, residual = torch.randn(rows, HIDDEN), torch.randn(rows, HIDDEN)
        a, b = get_open_zmq_ipc_path(), get_open_zmq_ipc_path()
        child = ctx.Process(target=_zmq_echo, args=(a, b, n))
        child.start()
        link = StageLink(b, a)
        assert link.pull is not None
        link.pull.setsockopt(zmq.RCVTIMEO, 60_000)  # a lost echo process fails, not hangs
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            link.send(hidden, residual)
            link.recv()
            samples.append((time.perf_counter() - start) / 2 * 1e6)
        child.join()
        link.close()
        zmq_us = statistics.median(samples[n // 10 :])

        out = MessageQueue(1, 1, max_chunk_bytes=32 << 20)
        parent_end, child_end = ctx.Pipe()
        child = ctx.Process(target=_shm_echo, args=((out.export_handle(), None), n, child_end))
        child.start()
        back = MessageQueue.create_from_handle(parent_end.recv(), 0)
        out.wait_until_ready()
        back.wait_until_ready()
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            out.enqueue((hidden, residual))
            back.dequeue(timeout=60)
            samples.append((time.perf_counter() - start) / 2 * 1e6)
        child.join()
        out.close()
        back.close()
        shm_us = statistics.median(samples[n // 10 :])
        mb = 2 * rows * HIDDEN * 4 / 1e6
        print(
            f"  transfer {rows:5d} rows ({mb:6.2f} MB): zmq ipc {zmq_us:8.1f} us   "
            f"shm MessageQueue (pickle 5) {shm_us:8.1f} us"
        )


def measure(
    model: str, tp: int, pp: int, backend: str, prompts: list[list[int]]
) -> tuple[float, float]:
    """(batched output tok/s, single-stream TPOT in ms)."""
    from treadle import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="float32",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend=backend,
    )
    try:
        one = [{"prompt_token_ids": prompts[0][:16]}]
        llm.generate(one, SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
        times = {}
        for n in (1, 65):
            p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(one, p, use_tqdm=False)
            times[n] = time.perf_counter() - start
        return tok_s, (times[65] - times[1]) / 64 * 1e3
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-transfer", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument(
        "--skip-ray", action="store_true", help="no --distributed-executor-backend ray runs"
    )
    args = parser.parse_args()
    print("pipeline parallelism (benchmarks/pp_bench.py)")
    if not args.skip_transfer:
        transfer()
    if args.skip_throughput:
        return
    from conftest import build_tiny_model

    prompts = [[(13 * i + j) % 30000 + 100 for j in range(128)] for i in range(32)]
    layouts = {"one process": (1, 1, "mp"), "-pp 2": (1, 2, "mp"), "-tp 2": (2, 1, "mp")}
    if importlib.util.find_spec("ray") is not None and not args.skip_ray:
        # The same ranks placed by Ray (a local Ray cluster unless RAY_ADDRESS names one): Ray
        # is off the per-step path, so these should match their mp twins.
        layouts.update({"-pp 2 ray": (1, 2, "ray"), "-tp 2 ray": (2, 1, "ray")})
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in layouts}
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
        for r in range(args.rounds):
            for name, (tp, pp, backend) in layouts.items():
                runs[name].append(measure(str(path), tp, pp, backend, prompts))
                tok_s, tpot = runs[name][-1]
                print(
                    f"  round {r + 1} {name:12s} batched {tok_s:7.1f} tok/s   TPOT {tpot:6.1f} ms"
                )
    base_tok = statistics.median(t for t, _ in runs["one process"])
    base_tpot = statistics.median(t for _, t in runs["one process"])
    for name, samples in runs.items():
        tok_s = statistics.median(t for t, _ in samples)
        tpot = statistics.median(t for _, t in samples)
        print(
            f"  median {name:12s} batched {tok_s:7.1f} tok/s ({tok_s / base_tok:.2f}x)   "
            f"single-stream TPOT {tpot:6.1f} ms ({tpot / base_tpot:.2f}x)"
        )
    for layout in ("-pp 2", "-tp 2"):
        if f"{layout} ray" not in runs:
            continue
        pairs = list(zip(runs[f"{layout} ray"], runs[layout], strict=True))
        tpot_ratio = statistics.median(r[1] / m[1] for r, m in pairs)
        tok_ratio = statistics.median(r[0] / m[0] for r, m in pairs)
        print(
            f"  ray / mp {layout}: batched {tok_ratio:.2f}x, single-stream TPOT "
            f"{tpot_ratio:.2f}x (per-round ratios, median)"
        )


if __name__ == "__main__":
    main()
