"""Child processes: start method, titles, ready and death pipes, a death monitor, shutdown.

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
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

import setproctitle
import torch  # before the native-thread baseline below is taken

from treadle import envs
from treadle.logger import init_logger, set_process_name

__all__ = [
    "ChildDiedError",
    "ChildProcess",
    "ProcessMonitor",
    "ReadyPipe",
    "at_parent_death",
    "chain_signal_handlers",
    "describe_exit",
    "get_mp_context",
    "set_process_title",
    "shutdown_processes",
    "signal_children",
    "start_process",
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


class ChildDiedError(RuntimeError):
    """A child process exited before it was ready (or while it was needed)."""


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
    starts itself: in a user's own process (`LLM`) their objects are theirs to collect."""
    import gc

    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.debug(
        "Start-up heap frozen: %d objects out of the collector's sight (%.0f ms)",
        gc.get_freeze_count(),
        (time.perf_counter() - start) * 1e3,
    )


def _exit_status(process: BaseProcess) -> int | None:
    """`process.exitcode`, without reaping a child that exited (`ChildProcess.exitcode`)."""
    popen: Any = getattr(process, "_popen", None)
    if popen is None or popen.returncode is not None:  # not started, or reaped
        return process.exitcode
    if popen.method == "forkserver":  # not this process's child: multiprocessing reads a pipe
        return process.exitcode
    try:
        info = os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped this moment by another thread, which sets returncode
        deadline = time.monotonic() + 0.2
        while popen.returncode is None and time.monotonic() < deadline:
            time.sleep(0.001)
        return process.exitcode
    if info is None:
        return None  # it runs
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def describe_exit(exitcode: int | None) -> str:
    """`exit code 1`, `killed by signal 9 (SIGKILL)`, or `still running`."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {-exitcode} ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _cuda_initialized() -> bool:
    return bool(torch.cuda.is_initialized())


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
    elif method == "fork" and (native := _native_thread_count()) > _BASELINE_NATIVE_THREADS:
        logger.info(
            "This process already runs %d native thread(s) (e.g. torch's OpenMP pool after a "
            "model ran here), which a forked child would inherit half-dead: starting children "
            "with 'spawn' instead of 'fork'.",
            native,
        )
        method = "spawn"
    _check_not_bootstrapping()
    return multiprocessing.get_context(method)


class ReadyStatus(StrEnum):
    """What a child says on its ready pipe, once: `(status, payload)`."""

    READY = "READY"  # payload: what the parent reads as `ready_payload`
    FAILED = "FAILED"  # payload: the child's traceback, as text


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
        return _exit_status(self.process)

    def describe(self) -> str:
        return f"{self.name} (pid {self.pid})"

    def close_pipes(self) -> None:
        """Close the parent's pipe ends; closing the death pipe tells the child to exit."""
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


