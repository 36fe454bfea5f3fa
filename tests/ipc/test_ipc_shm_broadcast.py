"""treadle.ipc.shm_broadcast: the shared-memory MessageQueue, with real processes and memory."""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ipc_children
import msgspec
import numpy as np
import psutil
import pytest
import torch
from ipc_children import MiB, ReaderGroup, messages, same

from treadle.ipc import shm_ring
from treadle.ipc.shm_broadcast import MessageQueue, MessageQueueShutdown, ShmRingBuffer
from treadle.ipc.shm_message import MsgpackCodec, PickleCodec

SPAWN = multiprocessing.get_context("spawn")


class InProcess:
    """A writer and `n` readers in this process (threads only for the ready barrier)."""

    def __init__(self, n: int = 1, n_local: int | None = None, **kwargs: Any):
        # Readers on "another host" (n_local < n) read msgpack: the queue refuses pickle there.
        remote = n_local is not None and n_local < n
        codec = MsgpackCodec if remote else PickleCodec
        self.writer = MessageQueue(n, n_local, connect_ip="127.0.0.1", codec=codec(), **kwargs)
        handle = pickle.loads(pickle.dumps(self.writer.export_handle()))  # as if sent
        self.readers = [MessageQueue.create_from_handle(handle, r, codec()) for r in range(n)]
        threads = [threading.Thread(target=r.wait_until_ready, args=(30,)) for r in self.readers]
        for t in threads:
            t.start()
        self.writer.wait_until_ready(timeout=30)
        for t in threads:
            t.join()

    def close(self) -> None:
        for r in self.readers:
            r.close()
        self.writer.close()


@pytest.fixture
def pair() -> Iterator[InProcess]:
    queues = InProcess(1, max_chunk_bytes=MiB, max_chunks=4)
    yield queues
    queues.close()


@pytest.mark.timeout(120)
def test_three_spawned_readers_get_every_message_in_order() -> None:
    count, seed = 2000, 42
    group = ReaderGroup(SPAWN, ipc_children.verify_reader, 3, args=(seed, count))
    try:
        sent = messages(seed, count)
        assert sum(1 for m in sent if _nbytes(m) > MiB) >= 5  # some overflow a chunk
        for msg in sent:
            group.mq.enqueue(msg, timeout=60)
        assert group.gather() == [(count, None)] * 3  # all received, none different
    finally:
        group.close()


def _nbytes(msg: Any) -> int:
    if isinstance(msg, np.ndarray):
        return msg.nbytes
    if isinstance(msg, tuple) and isinstance(msg[-1], bytes):
        return len(msg[-1])
    return 0


@pytest.mark.timeout(60)
def test_out_of_band_buffers_inside_a_chunk() -> None:
    queues = InProcess(2, max_chunk_bytes=8 * MiB, max_chunks=3)
    try:
        msgs = [
            ("arrays", np.arange(MiB, dtype=np.float32), torch.arange(600_000, dtype=torch.int32)),
            torch.randn(512, 1024).to(torch.bfloat16),  # 1 MiB: out of band
            {"small": torch.ones(3), "big": np.ones((1024, 1024), np.uint8)},
        ] * 3
        for msg in msgs:
            queues.writer.enqueue(msg, timeout=10)
            for reader in queues.readers:
                got = reader.dequeue(timeout=10)
                assert same(got, msg)
        got_array = got["big"]
        assert got_array.flags.writeable and got_array.flags.owndata is False
    finally:
        queues.close()


def test_remote_reader_over_tcp() -> None:
    queues = InProcess(2, n_local=1, max_chunk_bytes=MiB, max_chunks=4)
    try:
        local, remote = queues.readers
        assert remote.buffer is None and queues.writer.export_handle().remote_subscribe_addr
        assert queues.writer.export_handle().remote_subscribe_addr.startswith("tcp://127.0.0.1:")
        for msg in ["a", np.arange(10), b"x" * (2 * MiB), ["t", torch.ones(400_000)]]:
            queues.writer.enqueue(msg, timeout=10)
            assert same(local.dequeue(timeout=10), msg)
            assert same(remote.dequeue(timeout=10), msg)
    finally:
        queues.close()


def test_a_queue_read_on_another_host_never_carries_pickle(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="readers on other hosts cannot carry pickle"):
        MessageQueue(2, 1, connect_ip="127.0.0.1", codec=PickleCodec())
    queues = InProcess(2, n_local=1, max_chunk_bytes=MiB, max_chunks=4)
    try:
        handle = queues.writer.export_handle()
        assert handle.codec == "msgpack"
        with pytest.raises(ValueError, match="carries 'msgpack'; the reader's codec is 'pickle'"):
            MessageQueue.create_from_handle(handle, 1, PickleCodec())
        forged = pickle.loads(pickle.dumps(handle))
        forged.codec = "pickle"  # a handle that lies: the remote reader still refuses pickle
        with pytest.raises(ValueError, match="another host never reads pickle"):
            MessageQueue.create_from_handle(forged, 1, PickleCodec())

        # A pickle sent on the tcp socket (as a peer that took the writer's place would) is
        # refused by the msgpack reader, and what it names never runs.
        marker = tmp_path / "ran"

        class Exploit:
            def __reduce__(self) -> tuple[Any, ...]:
                return (os.system, (f"touch {marker}",))

        local, remote = queues.readers
        assert queues.writer.remote_socket is not None
        queues.writer.remote_socket.send_multipart([pickle.dumps(Exploit())])
        with pytest.raises(msgspec.DecodeError):
            remote.dequeue(timeout=10)
        assert not marker.exists()
        queues.writer.enqueue({"after": 1}, timeout=10)  # and the queue goes on
        assert remote.dequeue(timeout=10) == {"after": 1}
        assert local.dequeue(timeout=10) == {"after": 1}
    finally:
        queues.close()


