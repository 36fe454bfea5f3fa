"""treadle.ipc.process: start methods, titles, ready and death pipes, monitor, shutdown."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import ipc_children
import psutil
import pytest
from ipc_children import IPC_TEST_DIR, ReaderGroup

from treadle.ipc import process
from treadle.ipc.process import (
    ChildDiedError,
    ChildProcess,
    ProcessMonitor,
    describe_exit,
    get_mp_context,
    shutdown_processes,
    signal_children,
    start_process,
    wait_for_ready,
)

FORK = multiprocessing.get_context("fork")


@pytest.fixture
def children() -> list[ChildProcess]:
    started: list[ChildProcess] = []
    yield started
    shutdown_processes(started, timeout=0.1, kill_timeout=5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_start_method_end_to_end(method: str) -> None:
    group = ReaderGroup(multiprocessing.get_context(method), ipc_children.echo_reader, 1)
    try:
        group.mq.enqueue({"method": method})
        msg, rank, title = group.gather()[0]
        assert msg == {"method": method} and rank == 0
        assert title.startswith("treadle::Reader_0")
        cmdline = " ".join(psutil.Process(group.children[0].pid).cmdline())
        assert cmdline.startswith("treadle::Reader_0")  # what `ps` shows
        group.mq.enqueue(None)
        assert group.gather()[0][0] is None
        group.children[0].process.join(10)
        assert group.children[0].exitcode == 0
    finally:
        group.close()


def test_get_mp_context_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # As in a fresh process: no native threads beyond torch's own helper.
    monkeypatch.setattr(process, "_native_thread_count", lambda: process._BASELINE_NATIVE_THREADS)
    monkeypatch.delenv("TREADLE_WORKER_MULTIPROC_METHOD", raising=False)
    assert get_mp_context().get_start_method() == "fork"
    for method in ("spawn", "forkserver", "fork"):
        monkeypatch.setenv("TREADLE_WORKER_MULTIPROC_METHOD", method)
        assert get_mp_context().get_start_method() == method
    monkeypatch.setenv("TREADLE_WORKER_MULTIPROC_METHOD", "vfork")
    with pytest.raises(ValueError, match="fork, spawn, forkserver"):
        get_mp_context()


def test_native_threads_force_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """GNU OpenMP deadlocks a child forked after its pool started: fork is not used then."""
    monkeypatch.setenv("TREADLE_WORKER_MULTIPROC_METHOD", "fork")
    monkeypatch.setattr(
        process, "_native_thread_count", lambda: process._BASELINE_NATIVE_THREADS + 1
    )
    assert get_mp_context().get_start_method() == "spawn"


def test_cuda_forces_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_WORKER_MULTIPROC_METHOD", "fork")
    monkeypatch.setattr(process, "_cuda_initialized", lambda: True)
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    process.logger.addHandler(handler)
    try:
        assert get_mp_context().get_start_method() == "spawn"
    finally:
        process.logger.removeHandler(handler)
    assert seen and "CUDA is already initialized" in seen[0]


@pytest.mark.timeout(90)
def test_guard_less_spawn_script_gets_a_clear_error(tmp_path: Path) -> None:
    script = tmp_path / "no_guard.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, sys
            sys.path.insert(0, {IPC_TEST_DIR!r})
            os.environ["TREADLE_WORKER_MULTIPROC_METHOD"] = "spawn"
            import ipc_children
            from treadle.ipc.process import start_process, wait_for_ready

            child = start_process(ipc_children.noop, "NoGuard")
            wait_for_ready([child], timeout=60)
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=80
    )
    assert result.returncode != 0
    assert 'if __name__ == "__main__":' in result.stderr
    assert "no `if __name__" in result.stderr and "NoGuard" in result.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_children_exit_when_the_parent_is_killed(method: str, strays: list[psutil.Process]) -> None:
    parent = subprocess.Popen(
        [sys.executable, os.path.join(IPC_TEST_DIR, "ipc_children.py"), method],
        stdout=subprocess.PIPE,
        text=True,
    )
    strays.append(psutil.Process(parent.pid))
    try:
        assert parent.stdout is not None
        line = _readline(parent.stdout, timeout=60)
        kids = [psutil.Process(int(pid)) for pid in line.split()]
        strays.extend(kids)
        assert len(kids) == 2 and all(k.ppid() in (parent.pid, 1) or k.is_running() for k in kids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        start = time.monotonic()
        gone, alive = psutil.wait_procs(kids, timeout=5)
        alive = [k for k in alive if k.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"orphans still running {time.monotonic() - start:.1f} s later"
    finally:
        parent.kill()
        parent.wait(10)
        if parent.stdout is not None:
            parent.stdout.close()


def _readline(stream: object, timeout: float) -> str:
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)  # type: ignore[attr-defined]
    reader.start()
    reader.join(timeout)
    assert box and box[0].strip(), "the parent printed no pids"
    return box[0]


def test_wait_for_ready_returns_payloads(children: list[ChildProcess]) -> None:
    children += [start_process(ipc_children.sleeper, f"Sleeper_{i}", ctx=FORK) for i in range(2)]
    assert wait_for_ready(children, timeout=30) == [c.pid for c in children]


def test_child_failing_before_ready(children: list[ChildProcess]) -> None:
    children.append(start_process(ipc_children.fail_before_ready, "Bad", ("no model",), ctx=FORK))
    with pytest.raises(ChildDiedError, match=r"Bad \(pid \d+\) failed to start(.|\n)*no model"):
        wait_for_ready(children, timeout=30)


def test_child_exiting_before_ready(children: list[ChildProcess]) -> None:
    children.append(start_process(ipc_children.exit_before_ready, "Quitter", (3,), ctx=FORK))
    with pytest.raises(ChildDiedError, match=r"Quitter .* died before it was ready: exit code 3"):
        wait_for_ready(children, timeout=30)


def test_wait_for_ready_times_out(children: list[ChildProcess]) -> None:
    children.append(start_process(ipc_children.sleeper, "Quick", ctx=FORK))
    wait_for_ready(children, timeout=30)
    children.append(start_process(ipc_children.silent_sleeper, "Mute", ctx=FORK))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"not ready after 1.0 s: Mute \(pid \d+\)$"):
        wait_for_ready(children, timeout=1.0)
    assert time.monotonic() - start < 5


def test_child_killed_before_ready(children: list[ChildProcess]) -> None:
    children.append(start_process(ipc_children.silent_sleeper, "Victim", ctx=FORK))
    children[0].process.kill()  # dies without a word, like an OOM kill
    with pytest.raises(
        ChildDiedError, match=r"Victim .* before it was ready: killed by signal 9 \(SIGKILL\)"
    ):
        wait_for_ready(children, timeout=30)


def test_monitor_reports_which_child_died(children: list[ChildProcess]) -> None:
    children += [start_process(ipc_children.sleeper, f"Worker_TP{i}", ctx=FORK) for i in range(2)]
    wait_for_ready(children, timeout=30)
    died: list[tuple[str, str]] = []
    event = threading.Event()

    def on_death(child: ChildProcess) -> None:
        died.append((child.name, describe_exit(child.exitcode)))
        event.set()

    monitor = ProcessMonitor(children, on_death)
    try:
        children[1].process.kill()
        assert event.wait(10)
        assert died == [("Worker_TP1", "killed by signal 9 (SIGKILL)")]
    finally:
        monitor.stop()


def test_reading_an_exit_code_leaves_the_child_for_the_monitor_to_reap(
    children: list[ChildProcess],
) -> None:
    # The event loop reads the engines' exit codes when a socket peer leaves, as the monitor
    # reaps the engine that died. A read that reaped made the monitor's `waitpid` find no
    # child, and a raise (exit 1) was reported as "still running" (CI, now and then).
    child = start_process(ipc_children.exit_before_ready, "Quitter", (1,), ctx=FORK)
    children.append(child)
    deadline = time.monotonic() + 30
    while child.exitcode is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert child.exitcode == 1
    # still a zombie for the monitor (this raises ChildProcessError once it is reaped)
    assert os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    died: list[str] = []
    event = threading.Event()

    def on_death(c: ChildProcess) -> None:
        died.append(describe_exit(c.exitcode))
        event.set()

    monitor = ProcessMonitor([child], on_death)
    try:
        assert event.wait(30)
        assert died == ["exit code 1"]
    finally:
        monitor.stop()
    assert child.exitcode == 1
    with pytest.raises(ChildProcessError):  # reaped, by the monitor
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)


def test_shutdown_escalates_to_sigkill(children: list[ChildProcess]) -> None:
    polite = start_process(ipc_children.sleeper, "Polite", ctx=FORK)
    stubborn = start_process(ipc_children.stubborn_sleeper, "Stubborn", ctx=FORK)
    children += [polite, stubborn]
    wait_for_ready(children, timeout=30)
    start = time.monotonic()
    shutdown_processes(children, timeout=0.3, kill_timeout=5)
    assert time.monotonic() - start < 5
    assert polite.exitcode == -signal.SIGTERM
    assert stubborn.exitcode == -signal.SIGKILL


def test_closing_the_death_pipe_stops_the_child(children: list[ChildProcess]) -> None:
    child = start_process(ipc_children.sleeper, "Orphan", ctx=FORK, grace_s=0.5)
    children.append(child)
    wait_for_ready(children, timeout=30)
    child.close_pipes()  # as if this process had died
    child.process.join(5)
    assert child.exitcode == -signal.SIGTERM


def test_forked_siblings_do_not_hold_each_others_death_pipe(
    children: list[ChildProcess],
) -> None:
    first = start_process(ipc_children.sleeper, "First", ctx=FORK, grace_s=0.5)
    second = start_process(ipc_children.sleeper, "Second", ctx=FORK)  # forked after: inherits fds
    children += [first, second]
    wait_for_ready(children, timeout=30)
    first.close_pipes()
    first.process.join(5)
    assert first.exitcode == -signal.SIGTERM  # EOF came although Second is alive
    assert second.process.is_alive()


def test_describe_exit() -> None:
    assert describe_exit(None) == "still running"
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(-9) == "killed by signal 9 (SIGKILL)"
    assert describe_exit(-200) == "killed by signal 200"


def test_a_process_freezes_its_startup_heap_and_still_collects_later_garbage() -> None:
    """`freeze_startup_heap` (the engine core, workers and API servers call it once started):
    what was alive is out of the collector's sight, and cycles made afterwards are still
    collected."""
    code = textwrap.dedent(
        """
        import gc
        from treadle.ipc.process import freeze_startup_heap
        keep = [[i] for i in range(1000)]
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        assert frozen >= 1000, frozen
        class Node:
            pass
        for _ in range(100):
            a, b = Node(), Node()
            a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 200
        print("ok", frozen)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.startswith("ok")


def test_signalling_children_reaps_none_of_them(children: list[ChildProcess]) -> None:
    """Only the process monitor reaps (issue 42 item 8): `signal_children` (and the
    launcher's and the start-up's checks) read an exit without reaping it, else the monitor's
    own wait could lose the race and read the exit code as None."""
    children.append(start_process(ipc_children.exit_before_ready, "Quitter", (3,), ctx=FORK))
    pid = children[0].pid
    assert pid is not None
    deadline = time.monotonic() + 30
    while children[0].exitcode is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    signal_children(children, signal.SIGTERM)
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # not reaped yet
    assert info is not None and info.si_status == 3 and children[0].exitcode == 3
