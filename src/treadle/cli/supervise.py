"""`treadle serve` as a supervisor: several API servers (`--api-server-count N > 1`), or only
this host's engine cores (`--headless`). ARCHITECTURE §1, §8.

With N API servers the CLI process serves no HTTP. It binds the HTTP socket, starts the DP
coordinator and the engine cores, spawns the API servers (each gets the socket, a client
index and binds its own ROUTER/PULL pair, whose addresses come back on its ready pipe), runs
the engines' handshake with all those addresses, then watches every child. Each API server
serves HTTP from the start: until its engine client is built it answers as one API server
does while its engine starts (`starting.py`), with the phases the handshake here sees
(`supervised_desk.Notes`). Within one
--max-engine-restarts budget, a child that exits non-zero is restarted:

- an engine core: every API server hears of its death (`EngineDied`, `engine_events.py`)
  and resumes its requests when it says hello; one whose restart fails is lost
  (`EngineLost`) while others serve;
- the DP coordinator: a new one on the same addresses;
- an API server (when every engine is local): a new process of the same client index on
  the same HTTP socket, binding the dead one's ipc ROUTER/PULL addresses with its key. The
  engines see the dropped connection, abort its requests and connect to the new one by
  themselves; the other API servers keep serving, and their streams go on. Only the dead
  one's connections fail.

Any other death, or one past the budget, stops all of them and exits non-zero; SIGTERM/SIGINT
(to this process or to any child, which then exits 0) stop them all and exit 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from treadle import envs
from treadle.cli.supervised_desk import Notes, SupervisorDesk
from treadle.cli.supervised_scale import SupervisorScale, split_addresses
from treadle.cli.supervisor_stop import Stop
from treadle.config import EngineConfig
from treadle.entrypoints.openai.cli_args import FrontendArgs
from treadle.frontend.engine_events import (
    REPORT_WAIT_S,
    EngineDied,
    EngineEvent,
    EngineLost,
    StallKill,
)
from treadle.frontend.engine_state import Death, death_cause, lost_cause, others_serve
from treadle.frontend.launcher import EngineLauncher, front_end_host
from treadle.frontend.restart_sequence import RestartBudget, restart_child
from treadle.frontend.startup import StartupProgress, startup_address
from treadle.frontend.supervisor_reports import reports_address
from treadle.ipc.inbound import inbound_options
from treadle.ipc.process import (
    ChildProcess,
    ProcessMonitor,
    describe_exit,
    shutdown_processes,
    signal_children,
    start_process,
    wait_for_ready,
)
from treadle.ipc.zmq_utils import make_zmq_socket, remove_ipc_files
from treadle.logger import init_logger
from treadle.wire.control import DeathReport

logger = init_logger(__name__)


def _api_server_worker(*args: Any) -> None:
    """An API server process's target: the HTTP server's modules (FastAPI, pydantic,
    uvicorn: ~40 MiB) are imported in that process, never in the supervisor's."""
    from treadle.entrypoints.openai.api_server import run_api_server_worker

    run_api_server_worker(*args)


def bind_http_socket(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before any engine loads so that a port in use is reported at
    once (port 0: the OS picks one). Raises `ValueError` saying what to change."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(
            f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port "
            "(or --host), or stop the process that holds it"
        ) from None
    return sock