def wait_for_ready(children: Sequence[ChildProcess], timeout: float | None = None) -> list[Any]:
    """Wait for every child's READY and return their payloads, in order.

    Raises `ChildDiedError` naming the child that died (and how) or reported a failure, and
    `TimeoutError` naming those still not ready after `timeout` seconds.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = {c for c in children if not c.is_ready}
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        by_object: dict[Any, ChildProcess] = {}
        for c in pending:
            by_object[c.ready_reader] = c
            by_object[c.sentinel] = c
        fired = wait(list(by_object), remaining)
        if not fired:
            names = ", ".join(sorted(c.describe() for c in pending))
            raise TimeoutError(f"not ready after {timeout} s: {names}")
        for obj in fired:
            child = by_object[obj]
            if child not in pending:
                continue
            try:
                status, payload = child.ready_reader.recv()
            except (EOFError, OSError):
                child.process.join(1.0)
                raise ChildDiedError(
                    f"{child.describe()} died before it was ready: {describe_exit(child.exitcode)}"
                ) from None
            if status != ReadyStatus.READY:
                raise ChildDiedError(f"{child.describe()} failed to start:\n{payload}")
            child.ready_payload, child.is_ready = payload, True
            pending.discard(child)
    return [c.ready_payload for c in children]


class ProcessMonitor:
    """A daemon thread that waits on the children's sentinels and reports each death.

    `on_death(child)` runs in the monitor thread (`child.exitcode` says how it ended), after a
    logged error (a line at INFO for exit code 0, which is a child that was stopped on
    purpose: `on_death` decides what that means); `stop()` ends the watch without reporting
    anything; `add(child)` watches one more (a restarted engine core).
    """

    def __init__(self, children: Sequence[ChildProcess], on_death: Callable[[ChildProcess], None]):
        self._children = list(children)
        self._on_death = on_death
        self._stop_r, self._stop_w = os.pipe()  # also wakes the thread for `add`
        self._stopped = False
        self._added: list[ChildProcess] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="process-monitor", daemon=True)
        self._thread.start()

    def add(self, child: ChildProcess) -> None:
        with self._lock:
            self._added.append(child)
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"+")

    def _run(self) -> None:
        alive = {c.sentinel: c for c in self._children}
        try:
            while alive or not self._stopped:
                fired = wait([*alive, self._stop_r])
                if self._stopped:
                    return
                if self._stop_r in fired:
                    os.read(self._stop_r, 512)
                    with self._lock:
                        alive.update((c.sentinel, c) for c in self._added)
                        self._added.clear()
                    continue
                for sentinel in fired:
                    child = alive.pop(sentinel)  # type: ignore[arg-type]
                    child.process.join(1.0)
                    if child.exitcode == 0:
                        logger.info("%s exited: %s", child.describe(), describe_exit(0))
                    else:
                        logger.error("%s died: %s", child.describe(), describe_exit(child.exitcode))
                    try:
                        self._on_death(child)
                    except Exception:
                        logger.exception("on_death failed for %s", child.describe())
        finally:
            os.close(self._stop_r)

    def stop(self) -> None:
        """Stop watching (e.g. before a planned shutdown); idempotent."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(OSError):  # the thread may be gone already
            os.write(self._stop_w, b"x")
        self._thread.join(5.0)
        os.close(self._stop_w)


def shutdown_processes(
    children: Sequence[ChildProcess], timeout: float = 5.0, kill_timeout: float = 2.0
) -> None:
    """Stop the children: wait `timeout` for them to exit, then SIGTERM and wait `timeout`
    again, then SIGKILL and wait `kill_timeout`; finally close their pipes."""
    procs = [c.process for c in children]
    for step in (None, "terminate", "kill"):
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            break
        if step is not None:
            logger.info("Sending %s to %d child process(es)", step, len(alive))
            for p in alive:
                with contextlib.suppress(OSError, ValueError):
                    getattr(p, step)()
        deadline = time.monotonic() + (kill_timeout if step == "kill" else timeout)
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
    for c in children:
        c.close_pipes()


def stop_watched(children: Sequence[ChildProcess], timeout: float) -> None:
    """Wait `timeout` for the children to exit, then SIGKILL them and wait again; close their
    pipes. Unlike `shutdown_processes` this never reaps them: a `ProcessMonitor` that watches
    them does (two reapers race, and one of them reads the exit as "still running")."""
    sentinels = [c.sentinel for c in children]
    deadline = time.monotonic() + timeout
    while sentinels and time.monotonic() < deadline:
        for fired in wait(sentinels, max(0.0, deadline - time.monotonic())):
            sentinels.remove(fired)  # type: ignore[arg-type]
    for child in children:
        if child.sentinel in sentinels:
            logger.info("Sending kill to %s", child.describe())
            with contextlib.suppress(OSError, ValueError):
                child.process.kill()
    if sentinels:
        wait(sentinels, 5.0)
    for c in children:
        c.close_pipes()


def signal_children(children: Sequence[ChildProcess], sig: int) -> None:
    """Send `sig` to each child that still runs."""
    for child in children:
        if child.pid is not None and child.process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, sig)


def chain_signal_handlers(signals: Sequence[int], first: Callable[[], None]) -> Callable[[], None]:
    """Make each of `signals` run `first()` (once, whichever signal comes first), then what
    the handler installed now would do (SIG_DFL: the default action). Returns a function that
    puts the previous handlers back where ours are still installed. Main thread only
    (elsewhere: nothing happens)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    done = False
    installed: dict[int, tuple[Any, Any]] = {}  # signal -> (ours, previous)

    def run_first() -> None:
        nonlocal done
        if not done:
            done = True
            first()

    for sig in signals:
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: Any, previous: Any = previous) -> None:
            run_first()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:  # e.g. terminate: do it
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)
        installed[sig] = (handler, previous)

    def restore() -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, (ours, previous) in installed.items():
            if signal.getsignal(sig) is ours:
                signal.signal(sig, previous)

    return restore
