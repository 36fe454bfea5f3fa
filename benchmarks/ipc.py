"""IPC benchmark: MessageQueue broadcast and round trip, ROUTER/DEALER requests, PUSH/PULL outputs,
request tensors with --tensor-ipc direct and shm.

Run: `python benchmarks/ipc.py` (part of `make bench`). Every peer is a real process (spawn).
Figures to compare with (vLLM 0.32 on the same 2-core machine) are in the module's issue.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from typing import Any

import msgspec
import numpy as np
import psutil
import torch
import zmq

from treadle.ipc.engine_auth import routing_id
from treadle.ipc.process import ReadyPipe, shutdown_processes, start_process, wait_for_ready
from treadle.ipc.serial import MsgpackDecoder, MsgpackEncoder
from treadle.ipc.shm_broadcast import Handle, MessageQueue
from treadle.ipc.tensor_ring import TensorRingReader, TensorRingWriter, ring_name
from treadle.ipc.zmq_utils import EngineCoreRequestType, get_open_zmq_ipc_path, make_zmq_socket
from treadle.sampling_params import SamplingParams
from treadle.wire.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest

MiB = 1 << 20
SIZES = [1 << 10, 64 << 10, 1 << 20, 8 << 20]
BENCHES = ["broadcast", "roundtrip", "idle", "requests", "outputs", "tensors"]
# The seed's image tensor, and a long prompt_embeds of a 576-wide model.
TENSORS = {
    "[3, 336, 336] float16": ((3, 336, 336), torch.float16),
    "8192 x 576 float32": ((8192, 576), torch.float32),
}


# -- children -------------------------------------------------------------------------------


def mq_worker(ready: ReadyPipe, handle: Handle, rank: int) -> None:
    """Reads the broadcast queue and answers on its own reply queue (handle sent with READY).

    ("burst", n): read n more messages, then reply once; ("rt", i, ...): reply at once.
    """
    mq = MessageQueue.create_from_handle(handle, rank)
    reply = MessageQueue(1, 1, max_chunk_bytes=MiB, max_chunks=10)
    ready.send_ready(reply.export_handle())
    mq.wait_until_ready()
    reply.wait_until_ready()
    while True:
        msg = mq.dequeue()
        if msg is None:
            break
        if msg[0] == "burst":
            for _ in range(msg[1]):
                mq.dequeue()
        reply.enqueue(("ok", rank))
    mq.close()
    reply.close()


class Workers:
    """A broadcast queue, n `mq_worker` processes and their reply queues."""

    def __init__(self, ctx: Any, n: int, max_chunk_bytes: int, max_chunks: int):
        self.mq = MessageQueue(n, max_chunk_bytes=max_chunk_bytes, max_chunks=max_chunks)
        self.procs = [
            start_process(mq_worker, f"Worker_TP{r}", (self.mq.export_handle(), r), ctx=ctx)
            for r in range(n)
        ]
        self.replies: list[MessageQueue] = []
        try:
            handles = wait_for_ready(self.procs, 120)
            self.replies = [MessageQueue.create_from_handle(h, 0) for h in handles]
            self.mq.wait_until_ready()
            for q in self.replies:
                q.wait_until_ready()
        except BaseException:
            self.close()
            raise

    def gather(self) -> None:
        for q in self.replies:
            q.dequeue(timeout=60)

    def close(self) -> None:
        if self.replies:
            self.mq.enqueue(None, timeout=5)
        shutdown_processes(self.procs, timeout=10)
        for q in self.replies:
            q.close()
        self.mq.close()


def engine_input(ready: ReadyPipe, addr: str, result_addr: str, count: int) -> None:
    """A DEALER that receives and decodes `count` ADD requests, then reports the elapsed time."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = make_zmq_socket(ctx, addr, zmq.DEALER, bind=False, identity=routing_id())
    out = make_zmq_socket(ctx, result_addr, zmq.PUSH, bind=False)
    decoder = MsgpackDecoder(EngineCoreRequest)
    sock.send(b"READY")  # registers the identity with the ROUTER
    ready.send_ready()
    for _ in range(2):  # warm-up round, timed round
        start = None
        for _ in range(count):
            frames = sock.recv_multipart(copy=False)
            if start is None:
                start = time.perf_counter()
            assert frames[0].bytes == EngineCoreRequestType.ADD.value
            req = decoder.decode(frames[1:])
            assert len(req.prompt_token_ids) == 128
        out.send_pyobj(time.perf_counter() - (start or 0.0))
    sock.close()
    out.close()
    ctx.term()