class _Restarts:
    """The supervisor's side of restarts, within the --max-engine-restarts budget that an API
    server with its own engines spends too: engine cores and the DP coordinator (the API
    servers resume their requests when a restarted engine says hello), and API servers."""

    def __init__(
        self,
        config: EngineConfig,
        launcher: EngineLauncher,
        stop: Stop,
        start_api_server: Callable[[int, list[str] | None], ChildProcess],
    ) -> None:
        self.budget = RestartBudget(config.restart.max_engine_restarts)
        self.launcher = launcher
        self.stop = stop
        self.start_api_server = start_api_server
        # A new API server binds the dead one's addresses again: ipc only (an engine on
        # another host exits when its tcp front end goes).
        self.local = front_end_host(config) is None
        self.api_servers: list[ChildProcess] = []  # by client index
        self.addresses: list[list[str]] = []  # what each reported: router, pull, key
        self.monitor: ProcessMonitor | None = None
        self.desk: SupervisorDesk | None = None  # the API servers' events; the handshake
        self.publish: Callable[[EngineEvent], None] = lambda event: None
        self.kills: dict[int, str] = {}  # engine rank -> why we killed its process
        self._deaths: dict[int, concurrent.futures.Future[Death]] = {}  # as announced

    def restartable(self, child: ChildProcess) -> bool:
        launcher = self.launcher
        ours = child is launcher.coordinator or any(child is e for e in launcher.engines)
        index = self._index(child)
        api_server = self.local and index is not None and index < len(self.addresses)
        return self.budget.limit > 0 and (ours or api_server)

    def restart(self, child: ChildProcess) -> None:
        """(The main thread.) The restart sequence that an API server with its own engines
        runs too (`restart_child`); nothing else runs here meanwhile."""
        cause = f"{child.describe()} died: {describe_exit(child.exitcode)}"
        fail = self._fail
        rank = self._rank(child)
        if rank is not None:  # as every API server heard it (`announce`)
            if rank not in self._deaths:
                self.announce(child)
            death = self._deaths.pop(rank).result()
            cause = death.describe()
            fail = lambda why: self._engine_failed(rank, why, death.report)  # noqa: E731
        sequence = restart_child(
            child.name, cause, self.budget, lambda: self._start_again(child), fail
        )
        if sequence is not None:
            asyncio.run(sequence)

    async def _start_again(self, child: ChildProcess) -> None:
        index = self._index(child)
        if index is not None:
            new = self._restart_api_server(index)
        elif child is self.launcher.coordinator:
            new = self.launcher.restart_coordinator()
        else:
            new = self._restart_engine(child)
        assert self.monitor is not None
        self.monitor.add(new)

    def _fail(self, why: str) -> None:
        if not self.stop.event.is_set():  # (not a restart cut short by a clean stop)
            self.stop.failure = why
        self.stop.event.set()

    def _report_of(self, rank: int, exitcode: int | None) -> DeathReport | None:
        """The engine's own death report, which an API server hands on (an engine that
        raised sends it just before its exit 1: waited for up to REPORT_WAIT_S, which a
        loaded host needs; it usually comes within milliseconds)."""
        if self.desk is None:
            return None
        return self.desk.report_of(rank, REPORT_WAIT_S if exitcode == 1 else 0.0)

    def announce(self, child: ChildProcess) -> None:
        """(The process monitor's thread.) An engine core died: every API server hears of it
        at once (`EngineDied`; for an exit 1 with its report, waited for in a thread), not
        once the restart of another engine that died first is done."""
        rank = self._rank(child)
        if rank is None:
            return
        death: concurrent.futures.Future[Death] = concurrent.futures.Future()
        self._deaths[rank] = death

        def say() -> None:
            try:
                report = self._report_of(rank, child.exitcode)
                died = death_cause(child.name, child.exitcode, self.kills.pop(rank, None))
                self.publish(EngineDied(rank, child.pid or 0, died, report, time.time()))
                death.set_result(Death(died, report))
            except BaseException as e:  # (the restart raises it)
                death.set_exception(e)

        threading.Thread(target=say, name=f"death of engine {rank}", daemon=True).start()

    def stall_kill(self, event: StallKill) -> None:
        """(The desk's thread.) An API server saw engine `rank` stall: kill its process,
        once (the first API server's cause is the one its death quotes)."""
        launcher = self.launcher
        i = event.rank - launcher.start_rank
        if not 0 <= i < len(launcher.engines) or event.rank in self.kills:
            return
        child = launcher.engines[i]
        if child.pid != event.pid or child.exitcode is not None:
            return  # (a process that is gone already, or replaced)
        self.kills[event.rank] = event.cause
        logger.error("%s: killing it", event.cause)
        child.process.kill()

    def _engine_failed(self, rank: int, why: str, report: DeathReport | None) -> None:
        """An engine core could not be started again (its restart failed, or the budget is
        spent): while another engine is not lost it is `lost` (its failed process killed;
        every API server hears it, `EngineLost`, and resumes its requests on the others),
        as with one API server; else the server ends."""
        launcher, desk = self.launcher, self.desk
        lost = desk.lost if desk is not None else {}
        others = others_serve(rank, launcher.num_engines, lost)
        if not others or self.stop.event.is_set() or desk is None:
            self._fail(why)
            return
        failed = launcher.engines[rank - launcher.start_rank]
        if failed.process.is_alive():
            failed.process.kill()
        shutdown_processes([failed], timeout=1.0)
        desk.lose(EngineLost(rank, lost_cause(why, rank), report, time.time()))

    def forget(self, rank: int) -> None:
        """Rank `rank` was removed (`POST /scale`)."""
        self.kills.pop(rank, None)
        if self.desk is not None:
            self.desk.lost.pop(rank, None)

    def _rank(self, child: ChildProcess) -> int | None:
        launcher = self.launcher
        i = next((i for i, e in enumerate(launcher.engines) if e is child), None)
        return None if i is None else launcher.start_rank + i

    def _index(self, child: ChildProcess) -> int | None:
        return next((i for i, s in enumerate(self.api_servers) if s is child), None)

    def _restart_api_server(self, index: int) -> ChildProcess:
        """A new API server `index` in the dead one's place (in the list before it is ready,
        so that a stop meanwhile stops it too); returns it once it is ready."""
        shutdown_processes([self.api_servers[index]], timeout=1.0)
        self.api_servers[index] = new = self.start_api_server(index, self.addresses[index])
        deadline = time.monotonic() + envs.engine_ready_timeout_s()
        while True:
            if self.stop.event.is_set():
                raise RuntimeError("stopped while it started")
            try:
                report = wait_for_ready([new], min(0.5, max(0.0, deadline - time.monotonic())))
                break
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
        if report[0] != self.addresses[index]:
            raise RuntimeError(f"{new.describe()} bound other addresses: {report[0][:2]}")
        return new

    def _restart_engine(self, child: ChildProcess) -> ChildProcess:
        launcher = self.launcher
        rank = self._rank(child)
        assert rank is not None
        if self.desk is not None and self.desk.desk is not None:  # (the handshake kept open)
            new = launcher.start_again(rank)
            self.desk.handshake(rank, new, launcher.check_started)
            return new
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            return launcher.restart_engine(rank, ctx, *split_addresses(self.addresses))
        finally:
            ctx.term()