def test_enqueue_times_out_when_a_reader_stops(pair: InProcess) -> None:
    for i in range(4):  # fills the 4-chunk ring
        pair.writer.enqueue(i, timeout=1)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"reader rank\(s\) \[0\]"):
        pair.writer.enqueue("one too many", timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 2
    assert pair.readers[0].dequeue(timeout=1) == 0  # nothing lost or reordered
    pair.writer.enqueue(4, timeout=1)
    assert [pair.readers[0].dequeue(timeout=1) for _ in range(4)] == [1, 2, 3, 4]


def test_dequeue_times_out(pair: InProcess) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        pair.readers[0].dequeue(timeout=0.2)
    assert time.monotonic() - start < 1.5


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_blocked_writer_warns_periodically(
    pair: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TREADLE_RINGBUFFER_WARNING_INTERVAL", "0.2")
    records = Records()
    logger = logging.getLogger("treadle.ipc.shm_broadcast")
    logger.addHandler(records)
    try:
        for i in range(4):
            pair.writer.enqueue(i)
        writer = threading.Thread(target=pair.writer.enqueue, args=("blocked",))
        writer.start()  # no timeout: blocks, warning every 0.2 s
        deadline = time.monotonic() + 10
        while len(records.messages) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(records.messages) >= 2
        assert "No free chunk" in records.messages[0] and "[0]" in records.messages[0]
        assert writer.is_alive()
        assert pair.readers[0].dequeue(timeout=1) == 0  # frees a chunk: the writer goes on
        writer.join(5)
        assert not writer.is_alive()
        assert [pair.readers[0].dequeue(timeout=1) for _ in range(4)] == [1, 2, 3, "blocked"]
    finally:
        logger.removeHandler(records)


def test_shutdown_wakes_a_parked_reader(pair: InProcess) -> None:
    errors: list[BaseException] = []

    def read() -> None:
        try:
            pair.readers[0].dequeue()
        except BaseException as e:
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.5)  # well past the spin: parked
    start = time.monotonic()
    pair.readers[0].shutdown()
    reader.join(5)
    assert not reader.is_alive() and time.monotonic() - start < 0.5
    assert len(errors) == 1 and isinstance(errors[0], MessageQueueShutdown)


def test_shutdown_wakes_a_blocked_writer(pair: InProcess) -> None:
    for i in range(4):
        pair.writer.enqueue(i)
    threading.Timer(0.3, pair.writer.shutdown).start()
    with pytest.raises(MessageQueueShutdown):
        pair.writer.enqueue("never")


@pytest.mark.timeout(90)
def test_idle_reader_parks_and_wakes() -> None:
    group = ReaderGroup(SPAWN, ipc_children.echo_reader, 1)
    try:
        group.mq.enqueue("hello")
        assert group.gather()[0][0] == "hello"
        time.sleep(0.5)
        proc = psutil.Process(group.children[0].pid)
        wall0, cpu0 = time.monotonic(), sum(proc.cpu_times()[:2])
        time.sleep(2.0)
        cpu = (sum(proc.cpu_times()[:2]) - cpu0) / (time.monotonic() - wall0)
        assert cpu < 0.05, f"an idle reader used {cpu:.1%} of a core"
        start = time.monotonic()
        group.mq.enqueue("wake up")
        msg, rank, title = group.gather()[0]
        assert (msg, rank) == ("wake up", 0) and title.startswith("treadle::Reader_0")
        assert time.monotonic() - start < 1.0  # woken, not found by a periodic re-check
        group.mq.enqueue(None)
        assert group.gather()[0][0] is None
    finally:
        group.close()


@pytest.mark.timeout(90)
def test_killed_reader_leaves_nothing_behind(rpc_dir: Path) -> None:
    group = ReaderGroup(SPAWN, ipc_children.plain_reader, 2)
    try:
        group.mq.enqueue("before")
        victim = group.children[1].process
        victim.kill()
        victim.join(10)
        assert victim.exitcode == -9
        with pytest.raises(TimeoutError, match=r"\[1\]"):
            for i in range(10):
                group.mq.enqueue(i, timeout=0.5)
    finally:
        group.close(timeout=0.1)  # the survivor waits for more: SIGTERM it
    # The rpc_dir fixture then checks that no socket file and no segment is left.


def test_creator_unlinks_and_attachers_do_not(rpc_dir: Path) -> None:
    ring = ShmRingBuffer(2, 4096, 3)
    name = ring.name
    other = pickle.loads(pickle.dumps(ring))  # attaches by handle
    assert not other.is_creator and other.metadata.nbytes == 3 * 3
    other.metadata[0] = 1
    assert ring.metadata[0] == 1  # the same memory
    other.close()
    assert Path("/dev/shm", name).exists()  # an attacher never unlinks
    ring.close()
    assert not Path("/dev/shm", name).exists()


def test_not_enough_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_ring, "shm_free_bytes", lambda: 10 * MiB)
    with pytest.raises(RuntimeError, match=r"needs 160\.0 MiB.*only 10\.0 MiB.*--shm-size"):
        MessageQueue(2, max_chunk_bytes=16 * MiB)


def test_chunk_size_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_MQ_MAX_CHUNK_BYTES_MB", "2")
    mq = MessageQueue(1)
    try:
        assert mq.buffer is not None and mq.buffer.max_chunk_bytes == 2 * MiB
        assert mq.buffer.max_chunks == 10
    finally:
        mq.close()