def engine_tensor_input(ready: ReadyPipe, addr: str, result_addr: str) -> None:
    """A DEALER that decodes ADD requests with a tensor (from the ring of the front end at
    `addr`, too) and answers each with the tensor's byte count; an empty message ends it."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = make_zmq_socket(ctx, addr, zmq.DEALER, bind=False, identity=routing_id())
    out = make_zmq_socket(ctx, result_addr, zmq.PUSH, bind=False)
    decoder = MsgpackDecoder(EngineCoreRequest, tensor_rings=TensorRingReader([ring_name(addr)]))
    sock.send(b"READY")
    ready.send_ready()
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 1:
            break
        req = decoder.decode(frames[1:])
        out.send(str(req.prompt_embeds.nbytes).encode())
    sock.close()
    out.close()
    ctx.term()


def engine_output(ready: ReadyPipe, addr: str, count: int, batch: int) -> None:
    """A PUSH that encodes and sends `count` EngineCoreOutputs of `batch` requests each."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = make_zmq_socket(ctx, addr, zmq.PUSH, bind=False)
    encoder = MsgpackEncoder()
    ready.send_ready()
    outputs = [EngineCoreOutput(f"req-{i}", [1000 + i]) for i in range(batch)]
    for _ in range(2 * count):
        sock.send_multipart(encoder.encode(EngineCoreOutputs(outputs=outputs)), copy=False)
    sock.close(linger=-1)
    ctx.term()


# -- measurements ---------------------------------------------------------------------------


