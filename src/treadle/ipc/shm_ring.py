"""`ShmRingBuffer`: the lock-free shared-memory ring under `MessageQueue` (ARCHITECTURE §4).

The memory layout and the flag protocol are drawn in `treadle.ipc.shm_broadcast`'s docstring.
This module owns the segment: creating it (after checking free space in /dev/shm), attaching to
it without the resource tracker (only the creator unlinks it), views of its chunks and flags,
and the memory fence that orders flag and data accesses.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import sys
import threading
import weakref
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory
from typing import Any

from treadle.logger import init_logger

__all__ = ["ShmRingBuffer", "memory_fence"]

logger = init_logger(__name__)

MiB = 1 << 20
_SHM_DIR = "/dev/shm"

_fence_lock = threading.Lock()
# Segments whose mapping still had views when they were closed (see `_release`).
_keep_until_exit: list[shared_memory.SharedMemory] = []
_attach_lock = threading.Lock()


def _lock_fence() -> None:
    with _fence_lock:
        pass


def _no_fence() -> None:
    pass


memory_fence: Callable[[], None] = (
    _no_fence if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686") else _lock_fence
)
"""A memory barrier between the flag and data accesses of this process.

x86 is totally store ordered: stores are seen in program order, loads are not reordered with
loads, nor stores with earlier loads; that is every order the ring needs, so the fence is free
there. Elsewhere (ARM, POWER) taking and releasing a lock executes atomic read-modify-writes
with acquire and release semantics, which keep the accesses on either side apart.
"""


def shm_free_bytes() -> int | None:
    """Free bytes in /dev/shm, or None where there is no /dev/shm to check."""
    try:
        return shutil.disk_usage(_SHM_DIR).free
    except OSError:
        return None


class ShmRingBuffer:
    """`max_chunks` chunks of `max_chunk_bytes` plus one metadata row per chunk (module doc).

    `ShmRingBuffer(n, bytes, chunks)` creates the segment; `ShmRingBuffer(*handle)` (or
    unpickling one) attaches to it. `close()` unmaps it; the creator also unlinks it then, or at
    the latest when the object is collected or the process exits normally.
    """

    def __init__(
        self, n_reader: int, max_chunk_bytes: int, max_chunks: int, name: str | None = None
    ):
        if n_reader < 1 or max_chunk_bytes < 16 or max_chunks < 1:
            raise ValueError(
                f"invalid ring: n_reader={n_reader}, max_chunk_bytes={max_chunk_bytes}, "
                f"max_chunks={max_chunks}"
            )
        self.n_reader = n_reader
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self.metadata_size = 1 + n_reader
        self.metadata_offset = max_chunks * max_chunk_bytes
        self.total_bytes = self.metadata_offset + max_chunks * self.metadata_size
        self.is_creator = name is None
        if name is None:
            _check_free_shm(self.total_bytes)
            remove_dead_creators_segments()
            self.shared_memory = shared_memory.SharedMemory(
                name=segment_name(), create=True, size=self.total_bytes
            )
        else:
            self.shared_memory = _attach_untracked(name)
            if self.shared_memory.size < self.total_bytes:
                size = self.shared_memory.size
                self.shared_memory.close()
                raise ValueError(
                    f"shared memory {name!r} has {size} bytes, the ring needs {self.total_bytes}"
                )
        buf = self.shared_memory.buf
        assert buf is not None
        self.chunks: list[memoryview] = [
            buf[i * max_chunk_bytes : (i + 1) * max_chunk_bytes] for i in range(max_chunks)
        ]
        self.metadata: memoryview = buf[self.metadata_offset : self.total_bytes]
        if self.is_creator:
            self.metadata[:] = bytes(len(self.metadata))
        # The views go first: a mapping with views left cannot be closed (a `BufferError`
        # printed at exit by `SharedMemory.__del__`).
        self._finalizer = weakref.finalize(
            self,
            _release,
            self.shared_memory,
            [*self.chunks, self.metadata],
            self.is_creator,
            os.getpid(),
        )

    @property
    def name(self) -> str:
        return self.shared_memory.name

    def handle(self) -> tuple[int, int, int, str]:
        """What another process passes to `ShmRingBuffer(*handle)` to attach."""
        return (self.n_reader, self.max_chunk_bytes, self.max_chunks, self.name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, self.handle())

    def close(self) -> None:
        """Unmap the segment (and unlink it, in the creator). Idempotent."""
        self.chunks = []
        self._finalizer()


def _release(
    shm: shared_memory.SharedMemory,
    views: list[memoryview],
    is_creator: bool,
    creator_pid: int,
) -> None:
    # A forked child holds a copy of its parent's ring: only the creating process unlinks.
    if is_creator and os.getpid() == creator_pid:
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()
    for view in views:
        with contextlib.suppress(BufferError):  # a slice of it is still exported
            view.release()
    try:
        shm.close()
    except BufferError:
        # Someone still holds a view; the mapping goes when the last one does. Until then
        # `SharedMemory.__del__` must not try again (it would print the BufferError).
        logger.debug("shared memory %s still has views; not unmapping it now", shm.name)
        _keep_until_exit.append(shm)


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Attach to an existing segment without registering it with the resource tracker."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    # Before 3.13 attaching always registers; skip the registration of this one name.
    with _attach_lock:
        register = resource_tracker.register
        target = "/" + name

        def register_others(res_name: str, rtype: str) -> None:
            if res_name != target:
                register(res_name, rtype)

        resource_tracker.register = register_others  # type: ignore[assignment]
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = register  # type: ignore[assignment]


def _check_free_shm(nbytes: int) -> None:
    free = shm_free_bytes()
    if free is not None and free < nbytes:
        raise RuntimeError(
            f"The shared-memory MessageQueue needs {nbytes / MiB:.1f} MiB in {_SHM_DIR}, but only "
            f"{free / MiB:.1f} MiB is free. Raise the size of {_SHM_DIR} (docker: "
            f"`--shm-size={max(1, -(-2 * nbytes // (1 << 30)))}g`; otherwise `mount -o "
            f"remount,size=<N>G {_SHM_DIR}`), free space there, or lower "
            "TREADLE_MQ_MAX_CHUNK_BYTES_MB."
        )


def _pid_namespace() -> str:
    """This process's pid namespace (its inode), so that pids in segment names are read only
    where they mean the same process."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino.__format__("x")
    except OSError:
        return "0"


