"""A process that used the shared-memory queue exits at once, releasing what the queues held
(issue 28, item 8): their contexts' IO threads, sockets, ipc files and segments, without the
script closing anything."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Run as a script: an atexit hook registered before treadle is imported runs after every other
# one, and reports when that is and the threads still alive then (zmq IO threads are native:
# /proc shows them). (What the interpreter does after it, such as unloading torch, takes
# over a second on a busy machine with or without treadle: not measured.)
SCRIPT = textwrap.dedent(
    """
    import atexit, gc, os, sys, threading, time
    import zmq

    def last_words():
        print("threads at exit", len(os.listdir("/proc/self/task")), flush=True)
        print("exiting", time.time(), flush=True)

    atexit.register(last_words)
    import torch  # (its helper thread is there before and after)
    print("threads before", len(os.listdir("/proc/self/task")), flush=True)

    from treadle.ipc.shm_broadcast import MessageQueue
    from treadle.ipc.shm_message import MsgpackCodec

    def build():
        writer = MessageQueue(
            3, 2, max_chunk_bytes=1 << 16, connect_ip="127.0.0.1", codec=MsgpackCodec()
        )
        handle = writer.export_handle()
        readers = [MessageQueue.create_from_handle(handle, r, MsgpackCodec()) for r in range(3)]
        ts = [threading.Thread(target=r.wait_until_ready, args=(30,)) for r in readers]
        for t in ts:
            t.start()
        writer.wait_until_ready(30)
        for t in ts:
            t.join()
        for i in range(4):
            writer.enqueue(b"x" * (200_000 if i % 2 else 10))
        for r in readers:
            r.dequeue(5)
        return writer, readers

    if sys.argv[1] == "gc":  # dropped in the middle of a program: released at once
        build()
        gc.collect()
        print("threads after gc", len(os.listdir("/proc/self/task")), flush=True)
    else:
        kept = build()  # held until the end
    print("returning", time.time(), flush=True)
    """
)


def _run(mode: str, rpc_dir: Path) -> tuple[dict[str, float], str]:
    env = {
        **os.environ,
        "TREADLE_RPC_BASE_PATH": str(rpc_dir),
        "PYTHONWARNINGS": "error::ResourceWarning",
    }
    proc = subprocess.run(
        [sys.executable, "-X", "dev", "-c", SCRIPT, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    values = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.rpartition(" ")
        values[key] = float(value)
    return values, proc.stderr


@pytest.mark.serial
@pytest.mark.parametrize("mode", ["exit", "gc"])
def test_a_script_with_queues_exits_at_once_and_leaves_nothing(mode: str, rpc_dir: Path) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    values, stderr = _run(mode, rpc_dir)  # (a short path: ipc addresses have 107 bytes)
    assert values["exiting"] - values["returning"] < 1.0
    assert "Exception ignored" not in stderr and "BufferError" not in stderr, stderr
    assert "ResourceWarning" not in stderr, stderr
    # Every zmq context was terminated (its IO and reaper threads ended) before the exit.
    assert values["threads at exit"] <= values["threads before"]
    if mode == "gc":
        assert values["threads after gc"] <= values["threads before"]
    assert list(rpc_dir.iterdir()) == []  # no ipc socket file left
    new = {n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("treadle_")}
    assert not new