def memcpy_gbps(nbytes: int) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    reps = max(5, int(1e9 // nbytes))
    start = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    return nbytes * reps / (time.perf_counter() - start) / 1e9


def bench_broadcast(ctx: Any, seconds: float) -> None:
    print("MessageQueue broadcast to 2 reader processes (16 MiB chunks x 10)")
    print(f"{'size':>8} {'msgs/s':>10} {'GB/s/reader':>12} {'memcpy GB/s':>12} {'ratio':>6}")
    workers = Workers(ctx, 2, max_chunk_bytes=16 * MiB, max_chunks=10)
    try:
        for size in SIZES:
            msg = np.ones(size, np.uint8)
            count = max(50, int(seconds * 5e9 / 2 / max(size, 256 << 10)))
            for n in (max(10, count // 10), count):  # warm-up, timed
                start = time.perf_counter()
                workers.mq.enqueue(("burst", n))
                for _ in range(n):
                    workers.mq.enqueue(msg)
                workers.gather()
                elapsed = time.perf_counter() - start
            rate = n / elapsed
            copy = memcpy_gbps(size)
            gbps = rate * size / 1e9
            print(f"{_fmt(size):>8} {rate:>10.0f} {gbps:>12.2f} {copy:>12.2f} {gbps / copy:>6.2f}")
        print(f"(memcpy of 64 MiB: {memcpy_gbps(64 * MiB):.2f} GB/s)")
    finally:
        workers.close()


def bench_round_trip(ctx: Any, rounds: int) -> None:
    workers = Workers(ctx, 2, max_chunk_bytes=MiB, max_chunks=10)
    try:
        latencies = []
        for i in range(rounds + rounds // 10):
            start = time.perf_counter()
            workers.mq.enqueue(("rt", i, {}, None))
            workers.gather()
            latencies.append(time.perf_counter() - start)
        lat = sorted(latencies[rounds // 10 :])
        p50, p99 = lat[len(lat) // 2] * 1e6, lat[int(len(lat) * 0.99)] * 1e6
        print(
            f"Round trip writer -> 2 workers -> reply queues: p50 {p50:.1f} us, "
            f"p99 {p99:.1f} us, mean {statistics.fmean(lat) * 1e6:.1f} us ({rounds} rounds)"
        )
    finally:
        workers.close()


def bench_idle_reader(ctx: Any) -> None:
    workers = Workers(ctx, 1, max_chunk_bytes=MiB, max_chunks=4)
    try:
        proc = psutil.Process(workers.procs[0].pid)
        for label, period in (("idle", None), ("one message every 20 ms", 0.02)):
            workers.mq.enqueue(("rt", 0))
            workers.gather()
            time.sleep(0.2)
            t0, c0 = time.monotonic(), sum(proc.cpu_times()[:2])
            while time.monotonic() - t0 < 2.0:
                if period is None:
                    time.sleep(0.1)
                    continue
                time.sleep(period)
                workers.mq.enqueue(("rt", 0))
                workers.gather()
            cpu = (sum(proc.cpu_times()[:2]) - c0) / (time.monotonic() - t0)
            print(f"Reader process CPU, {label}: {cpu * 100:.1f}% of a core")
    finally:
        workers.close()


def _request() -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id="cmpl-0123456789abcdef",
        prompt_token_ids=list(range(1000, 1128)),
        sampling_params=SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256),
        eos_token_id=2,
        arrival_time=time.time(),
    )


def bench_requests(ctx: Any, count: int) -> None:
    zctx: zmq.Context[Any] = zmq.Context()
    addr, result_addr = get_open_zmq_ipc_path(), get_open_zmq_ipc_path()
    router = make_zmq_socket(zctx, addr, zmq.ROUTER)
    results = make_zmq_socket(zctx, result_addr, zmq.PULL)
    engine = [start_process(engine_input, "EngineCore_DP0", (addr, result_addr, count), ctx=ctx)]
    try:
        wait_for_ready(engine, 120)
        identity, _ = router.recv_multipart()
        encoder = MsgpackEncoder()
        req = _request()
        add = EngineCoreRequestType.ADD.value
        for _ in range(2):
            start = time.perf_counter()
            for _ in range(count):
                router.send_multipart([identity, add, *encoder.encode(req)], copy=False)
            engine_elapsed = results.recv_pyobj()
            sent = time.perf_counter() - start
        rate = count / max(engine_elapsed, sent)
        print(
            f"Front end -> engine ADD over ROUTER/DEALER (128-token EngineCoreRequest, "
            f"encode + decode): {rate:,.0f} requests/s"
        )
        shutdown_processes(engine, timeout=10)
    finally:
        shutdown_processes(engine, timeout=1)
        router.close()
        results.close()
        zctx.term()


def bench_outputs(ctx: Any, count: int, batch: int) -> None:
    zctx: zmq.Context[Any] = zmq.Context()
    addr = get_open_zmq_ipc_path()
    pull = make_zmq_socket(zctx, addr, zmq.PULL)
    engine = [start_process(engine_output, "EngineCore_DP0", (addr, count, batch), ctx=ctx)]
    try:
        wait_for_ready(engine, 120)
        decoder = MsgpackDecoder(EngineCoreOutputs)
        for _ in range(2):
            start = time.perf_counter()
            for _ in range(count):
                outs = decoder.decode(pull.recv_multipart(copy=False))
                assert len(outs.outputs) == batch
            elapsed = time.perf_counter() - start
        print(
            f"Engine -> front end EngineCoreOutputs ({batch} requests each) over PUSH/PULL, "
            f"received and decoded: {count / elapsed:,.0f} messages/s"
        )
        shutdown_processes(engine, timeout=10)
    finally:
        shutdown_processes(engine, timeout=1)
        pull.close()
        zctx.term()


def bench_tensors(ctx: Any, rounds: int) -> None:
    """One request at a time (send, the engine decodes it into its own tensor, answers):
    latency and the ZMQ message's size, --tensor-ipc direct against shm."""
    zctx: zmq.Context[Any] = zmq.Context()
    addr, result_addr = get_open_zmq_ipc_path(), get_open_zmq_ipc_path()
    router = make_zmq_socket(zctx, addr, zmq.ROUTER)
    results = make_zmq_socket(zctx, result_addr, zmq.PULL)
    ring = TensorRingWriter(ring_name(addr), 32 * MiB)
    engine = [start_process(engine_tensor_input, "EngineCore_DP0", (addr, result_addr), ctx=ctx)]
    add = EngineCoreRequestType.ADD.value
    try:
        wait_for_ready(engine, 120)
        identity, _ = router.recv_multipart()
        for label, (shape, dtype) in TENSORS.items():
            tensor = torch.randn(shape).to(dtype)
            req = msgspec.structs.replace(_request(), prompt_embeds=tensor)
            n = max(10, rounds if tensor.nbytes < 4 * MiB else rounds // 10)
            for mode, encoder in (
                ("direct", MsgpackEncoder()),
                ("shm", MsgpackEncoder(tensor_ring=ring)),
            ):
                times = []
                for i in range(n + 5):  # 5 to warm up
                    start = time.perf_counter()
                    frames = encoder.encode(req)
                    router.send_multipart([identity, add, *frames], copy=False)
                    assert int(results.recv()) == tensor.nbytes
                    if i >= 5:
                        times.append(time.perf_counter() - start)
                size = sum(memoryview(f).nbytes for f in frames)
                print(
                    f"Request with a {label} tensor ({tensor.nbytes / MiB:.2f} MiB), --tensor-ipc "
                    f"{mode}: ZMQ message {size:,} bytes in {len(frames)} frame(s); send -> "
                    f"decoded in the engine: median {statistics.median(times) * 1e3:.3f} ms, "
                    f"mean {statistics.fmean(times) * 1e3:.3f} ms ({n} requests)"
                )
        router.send_multipart([identity, b""])
        shutdown_processes(engine, timeout=10)
    finally:
        shutdown_processes(engine, timeout=1)
        ring.close()
        router.close()
        results.close()
        zctx.term()


def _fmt(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // 1024} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=1.0, help="rough time per size")
    parser.add_argument("--rounds", type=int, default=5000, help="round trips to time")
    parser.add_argument("--requests", type=int, default=50_000, help="requests to time")
    parser.add_argument(
        "--only", nargs="*", choices=BENCHES, default=BENCHES, help="run only these parts"
    )
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    if "broadcast" in args.only:
        bench_broadcast(ctx, args.seconds)
    if "roundtrip" in args.only:
        bench_round_trip(ctx, args.rounds)
    if "idle" in args.only:
        bench_idle_reader(ctx)
    if "requests" in args.only:
        bench_requests(ctx, args.requests)
    if "outputs" in args.only:
        bench_outputs(ctx, args.requests, batch=8)
    if "tensors" in args.only:
        bench_tensors(ctx, args.rounds // 25)


if __name__ == "__main__":
    main()
