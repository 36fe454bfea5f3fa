"""Starting child processes: start method, titles, ready and death pipes, parent death.
Watching and stopping them is `process_watch.py`; its names are re-exported here.

ARCHITECTURE §1 (titles), §5 (parent death) and §7 (start methods). A child started with
`start_process` runs `target(ready, *args, **kwargs)` where `ready` is its `ReadyPipe`:

    parent                                   child (title "treadle::NAME")
    ------                                   -----------------------------
    start_process(target, name) ------------> target(ready, *args)
    wait_for_ready([child], timeout) <------- ready.send_ready(payload)   (or FAILED + traceback)
    keeps the death pipe's write end         a daemon thread blocks on the read end:
        (process exit closes it)       EOF -> SIGTERM to itself; os._exit(1) `grace_s` later
    ProcessMonitor: sentinels -> "NAME (pid P) died: killed by signal 9 (SIGKILL)"
    shutdown_processes: join -> SIGTERM -> SIGKILL, each with a timeout

With fork, a child inherits every fd of its parent, including the death pipes of its siblings,
which would keep their EOF from ever coming: the parent's death-pipe write ends are closed in
every forked child (`os.register_at_fork`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

import setproctitle

from treadle import envs
from treadle.ipc.process_watch import (
    ChildDiedError,
    ProcessMonitor,
    ReadyStatus,
    chain_signal_handlers,
    describe_exit,
    exit_status,
    shutdown_processes,
    signal_children,
    stop_watched,
    wait_for_ready,
)
from treadle.logger import init_logger, set_process_name

__all__ = [  # with the watching side's names (`process_watch.py`), which callers import here
    "ChildDiedError",
    "ChildProcess",
    "ProcessMonitor",
    "ReadyPipe",
    "ReadyStatus",
    "at_parent_death",
    "chain_signal_handlers",
    "describe_exit",
    "get_mp_context",
    "set_process_title",
    "shutdown_processes",
    "signal_children",
    "start_process",
    "stop_watched",
    "wait_for_ready",
]

logger = init_logger(__name__)

_METHODS = ("fork", "spawn", "forkserver")
GUARD_ERROR = (
    "treadle tried to start a child process while this process, itself started with the 'spawn' "
    "or 'forkserver' method, was importing the main module again: the script has no "
    '`if __name__ == "__main__":` guard. Put the code that starts treadle under '
    '`if __name__ == "__main__":` (a spawned child imports the main module, and without the '
    "guard it would start processes again), or set TREADLE_WORKER_MULTIPROC_METHOD=fork."
)

# Death-pipe write ends this process holds for its children: closed in every forked child.
_death_writers: set[int] = set()


def _close_death_writers_in_child() -> None:
    for fd in _death_writers:
        with contextlib.suppress(OSError):
            os.close(fd)
    _death_writers.clear()


os.register_at_fork(after_in_child=_close_death_writers_in_child)


def set_process_title(name: str) -> None:
    """Title this process `treadle::NAME` (as `ps` shows it) and name it in log lines."""
    setproctitle.setproctitle(f"treadle::{name}")
    set_process_name(name)


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now out of the garbage collector's sight
    (`gc.freeze`), as vLLM does once a process has started: a serving process's start-up
    leaves ~230,000 tracked objects (PyTorch's modules, the model, FastAPI's app), each full
    collection walked them all (~85 ms of the engine core on a 2-core Xeon: a token stalled
    10x its time), and they live as long as the process. Only for the processes treadle
    starts itself: in a user's own process (`LLM`) their objects are theirs to collect.
    Then the heap's freed pages go back to the OS (`malloc_trim`: ~30 MiB of the API server's
    start-up temporaries, issue 41 item 2)."""
    import gc

    from treadle.ipc.memory import malloc_trim

    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    malloc_trim()
    logger.debug(
        "Start-up heap frozen and trimmed: %d objects out of the collector's sight (%.0f ms)",
        gc.get_freeze_count(),
        (time.perf_counter() - start) * 1e3,
    )


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")  # not imported here: the API server runs without torch
    return torch is not None and bool(torch.cuda.is_initialized())