def segment_name() -> str:
    """A new ring's name: `treadle_<pid namespace>_<creator pid>_<random>`, so that a later
    creator can tell a dead creator's segment (`remove_dead_creators_segments`)."""
    return f"treadle_{_pid_namespace()}_{os.getpid()}_{os.urandom(6).hex()}"


def remove_dead_creators_segments() -> list[str]:
    """Unlink this user's rings whose creator (named in the segment's name, in this pid
    namespace) is no longer running: what a process killed -9 left when nothing else could
    remove it (e.g. under Ray, where the actors die with their driver). Called before each
    new ring, so a restarted engine core clears its predecessor's. Returns the names removed."""
    ns, uid = _pid_namespace(), os.getuid()
    removed: list[str] = []
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return removed
    for name in names:
        parts = name.split("_")
        if len(parts) != 4 or parts[0] != "treadle" or parts[1] != ns or not parts[2].isdigit():
            continue
        try:
            if os.stat(os.path.join(_SHM_DIR, name)).st_uid != uid:
                continue
            os.kill(int(parts[2]), 0)
            continue  # its creator runs: the ring may be in use
        except ProcessLookupError:
            pass
        except OSError:
            continue  # gone already, or someone else's process
        unlink_orphaned_segment(name)
        removed.append(name)
    if removed:
        logger.info("Removed %d shared-memory rings of dead processes", len(removed))
    return removed


def unlink_orphaned_segment(name: str) -> None:
    """Remove the segment of a ring whose creator died without unlinking it (e.g. killed -9).
    Only for a process that knows the creator is gone; a missing segment is fine."""
    import _posixshmem  # the primitive multiprocessing.shared_memory itself uses

    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)