def run_api_servers(
    config: EngineConfig,
    model_name: str,
    model_path: str,
    count: int,
    args: FrontendArgs,
    sock: socket.socket,
) -> int:
    """Serve with `count` API server processes on the bound HTTP socket `sock` (closed here)."""
    metrics_dir = None
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        metrics_dir = tempfile.mkdtemp(prefix="treadle-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    stop = Stop()
    signal.signal(signal.SIGTERM, stop.on_signal)
    signal.signal(signal.SIGINT, stop.on_signal)
    launcher: EngineLauncher | None = None
    api_servers: list[ChildProcess] = []
    addresses: list[list[str]] = []
    notes = Notes(count)
    progress = stop.progress = StartupProgress(config.parallel.data_parallel_size)
    desk: SupervisorDesk | None = None
    report_ctx: zmq.Context[Any] = zmq.Context()
    try:
        launcher = EngineLauncher(config, args.shutdown_timeout, progress=progress)
        timeout = envs.engine_ready_timeout_s()
        coordinator = launcher.coordinator_addresses(timeout)
        spawn = multiprocessing.get_context("spawn")  # always, for extra API servers (§7)

        def start_api_server(index: int, reuse: list[str] | None) -> ChildProcess:
            publish = coordinator.front_publish if coordinator else None
            worker_args = (
                *(sock, config, model_name, model_path, index, publish, args, reuse),
                notes.addresses[index],
            )
            # An orphaned API server gets 5 s (not 2) to drain and remove its socket files.
            return start_process(
                _api_server_worker, f"APIServer_{index}", worker_args, ctx=spawn, grace_s=5.0
            )

        restarts = _Restarts(config, launcher, stop, start_api_server)
        restarts.publish = notes.publish
        stop.announce = restarts.announce
        notes.start(progress, stop.event)
        stop.restartable = restarts.restartable
        api_servers = restarts.api_servers  # the same list: a restart replaces its entry
        api_servers.extend(start_api_server(index, None) for index in range(count))
        addresses = wait_for_ready(api_servers, timeout)
        # With engines on other hosts, the handshake socket stays open (`supervised_desk.py`).
        remote = config.parallel.multi_node
        launcher.handshake(report_ctx, *split_addresses(addresses), watch=api_servers, keep=remote)
        progress.finish()
        logger.info(
            "%d API servers listening on http://%s:%d; %d engine core(s) ready",
            count,
            args.host,
            sock.getsockname()[1],
            config.parallel.data_parallel_size,
        )
        restarts.addresses = addresses
        reports = make_zmq_socket(  # every API server's events (each binds its PUSH)
            report_ctx, reports_address(notes.addresses[0]), zmq.PULL, False, linger=0,
            options=inbound_options(),
        )  # fmt: skip
        for address in notes.addresses[1:]:
            reports.connect(reports_address(address))
        local_ranks = lambda: launcher.local_ranks  # noqa: E731
        scaler = SupervisorScale(
            launcher, stop, notes.publish, api_servers, lambda: restarts.addresses, restarts.forget
        )
        desk = SupervisorDesk(
            reports, launcher.desk, local_ranks, notes.publish, restarts.stall_kill,
            scaler.on_event,
        )  # fmt: skip
        desk.start()
        restarts.desk = scaler.desk = desk
        monitor = ProcessMonitor([*api_servers, *launcher.children], stop.on_death)
        restarts.monitor = scaler.monitor = monitor
        stop.wait(restarts.restart)
        monitor.stop()
    except KeyboardInterrupt:
        pass
    except Exception as e:
        if not stop.event.is_set():  # (else a stop during the start-up ended it)
            stop.failure = str(e)
    finally:
        # The engines abort what still runs after --shutdown-timeout (SIGUSR1: a graceful
        # stop) and answer it, which ends the API servers' streams; the API servers stop
        # meanwhile, then the engines and the coordinator are shut down.
        if desk is not None:
            desk.close()
        if launcher is not None:
            signal_children(launcher.engines, signal.SIGUSR1)
        for child in api_servers:
            if child.process.is_alive():
                child.process.terminate()
        shutdown_processes(api_servers, timeout=10.0)
        # Of a killed API server:
        remove_ipc_files(
            [
                *(a for entry in addresses for a in entry[:2]),
                *notes.addresses,
                *(startup_address(a) for a in notes.addresses),
                *(reports_address(a) for a in notes.addresses),
            ]
        )
        if launcher is not None:
            launcher.shutdown()
        sock.close()
        stop.event.set()  # (ends the notes' thread)
        notes.join()
        report_ctx.destroy(linger=0)
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    if stop.failure is not None:
        logger.error("Shutting down: %s", stop.failure)
        return 1
    return 0


def run_headless(config: EngineConfig, shutdown_timeout: float) -> int:
    """This host's engine cores only; they find the front end through the DP address and port
    and exit when it disconnects, and so does this process."""
    stop = Stop()
    signal.signal(signal.SIGTERM, stop.on_signal)
    signal.signal(signal.SIGINT, stop.on_signal)
    p = config.parallel
    if p.nnodes > 1:  # only this node's ranks; the engine core runs on node 0
        from treadle.executor.multinode import run_node

        return run_node(config, stop.event)
    launcher = EngineLauncher(config, shutdown_timeout, front_end=False)
    logger.info(
        "Headless: engine core(s) DP%d..DP%d connect to %s",
        p.data_parallel_start_rank,
        p.data_parallel_start_rank + p.local_engine_count - 1,
        launcher.handshake_address,
    )

    def on_death(child: ChildProcess) -> None:
        # One engine released by its front end (`POST /scale` removed its rank) exits 0;
        # the others serve on, and this process ends with the last.
        if child.exitcode == 0 and any(e.exitcode is None for e in launcher.engines):
            logger.info(
                "%s stopped (its front end released it); the others serve on", child.describe()
            )
            return
        stop.on_death(child)

    monitor = ProcessMonitor(launcher.children, on_death)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        monitor.stop()
        launcher.shutdown()
    if stop.failure is not None:
        logger.error("Shutting down: %s", stop.failure)
        return 1
    return 0