def _native_thread_count() -> int:
    """Threads of this process that Python did not start (torch's OpenMP pool, zmq IO
    threads, ...). A forked child gets none of them but may wait on them forever: GNU OpenMP,
    for one, deadlocks in a child forked after its pool started."""
    try:
        return len(os.listdir("/proc/self/task")) - threading.active_count()
    except OSError:
        return 0


# Importing torch starts one helper thread of its own, harmless to fork; anything beyond it
# makes fork unsafe. Capped at 1 in case model code already ran before this import.
_BASELINE_NATIVE_THREADS = min(_native_thread_count(), 1)


def _harmless_native_threads() -> int:
    """The native threads that do not make fork unsafe: one once torch or numpy is imported
    (torch's helper thread; the pool numpy's OpenBLAS starts on import, which stops it around
    a fork: a script's `LLM` whose process never imports torch has only that one), else what
    ran when this module was imported (this module imports neither)."""
    loaded = "torch" in sys.modules or "numpy" in sys.modules
    return 1 if loaded else _BASELINE_NATIVE_THREADS


def _check_not_bootstrapping() -> None:
    """Raise the guard error when the main module is being re-imported by spawn/forkserver."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(GUARD_ERROR)


def get_mp_context() -> BaseContext:
    """The multiprocessing context for treadle's children (ARCHITECTURE §7).

    `TREADLE_WORKER_MULTIPROC_METHOD` (fork | spawn | forkserver, default fork; the CLI sets
    spawn). Fork is replaced by spawn, with a logged reason, once CUDA is initialized here or
    native threads run here (forking those can hang the child).
    """
    method = envs.worker_multiproc_method() or "fork"
    if method not in _METHODS:
        raise ValueError(
            f"TREADLE_WORKER_MULTIPROC_METHOD={method!r}: expected one of {', '.join(_METHODS)}"
        )
    if method == "fork" and _cuda_initialized():
        logger.warning(
            "CUDA is already initialized in this process and cannot be forked: starting "
            "children with 'spawn' instead of 'fork'. Set TREADLE_WORKER_MULTIPROC_METHOD=spawn "
            'to choose it yourself (scripts then need an `if __name__ == "__main__":` guard).'
        )
        method = "spawn"
    elif method == "fork" and (native := _native_thread_count()) > _harmless_native_threads():
        logger.info(
            "This process already runs %d native thread(s) (e.g. torch's OpenMP pool after a "
            "model ran here), which a forked child would inherit half-dead: starting children "
            "with 'spawn' instead of 'fork'.",
            native,
        )
        method = "spawn"
    _check_not_bootstrapping()
    return multiprocessing.get_context(method)


class ReadyPipe:
    """The child's end of its ready pipe: say READY (with a payload) or FAILED, once."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self.sent = False

    def send_ready(self, payload: Any = None) -> None:
        self._send((ReadyStatus.READY, payload))

    def send_failed(self, message: str) -> None:
        self._send((ReadyStatus.FAILED, message))

    def _send(self, msg: tuple[ReadyStatus, Any]) -> None:
        if self.sent:
            raise RuntimeError("the ready pipe was already used")
        self.sent = True
        self._conn.send(msg)
        self._conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.close()


@dataclass(eq=False)
class ChildProcess:
    """The parent's handle on a child started by `start_process`."""

    name: str
    process: BaseProcess
    ready_reader: Connection
    death_writer: int
    ready_payload: Any = field(default=None, init=False)
    is_ready: bool = field(default=False, init=False)
    pipes_closed: bool = field(default=False, init=False)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    @property
    def exitcode(self) -> int | None:
        """How the child ended (negative: by that signal), or None while it runs. Read
        without reaping it (`waitid` with WNOWAIT): a child is reaped by one thread only,
        the process monitor's `join` (or a stop's). Two threads reaping one child race: the
        loser's `waitpid` finds no child, and multiprocessing then says None, so a child
        that raised and exited 1 was reported as "still running" (the event loop looks at
        the engines' exit codes when a socket peer leaves, as the engine core dies)."""
        return exit_status(self.process)

    def describe(self) -> str:
        return f"{self.name} (pid {self.pid})"

    def close_pipes(self) -> None:
        """Close the parent's pipe ends; closing the death pipe tells the child to exit.
        Once: the death pipe's fd number may serve another child's pipe by a second call (an
        `LLM` collected after a new one started closed that child's, which then exited)."""
        if self.pipes_closed:
            return
        self.pipes_closed = True
        with contextlib.suppress(OSError):
            self.ready_reader.close()
        if self.death_writer in _death_writers:
            _death_writers.discard(self.death_writer)
            with contextlib.suppress(OSError):
                os.close(self.death_writer)


