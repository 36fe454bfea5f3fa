"""Watching child processes and stopping them: a child's READY or its death before it
(`wait_for_ready`), a death while it serves (`ProcessMonitor`: sentinels -> "NAME (pid P)
died: killed by signal 9 (SIGKILL)"), how it ended (`describe_exit`), stopping (join ->
SIGTERM -> SIGKILL, each with a timeout) and chained signal handlers. Starting them, and the
child's side of the ready and death pipes, is `ipc/process.py` (which re-exports these names).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from enum import StrEnum
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from treadle.logger import init_logger

if TYPE_CHECKING:
    from treadle.ipc.process import ChildProcess

logger = init_logger(__name__)


class ChildDiedError(RuntimeError):
    """A child process exited before it was ready (or while it was needed)."""


def exit_status(process: BaseProcess) -> int | None:
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


class ReadyStatus(StrEnum):
    """What a child says on its ready pipe, once: `(status, payload)`."""

    READY = "READY"  # payload: what the parent reads as `ready_payload`
    FAILED = "FAILED"  # payload: the child's traceback, as text


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
        if child.pid is not None and child.exitcode is None:  # (without reaping it)
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
