"""`MessageQueue`: one writer broadcasts Python objects to n readers (channel 3, ARCHITECTURE §4).

Local readers share one `ShmRingBuffer` (`treadle.ipc.shm_ring`), a POSIX shared-memory segment:

    +---------+---------+-----+-------------+-------------+-----+-------------+
    | chunk 0 | chunk 1 | ... | chunk N-1   | metadata 0  | ... | metadata N-1|
    +---------+---------+-----+-------------+-------------+-----+-------------+
    |<---- max_chunks x max_chunk_bytes --->|<- max_chunks x (1 + n_reader) ->|

    metadata i = | written | read by reader 0 | ... | read by reader n-1 |   (one byte each)

    written=0, any read flags  -> the writer may write the chunk; readers wait
    written=1, my flag 0       -> I (a reader) may read it
    written=1, my flag 1       -> I have read it; I wait for the writer
    written=1, all flags 1     -> every reader is done; the writer may write it again

The writer sets written=0, writes, clears every read flag, then sets written=1 (fences between);
a reader sets only its own flag, in a `finally`, after copying out what it keeps. Writer and
readers walk the chunks in order, so the ring is also the message order. A chunk holds

    | overflow: u8 | n buffers: u32 | n x length: u64 | buffer 0 | buffer 1 | ... |

Buffer 0 is the message as its codec writes it (`treadle.ipc.shm_message`: a protocol-5 pickle
by default, or msgpack); arrays of 1 MiB or more follow out of band. A message too large for a
chunk writes only overflow=1 there, keeping its place in the order, and goes as frames over a
ZMQ XPUB socket.
Readers on another host (`n_local_reader < n_reader`) get every message over a tcp XPUB. Such a
queue carries msgpack, never pickle: the writer refuses a pickle codec when it has remote
readers, and a remote reader refuses one at attach (`Codec.cross_host`).

Waiting (spin, nap, park; a writer facing a full ring): `ipc/shm_wait.py`.

Set-up: the creator (writer) makes the queue and passes `export_handle()` to the readers, who
call `MessageQueue.create_from_handle(handle, rank)`; then every party calls `wait_until_ready()`
(the writer collects one subscription per reader, then sends READY), in the same order on every
queue.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import zmq

from treadle import envs
from treadle.ipc import cluster_auth
from treadle.ipc.serial import Buffer
from treadle.ipc.shm_message import (
    Codec,
    PickleCodec,
    is_overflow,
    read_chunk,
    write_chunk,
)
from treadle.ipc.shm_ring import ShmRingBuffer, memory_fence, unlink_orphaned_segment
from treadle.ipc.shm_wait import MessageQueueShutdown, RingWaits
from treadle.ipc.zmq_utils import (
    close_context,
    get_bound_address,
    get_ip,
    get_open_zmq_ipc_path,
    get_tcp_uri,
    make_zmq_socket,
    split_zmq_path,
)
from treadle.logger import init_logger

__all__ = ["Handle", "MessageQueue", "MessageQueueShutdown", "ShmRingBuffer"]

logger = init_logger(__name__)

_READY = b"READY"
_LINGER_MS = 1000  # writer sockets: time for queued overflow frames to leave at close


@dataclass
class Handle:
    """Everything a reader needs to attach; picklable."""

    local_reader_ranks: list[int] = field(default_factory=list)
    buffer_handle: tuple[int, int, int, str] | None = None
    local_subscribe_addr: str | None = None
    local_notify_addr: str | None = None
    remote_subscribe_addr: str | None = None
    remote_addr_ipv6: bool = False
    codec: str = PickleCodec.name  # the writer's codec's name: a reader's must be the same


class MessageQueue(RingWaits):
    """Broadcast queue: `enqueue` on the writer, `dequeue` on each reader (module docstring)."""

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int | None = None,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int | None = None,
        max_chunks: int = 10,
        connect_ip: str | None = None,
        codec: Codec | None = None,
    ):
        """`codec`: how messages are serialized (default `PickleCodec`: this host's readers only;
        a queue with remote readers needs a `cross_host` one, e.g. `MsgpackCodec`)."""
        if codec is None:
            codec = PickleCodec()
        if n_local_reader is None:
            n_local_reader = n_reader
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        if not 0 <= n_local_reader <= n_reader or len(local_reader_ranks) != n_local_reader:
            raise ValueError(
                f"bad reader counts: n_reader={n_reader}, n_local_reader={n_local_reader}, "
                f"local_reader_ranks={local_reader_ranks}"
            )
        if n_reader > n_local_reader and not codec.cross_host:
            raise ValueError(
                f"a MessageQueue with readers on other hosts cannot carry {codec.name}: "
                "nothing crossing hosts is unpickled (give it a MsgpackCodec)"
            )
        if max_chunk_bytes is None:
            max_chunk_bytes = envs.mq_max_chunk_bytes()
        self.n_reader = n_reader
        self.n_local_reader = n_local_reader
        self.n_remote_reader = n_reader - n_local_reader
        self._init_state(is_writer=True, codec=codec)
        self.buffer: ShmRingBuffer | None = None
        self.local_socket: zmq.Socket[Any] | None = None
        self.notify_socket: zmq.Socket[Any] | None = None
        self.remote_socket: zmq.Socket[Any] | None = None
        self.handle = Handle(local_reader_ranks=list(local_reader_ranks), codec=codec.name)
        try:
            if n_local_reader:
                self.buffer = ShmRingBuffer(n_local_reader, max_chunk_bytes, max_chunks)
                self.handle.buffer_handle = self.buffer.handle()
                self.handle.local_subscribe_addr = get_open_zmq_ipc_path()
                self.local_socket = self._bind_xpub(self.handle.local_subscribe_addr, hwm=0)
                self.handle.local_notify_addr = get_open_zmq_ipc_path()
                self.notify_socket = self._bind_xpub(self.handle.local_notify_addr, hwm=1)
            if self.n_remote_reader:
                ip = connect_ip or get_ip()
                self.remote_socket = self._bind_xpub(get_tcp_uri(ip, 0), hwm=0)
                port = split_zmq_path(get_bound_address(self.remote_socket))[2]
                self.handle.remote_subscribe_addr = get_tcp_uri(ip, int(port))
                self.handle.remote_addr_ipv6 = ":" in ip
        except BaseException:
            self.close()
            raise
        self._all_read = b"\x01" * n_local_reader
        self._no_reads = bytes(n_local_reader)
        logger.debug("MessageQueue handle: %s", self.handle)

    def _init_state(self, is_writer: bool, codec: Codec) -> None:
        self._is_writer = is_writer
        self._codec = codec
        self._is_local_reader = False
        self._is_remote_reader = False
        self.local_reader_rank = -1
        self.current_idx = 0
        self._last_publish = -float("inf")
        self._shutting_down = False
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()  # shutdown() writes a byte: wakes poll()
        os.set_blocking(self._wake_w, False)
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sockets: list[zmq.Socket[Any]] = []
        # What a queue nobody closed still holds (the context's IO threads, its sockets and
        # their ipc files, the wake pipe) goes when the queue is collected or, at the latest,
        # at interpreter exit: a script that builds a queue and returns exits at once.
        # (`self.buffer` has its own finalizer.)
        self._release = weakref.finalize(
            self, _release, self._ctx, self._sockets, (self._wake_r, self._wake_w), os.getpid()
        )

    def _bind_xpub(self, addr: str, hwm: int) -> zmq.Socket[Any]:
        sock = make_zmq_socket(self._ctx, addr, zmq.XPUB, bind=True, linger=_LINGER_MS)
        sock.setsockopt(zmq.SNDHWM, hwm)
        self._sockets.append(sock)
        return sock

    def _connect_sub(
        self, addr: str, conflate: bool = False, ipv6: bool = False
    ) -> zmq.Socket[Any]:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        if conflate:
            sock.setsockopt(zmq.CONFLATE, 1)
        else:
            sock.setsockopt(zmq.RCVHWM, 0)
        if ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        if addr.startswith("tcp://"):
            cluster_auth.secure(sock, bind=False)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(addr)
        self._sockets.append(sock)
        return sock

    def export_handle(self) -> Handle:
        return self.handle

    @staticmethod
    def create_from_handle(handle: Handle, rank: int, codec: Codec | None = None) -> MessageQueue:
        """Attach as reader `rank` (local when `rank` is in `handle.local_reader_ranks`), with
        the writer's codec (default `PickleCodec`, refused for a remote reader)."""
        if codec is None:
            codec = PickleCodec()
        if codec.name != handle.codec:
            raise ValueError(
                f"this MessageQueue carries {handle.codec!r}; the reader's codec is {codec.name!r}"
            )
        if rank not in handle.local_reader_ranks and not codec.cross_host:
            raise ValueError(
                f"a reader on another host never reads {codec.name}: give the queue a "
                "MsgpackCodec on both ends"
            )
        self = MessageQueue.__new__(MessageQueue)
        self._init_state(is_writer=False, codec=codec)
        self.handle = handle
        self.buffer = None
        self.local_socket = self.notify_socket = self.remote_socket = None
        try:
            if rank in handle.local_reader_ranks:
                assert handle.buffer_handle and handle.local_subscribe_addr
                assert handle.local_notify_addr
                self._is_local_reader = True
                self.local_reader_rank = handle.local_reader_ranks.index(rank)
                self.buffer = ShmRingBuffer(*handle.buffer_handle)
                self.notify_socket = self._connect_sub(handle.local_notify_addr, conflate=True)
                self.local_socket = self._connect_sub(handle.local_subscribe_addr)
                self.n_local_reader = self.buffer.n_reader
            else:
                assert handle.remote_subscribe_addr, "this queue has no remote readers"
                self._is_remote_reader = True
                self.remote_socket = self._connect_sub(
                    handle.remote_subscribe_addr, ipv6=handle.remote_addr_ipv6
                )
        except BaseException:
            self.close()
            raise
        return self

    # -- set-up and tear-down -----------------------------------------------------------------

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Collective: the writer waits for every reader's subscription, then sends READY."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._is_writer:
            for sock, count in (
                (self.local_socket, self.n_local_reader),
                (self.notify_socket, self.n_local_reader),
                (self.remote_socket, self.n_remote_reader),
            ):
                for got in range(count):
                    if not self._poll(sock, deadline):
                        raise TimeoutError(
                            f"MessageQueue: {got} of {count} readers connected in {timeout} s"
                        )
                    sock.recv()  # type: ignore[union-attr]
            for sock in (self.local_socket, self.remote_socket):
                if sock is not None:
                    sock.send(_READY)
        else:
            sock = self.local_socket or self.remote_socket
            if not self._poll(sock, deadline):
                raise TimeoutError(f"MessageQueue: no READY from the writer in {timeout} s")
            msg = sock.recv()  # type: ignore[union-attr]
            if msg != _READY:
                raise RuntimeError(f"MessageQueue: expected READY from the writer, got {msg!r}")

    def shutdown(self) -> None:
        """Make every current and later wait on this object raise `MessageQueueShutdown`.

        Safe from any thread (e.g. a signal handler or a death-pipe watcher).
        """
        self._shutting_down = True
        if not self._closed:
            # OSError: already signalled (the pipe is full), or closing.
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")

    def close(self) -> None:
        """Shut down, close the sockets (removing their ipc files) and the ring (unlinking it
        in the writer). Idempotent."""
        if self._closed:
            return
        self.shutdown()
        self._closed = True
        self._release()
        if self.buffer is not None:
            self.buffer.close()

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ------------------------------------------------------------------------------

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Broadcast `obj` to every reader; `TimeoutError` if no chunk frees up in `timeout`."""
        assert self._is_writer, "only the writer enqueues"
        codec = self._codec
        bufs = codec.dumps(obj)
        try:
            if self.buffer is not None:
                self._write_local(bufs, timeout)
            if self.remote_socket is not None:
                self.remote_socket.send_multipart(bufs)  # copies: the views may be released
        finally:
            codec.release(bufs)

    def _write_local(self, bufs: list[Buffer], timeout: float | None) -> None:
        assert self.buffer is not None
        idx = self._acquire_write(timeout)
        if not write_chunk(self.buffer.chunks[idx], bufs):
            assert self.local_socket is not None
            self.local_socket.send_multipart(bufs)  # copies: the views may be released
        self._publish(idx)

    def broadcast_object(self, obj: Any = None) -> Any:
        """The writer sends `obj` and returns it; a reader returns what it receives."""
        if self._is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    # -- reading ------------------------------------------------------------------------------

    def dequeue(self, timeout: float | None = None) -> Any:
        """The next message, in order; `TimeoutError` if none comes in `timeout` seconds."""
        if self._is_local_reader:
            assert self.buffer is not None
            idx = self._acquire_read(timeout)
            chunk = self.buffer.chunks[idx]
            try:
                overflow = is_overflow(chunk)
                if not overflow:
                    return read_chunk(chunk, self._codec)
            finally:
                memory_fence()
                self.buffer.metadata[
                    idx * self.buffer.metadata_size + 1 + self.local_reader_rank
                ] = 1
                self.current_idx = (idx + 1) % self.buffer.max_chunks
            return self._recv_frames(self.local_socket, timeout)
        if self._is_remote_reader:
            return self._recv_frames(self.remote_socket, timeout)
        raise RuntimeError("only readers dequeue")

    def _recv_frames(self, sock: zmq.Socket[Any] | None, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._poll(sock, deadline):
            raise TimeoutError(f"MessageQueue.dequeue: nothing arrived in {timeout} s")
        assert sock is not None
        return self._codec.loads(sock.recv_multipart(copy=False))


def _release(
    ctx: zmq.Context[Any], sockets: list[zmq.Socket[Any]], fds: tuple[int, ...], pid: int
) -> None:
    """Close a queue's sockets (the writer's linger at most `_LINGER_MS`, so this ends),
    terminate its context (which ends its IO threads) and close its wake pipe. A forked child
    holds a copy of its parent's queue: it leaves the parent's context and sockets alone."""
    close_context(ctx, sockets, pid)
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def remove_orphaned_queue(handle: Handle) -> None:
    """Remove the shared memory and ipc socket files of a queue whose creator died without
    closing it (killed -9). Only for a process that knows the creator is gone."""
    if handle.buffer_handle:
        unlink_orphaned_segment(handle.buffer_handle[3])
    for address in (handle.local_subscribe_addr, handle.local_notify_addr):
        if address and address.startswith("ipc://"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address[len("ipc://") :])
