"""Child-process targets and helpers for the ipc tests (importable by spawn and forkserver)."""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np
import torch

from treadle.ipc.process import (
    ChildProcess,
    ReadyPipe,
    shutdown_processes,
    start_process,
    wait_for_ready,
)
from treadle.ipc.shm_broadcast import Handle, MessageQueue

MiB = 1 << 20
IPC_TEST_DIR = os.path.dirname(os.path.abspath(__file__))


# -- a deterministic stream of mixed messages -------------------------------------------------


def make_message(rng: random.Random, i: int) -> Any:
    """Message `i` of the stream seeded by `rng`: every kind, sizes from 0 to 3 MiB."""
    kind = rng.random()
    if kind < 0.25:
        return i
    if kind < 0.40:
        return "x" * rng.randrange(0, 2000) + str(i)
    if kind < 0.55:
        return {"i": i, "tokens": [rng.randrange(50000) for _ in range(rng.randrange(64))]}
    if kind < 0.70:
        n = rng.randrange(0, 4000)
        dtype = rng.choice([np.float32, np.int64, np.uint8, np.float16])
        return np.random.default_rng(i).integers(0, 100, n).astype(dtype)
    if kind < 0.85:
        n = rng.randrange(0, 3000)
        t = torch.from_numpy(np.random.default_rng(i).standard_normal(n).astype(np.float32))
        return ("tensor", i, t.to(rng.choice([torch.float32, torch.bfloat16, torch.float16])))
    if kind < 0.95:
        return rng.randbytes(rng.randrange(0, 64 << 10))
    # Larger than a 1 MiB chunk now and then: they overflow to the XPUB socket.
    size = rng.randrange(600 << 10, 3 * MiB)
    if rng.random() < 0.5:
        return ("blob", i, rng.randbytes(size))
    return np.frombuffer(rng.randbytes(size // 4 * 4), dtype=np.float32).copy()


def messages(seed: int, count: int) -> list[Any]:
    rng = random.Random(seed)
    return [make_message(rng, i) for i in range(count)]


def same(a: Any, b: Any) -> bool:
    """Equal in type, and byte for byte for arrays and tensors."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.reshape(-1).view(torch.uint8).numpy().tobytes()
            == b.reshape(-1).view(torch.uint8).numpy().tobytes()
        )
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


# -- child targets ------------------------------------------------------------------------------


def _attach(ready: ReadyPipe, handle: Handle, rank: int) -> tuple[MessageQueue, MessageQueue]:
    """Attach to the broadcast queue as `rank`, make a reply queue, do the ready dance."""
    mq = MessageQueue.create_from_handle(handle, rank)
    reply = MessageQueue(1, 1, max_chunk_bytes=MiB, max_chunks=4)
    ready.send_ready(reply.export_handle())
    mq.wait_until_ready(timeout=60)
    reply.wait_until_ready(timeout=60)
    return mq, reply


def verify_reader(ready: ReadyPipe, handle: Handle, rank: int, seed: int, count: int) -> None:
    """Read `count` messages, compare each to the expected stream, reply (count, first bad)."""
    mq, reply = _attach(ready, handle, rank)
    expected = messages(seed, count)
    first_bad = None
    for i in range(count):
        got = mq.dequeue(timeout=60)
        if first_bad is None and not same(got, expected[i]):
            first_bad = i
    reply.enqueue((count, first_bad))
    mq.close()
    reply.close()


def echo_reader(ready: ReadyPipe, handle: Handle, rank: int) -> None:
    """Echo every message back on the reply queue, with this process's title; None ends."""
    import setproctitle

    mq, reply = _attach(ready, handle, rank)
    while True:
        msg = mq.dequeue()
        reply.enqueue((msg, rank, setproctitle.getproctitle()))
        if msg is None:
            break
    mq.close()
    reply.close()


def plain_reader(ready: ReadyPipe, handle: Handle, rank: int) -> None:
    """Owns nothing (no reply queue): reads until None, so killing it -9 leaks nothing."""
    mq = MessageQueue.create_from_handle(handle, rank)
    ready.send_ready(None)
    mq.wait_until_ready(timeout=60)
    while mq.dequeue() is not None:
        pass
    mq.close()


def sleeper(ready: ReadyPipe) -> None:
    ready.send_ready(os.getpid())
    while True:
        time.sleep(1)


def silent_sleeper(ready: ReadyPipe) -> None:
    """Never says READY."""
    while True:
        time.sleep(1)


def stubborn_sleeper(ready: ReadyPipe) -> None:
    """Ignores SIGTERM: only SIGKILL ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.send_ready(os.getpid())
    while True:
        time.sleep(1)


def fail_before_ready(ready: ReadyPipe, message: str) -> None:
    raise ValueError(message)


def exit_before_ready(ready: ReadyPipe, code: int) -> None:
    os._exit(code)


def noop(ready: ReadyPipe) -> None:
    ready.send_ready("ok")


def parent_main(method: str, n: int = 2) -> None:
    """Run as a separate program: start `n` sleepers, print their pids, then wait forever."""
    import multiprocessing

    ctx = multiprocessing.get_context(method)
    children = [start_process(sleeper, f"Sleeper_{i}", ctx=ctx) for i in range(n)]
    pids = wait_for_ready(children, timeout=60)
    print(" ".join(map(str, pids)), flush=True)
    while True:
        time.sleep(1)


# -- a writer with its reader processes ---------------------------------------------------------


class ReaderGroup:
    """A broadcast `MessageQueue`, one child per reader rank and their reply queues."""

    def __init__(
        self,
        ctx: BaseContext,
        target: Any,
        n: int,
        args: tuple[Any, ...] = (),
        max_chunk_bytes: int = MiB,
        max_chunks: int = 4,
    ):
        self.mq = MessageQueue(n, max_chunk_bytes=max_chunk_bytes, max_chunks=max_chunks)
        self.children: list[ChildProcess] = []
        self.replies: list[MessageQueue] = []
        try:
            handle = self.mq.export_handle()
            self.children = [
                start_process(target, f"Reader_{r}", (handle, r, *args), ctx=ctx) for r in range(n)
            ]
            handles = wait_for_ready(self.children, timeout=90)
            self.replies = [MessageQueue.create_from_handle(h, 0) for h in handles if h]
            self.mq.wait_until_ready(timeout=60)
            for q in self.replies:
                q.wait_until_ready(timeout=60)
        except BaseException:
            self.close()
            raise

    def gather(self, timeout: float = 60) -> list[Any]:
        return [q.dequeue(timeout=timeout) for q in self.replies]

    def close(self, timeout: float = 5) -> None:
        shutdown_processes(self.children, timeout=timeout, kill_timeout=5)
        for q in self.replies:
            q.close()
        self.mq.close()


if __name__ == "__main__":
    parent_main(sys.argv[1])
