"""The tensor ring (`--tensor-ipc shm`, vLLM's `mm_tensor_ipc="torch_shm"`): large tensors of
requests go from a front end to its engine cores through one POSIX shared-memory segment, and
the ZMQ message carries only a small handle (`serial.py`, extension 4).

One ring per front end (API server or offline `LLM`), created by it (`TensorRingWriter`) and
named after its request ROUTER's address (`ring_name`), so that an engine core accepts exactly
the rings of the front ends it serves (`TensorRingReader`). Layout:

    header (64 B): magic | nonce | creator pid | data bytes | slots      (u64 each, magic 8 B)
    slots x (seq, released)                                               (u64 each)
    data (data bytes)

A region holds one tensor. The writer allocates regions in order around the data area (a
region never wraps: it starts at 0 when the end has no room), writes `seq` into slot
`seq % slots` *before* the bytes, and keeps its regions in FIFO order; the handle is `(nonce,
seq, offset, length)`. The reader checks the slot holds `seq`, copies the bytes out into its
own memory, checks the slot again (a region reused meanwhile fails the read, never returns
mixed bytes), and writes `released = seq`. The writer frees regions from the oldest while
they are released; one unreleased for `stale_s` (its message was lost with a dead engine) is
freed too, its slot cleared first so that a late reader fails. No room: `put` returns None and
the tensor goes in its own frame as with `direct`; writing never waits.

Cleanup: the creator unlinks the ring when it closes (and at exit, as every `ShmRingBuffer`),
a front end that finds its ring's name taken by a dead creator (a replacement API server)
removes it first, and an engine core whose parent front end died removes that front end's ring
(`remove_orphaned_rings`). A ring is also registered with the creator's resource tracker.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import time
import weakref
from collections import deque
from collections.abc import Iterable
from multiprocessing import shared_memory

from treadle.ipc.shm_ring import (
    _attach_untracked,
    _release,
    memory_fence,
    shm_free_bytes,
    unlink_orphaned_segment,
)
from treadle.logger import init_logger

__all__ = [
    "TensorRingError",
    "TensorRingReader",
    "TensorRingWriter",
    "remove_orphaned_rings",
    "ring_name",
]

logger = init_logger(__name__)

MAGIC = b"TRDLTRG1"
HEADER_BYTES = 64
_SLOT_WORDS = 2  # seq, released
_ALIGN = 64
_HEADER = struct.Struct("<8sQQQQ")  # magic, nonce, creator pid, data bytes, slots


class TensorRingError(ValueError):
    """A handle that does not name a readable region of an accepted ring."""


def ring_name(front_end_address: str) -> str:
    """The ring of the front end whose request ROUTER is at `front_end_address`."""
    return "treadle_tr_" + hashlib.sha256(front_end_address.encode()).hexdigest()[:24]


def _layout(data_bytes: int, slots: int) -> tuple[int, int]:
    """(offset of the data, total size)."""
    data_offset = -(-(HEADER_BYTES + 8 * _SLOT_WORDS * slots) // _ALIGN) * _ALIGN
    return data_offset, data_offset + data_bytes


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a process killed but not yet waited for is a zombie: gone for our purpose
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


class _Mapped:
    """One mapping of a ring: its header fields and views of its slots and data."""

    def __init__(self, shm: shared_memory.SharedMemory, is_creator: bool) -> None:
        buf = shm.buf
        assert buf is not None
        if shm.size < HEADER_BYTES:
            raise TensorRingError(f"shared memory {shm.name!r} is too small to be a tensor ring")
        magic, self.nonce, self.creator_pid, self.data_bytes, self.slots = _HEADER.unpack_from(buf)
        if magic != MAGIC or self.slots < 1:
            raise TensorRingError(f"shared memory {shm.name!r} is not a tensor ring")
        data_offset, total = _layout(self.data_bytes, self.slots)
        if shm.size < total:
            raise TensorRingError(f"tensor ring {shm.name!r} is smaller than its header says")
        self.name = shm.name
        self.words = buf[HEADER_BYTES : HEADER_BYTES + 8 * _SLOT_WORDS * self.slots].cast("Q")
        self.data = buf[data_offset:total]
        self._finalizer = weakref.finalize(
            self, _release, shm, [self.words, self.data], is_creator, os.getpid()
        )

    def close(self) -> None:
        self._finalizer()


def _attach(name: str) -> _Mapped:
    shm = _attach_untracked(name)
    try:
        return _Mapped(shm, is_creator=False)
    except BaseException:
        shm.close()
        raise


class TensorRingWriter:
    """The front end's side: `put` copies a tensor's bytes into a free region; `close` unlinks.

    Used by one thread at a time (the encoder's)."""

    def __init__(self, name: str, data_bytes: int, slots: int = 256, stale_s: float = 60.0) -> None:
        if data_bytes < _ALIGN or slots < 1:
            raise ValueError(f"invalid tensor ring: data_bytes={data_bytes}, slots={slots}")
        data_offset, total = _layout(data_bytes, slots)
        free = shm_free_bytes()
        if free is not None and free < total:
            raise RuntimeError(
                f"the tensor ring needs {total / (1 << 20):.1f} MiB in /dev/shm, only "
                f"{free / (1 << 20):.1f} MiB is free (lower TREADLE_TENSOR_IPC_SHM_MB or raise "
                "the size of /dev/shm)"
            )
        self.stale_s = stale_s
        self.nonce = int.from_bytes(os.urandom(8), "little") or 1
        shm = self._create(name, total)
        assert shm.buf is not None
        shm.buf[:data_offset] = bytes(data_offset)
        _HEADER.pack_into(shm.buf, 0, MAGIC, self.nonce, os.getpid(), data_bytes, slots)
        self.ring = _Mapped(shm, is_creator=True)
        self.name = name
        self.data_bytes = data_bytes
        self.slots = slots
        self._inflight: deque[tuple[int, int, int, float]] = deque()  # seq, offset, length, t
        self._head = 0
        self._next_seq = 1

    @staticmethod
    def _create(name: str, size: int) -> shared_memory.SharedMemory:
        try:
            return shared_memory.SharedMemory(name=name, create=True, size=size)
        except FileExistsError:
            pass
        # Left by a front end on the same address that died (e.g. killed -9): remove it.
        try:
            old = _attach(name)
            creator = old.creator_pid
            old.close()
        except TensorRingError:
            creator = 0
        except FileNotFoundError:
            creator = 0
        if _pid_alive(creator) and creator != os.getpid():
            raise RuntimeError(f"tensor ring {name!r} belongs to process {creator}, alive")
        logger.info("Removing the tensor ring %s left by a process that is gone", name)
        unlink_orphaned_segment(name)
        return shared_memory.SharedMemory(name=name, create=True, size=size)

    def put(self, raw: memoryview) -> tuple[int, int, int, int] | None:
        """Copy `raw` (bytes) into a free region: the handle `(nonce, seq, offset, length)`, or
        None when the ring has no room for it now."""
        n = raw.nbytes
        if n == 0 or n > self.data_bytes:
            return None
        now = time.monotonic()
        self._reclaim(now)
        if len(self._inflight) >= self.slots:
            return None
        offset = self._place(n)
        if offset is None:
            return None
        seq = self._next_seq
        self._next_seq += 1
        slot = seq % self.slots
        words = self.ring.words
        words[_SLOT_WORDS * slot + 1] = 0
        words[_SLOT_WORDS * slot] = seq  # before the bytes: a stale reader of the slot fails
        memory_fence()
        self.ring.data[offset : offset + n] = raw.cast("B") if raw.format != "B" else raw
        memory_fence()
        self._inflight.append((seq, offset, n, now))
        self._head = offset + -(-n // _ALIGN) * _ALIGN
        return self.nonce, seq, offset, n

    def _reclaim(self, now: float) -> None:
        words = self.ring.words
        while self._inflight:
            seq, _, _, t = self._inflight[0]
            slot = seq % self.slots
            if words[_SLOT_WORDS * slot + 1] != seq:
                if now - t < self.stale_s:
                    break
                words[_SLOT_WORDS * slot] = 0  # never read: a late reader fails
                memory_fence()
            self._inflight.popleft()
        if not self._inflight:
            self._head = 0

    def _place(self, n: int) -> int | None:
        if not self._inflight:
            return 0
        tail = self._inflight[0][1]
        if self._inflight[-1][1] >= tail:  # not wrapped: free at the end, then before `tail`
            if self._head + n <= self.data_bytes:
                return self._head
            return 0 if n <= tail else None
        return self._head if self._head + n <= tail else None

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def close(self) -> None:
        """Unmap and unlink the ring. Idempotent."""
        self._inflight.clear()
        self.ring.close()


class TensorRingReader:
    """The engine core's side: reads regions of the rings named in `names` (and no other)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)
        self._rings: dict[str, _Mapped] = {}

    def take(self, name: str, nonce: int, seq: int, offset: int, length: int) -> bytearray:
        """A copy of the region's bytes, which it releases. `TensorRingError` for a ring not
        accepted or gone, a handle outside it, or a region reused or never written."""
        if name not in self.names:
            raise TensorRingError(f"tensor ring {name!r} is not one of this engine's front ends")
        ring = self._ring(name, nonce)
        if seq < 1 or offset < 0 or length < 1 or offset + length > ring.data_bytes:
            raise TensorRingError(
                f"tensor ring handle out of range: offset {offset}, length {length}, seq {seq} "
                f"(ring of {ring.data_bytes} bytes)"
            )
        i = _SLOT_WORDS * (seq % ring.slots)
        words = ring.words
        if words[i] != seq:
            raise TensorRingError(
                f"tensor ring region {seq} is not there (reused or never written)"
            )
        memory_fence()
        out = bytearray(ring.data[offset : offset + length])
        memory_fence()
        if words[i] != seq:
            raise TensorRingError(f"tensor ring region {seq} was reused while being read")
        words[i + 1] = seq
        return out

    def _ring(self, name: str, nonce: int) -> _Mapped:
        ring = self._rings.get(name)
        if ring is not None and ring.nonce == nonce:
            return ring
        if ring is not None:  # the front end was replaced: a new ring by the same name
            del self._rings[name]
            ring.close()
        try:
            ring = _attach(name)
        except FileNotFoundError as e:
            raise TensorRingError(f"tensor ring {name!r} is gone") from e
        except OSError as e:
            raise TensorRingError(f"tensor ring {name!r} cannot be opened: {e}") from e
        if ring.nonce != nonce:
            ring.close()
            raise TensorRingError(f"tensor ring {name!r} was replaced; the handle is stale")
        self._rings[name] = ring
        return ring

    def close(self) -> None:
        for ring in self._rings.values():
            ring.close()
        self._rings.clear()


def remove_orphaned_rings(front_end_addresses: Iterable[str]) -> None:
    """Remove the rings of these front ends whose creator is gone (called by an engine core
    when its parent front end died, e.g. killed -9). A ring of a live process stays."""
    for address in front_end_addresses:
        name = ring_name(address)
        try:
            ring = _attach(name)
        except (FileNotFoundError, TensorRingError, OSError):
            continue
        creator = ring.creator_pid
        ring.close()
        if not _pid_alive(creator):
            with contextlib.suppress(OSError):
                unlink_orphaned_segment(name)