def start_process(
    target: Callable[..., Any],
    name: str,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    ctx: BaseContext | None = None,
    grace_s: float = 2.0,
) -> ChildProcess:
    """Start `target(ready, *args, **kwargs)` in a child titled `treadle::NAME`.

    `target` (and the arguments) must be picklable for spawn and forkserver: a module-level
    function. The child exits within about `grace_s` of this process dying.
    """
    ctx = ctx or get_mp_context()
    _check_not_bootstrapping()
    ready_reader, ready_writer = ctx.Pipe(duplex=False)
    death_r, death_w = os.pipe()
    _death_writers.add(death_w)
    death_reader = Connection(death_r, writable=False)
    proc = ctx.Process(  # type: ignore[attr-defined]
        target=_child_main,
        name=name,
        args=(target, name, ready_writer, death_reader, tuple(args), kwargs or {}, grace_s),
    )
    child = ChildProcess(name, proc, ready_reader, death_w)
    try:
        proc.start()
    except BaseException:
        child.close_pipes()
        raise
    finally:
        ready_writer.close()
        death_reader.close()
    return child


def _child_main(
    target: Callable[..., Any],
    name: str,
    ready_writer: Connection,
    death_reader: Connection,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    grace_s: float,
) -> None:
    set_process_title(name)
    _no_named_semaphore_in_tqdm()
    threading.Thread(
        target=_watch_parent, args=(death_reader, grace_s), name="parent-watch", daemon=True
    ).start()
    ready = ReadyPipe(ready_writer)
    try:
        target(ready, *args, **kwargs)
    except SystemExit as e:
        if e.code not in (0, None) and not ready.sent:  # exit 0: stopped on purpose
            with contextlib.suppress(OSError):
                ready.send_failed(traceback.format_exc())
        raise
    except BaseException:
        if not ready.sent:
            with contextlib.suppress(OSError):
                ready.send_failed(traceback.format_exc())
        raise
    finally:
        ready.close()


def _no_named_semaphore_in_tqdm() -> None:
    """tqdm guards its bars (the model loader's) with a `multiprocessing.RLock`. In a child
    started with spawn or forkserver that is a named POSIX semaphore (`/dev/shm/sem.mp-*`),
    registered with the parent's resource tracker, which a child killed -9 never unlinks:
    it stays until the parent exits ("resource_tracker: ... 1 leaked semaphore"), or for
    good if the tracker is killed too. A child's bars are drawn by its own threads only: a
    thread lock (tqdm's other one) does."""
    try:
        from tqdm.std import TqdmDefaultWriteLock
    except ImportError:
        return
    if not hasattr(TqdmDefaultWriteLock, "mp_lock"):
        TqdmDefaultWriteLock.mp_lock = None


_parent_gone = threading.Event()
_on_parent_death: list[Callable[[], None]] = []


def at_parent_death(fn: Callable[[], None]) -> None:
    """Run `fn` in this child as soon as its parent is gone (before the SIGTERM that stops
    it), e.g. to remove what the parent can no longer remove itself."""
    _on_parent_death.append(fn)


def parent_gone() -> bool:
    """Whether this child's parent is gone (its death pipe closed). A SIGTERM handler asks
    this rather than `os.getppid()`: the pipe closes while the parent exits, before this
    process is given to a new parent."""
    return _parent_gone.is_set()


def _watch_parent(death_reader: Connection, grace_s: float) -> None:
    """Block until the parent's end of the death pipe closes, then leave."""
    with contextlib.suppress(EOFError, OSError):
        while True:
            death_reader.recv_bytes()
    logger.warning("The parent process is gone; exiting.")
    _parent_gone.set()
    for fn in _on_parent_death:
        try:
            fn()
        except Exception:
            logger.exception("Cleaning up after the parent failed")
    os.kill(os.getpid(), signal.SIGTERM)  # graceful where a SIGTERM handler is installed
    time.sleep(grace_s)
    os._exit(1)
