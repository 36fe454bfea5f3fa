"""Starting this host's engine cores (and, on the front-end host with DP > 1, the DP
coordinator) and answering every engine's start-up handshake (ARCHITECTURE §2, §5, §8).

    launcher = EngineLauncher(config)           # before any zmq context: children may fork
    ...front ends bind their ROUTER/PULL and make their keys...
    infos = launcher.handshake(ctx, inputs, outputs, keys)
        engine --HELLO (rank, secret)--> handshake ROUTER
            --ADDRESSES (front ends, coordinator, launch number, a token per front end)--> engine
        engine --PHASE (loading weights, profiling the KV cache, ...)--> handshake ROUTER
        engine loads the model, sizes its KV cache --READY--> handshake ROUTER

The handshake socket is ipc when every engine runs here, else tcp on
`--data-parallel-address:--data-parallel-rpc-port`, where engines of `--headless` hosts
connect. Anyone who reaches it may say HELLO: an engine started here gets a random secret in
its process arguments and only a HELLO with it is answered; an engine of another host is
taken on first use (the first HELLO of its rank in that handshake; nothing else can prove
it; a second one is refused). The tokens (`ipc/engine_auth.py`) are what then binds each
engine to its connection on every front end's request socket. A local child that dies or
fails during start-up is reported with its own error. The messages are answered by
`handshake.py:HandshakeDesk`; an API server with its own engines keeps it open while
serving (`keep`), for its restarted engines and remote ones that rejoin.
"""

from __future__ import annotations

import hmac
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from treadle import envs
from treadle.config import EngineConfig
from treadle.core.dp_coordinator import run_dp_coordinator
from treadle.frontend.handshake import HandshakeDesk, Hello
from treadle.frontend.startup import StartupProgress
from treadle.ipc.inbound import inbound_options
from treadle.ipc.process import (
    ChildProcess,
    ReadyStatus,
    describe_exit,
    shutdown_processes,
    signal_children,
    start_process,
    stop_watched,
    wait_for_ready,
)
from treadle.ipc.zmq_utils import (
    get_open_zmq_ipc_path,
    get_tcp_uri,
    make_zmq_socket,
    remove_ipc_files,
)
from treadle.logger import init_logger
from treadle.wire.control import CoordinatorAddresses, Handshake, HandshakeStatus, StartupPhase
from treadle.worker.start_checks import check_config

logger = init_logger(__name__)


def run_engine_core(*args: Any, **kwargs: Any) -> None:
    """`core.engine_core_proc.run_engine_core`, imported in the child: the engine core's
    modules (and torch) stay out of the API server (issue 41 item 2)."""
    from treadle.core.engine_core_proc import run_engine_core as run

    run(*args, **kwargs)


def front_end_host(config: EngineConfig) -> str | None:
    """The host that engine-facing sockets bind on: None (ipc) when every engine is local."""
    p = config.parallel
    if not p.multi_node:
        return None
    return p.data_parallel_address or "127.0.0.1"


class EngineLauncher:
    def __init__(
        self,
        config: EngineConfig,
        shutdown_timeout: float = 0.0,
        front_end: bool = True,
        progress: StartupProgress | None = None,
    ):
        """`progress`: told each engine's start-up phase (and given the children, to stop)."""
        p = config.parallel
        p.check()
        check_config(config)  # a mistake in the flags fails here, before any process starts
        self.num_engines = p.data_parallel_size
        self.config = config
        self.shutdown_timeout = shutdown_timeout
        self.start_rank = p.data_parallel_start_rank
        host = front_end_host(config)
        if host is not None or not front_end:
            assert p.data_parallel_rpc_port is not None
            self.handshake_address = get_tcp_uri(
                p.data_parallel_address or "127.0.0.1", p.data_parallel_rpc_port
            )
        else:
            self.handshake_address = get_open_zmq_ipc_path()
        self.coordinator: ChildProcess | None = None
        self.engines: list[ChildProcess] = []
        self.local_ranks = range(self.start_rank, self.start_rank + p.local_engine_count)
        self._secrets: dict[int, bytes] = {}  # local rank -> its current process's secret
        self._launches = [0] * p.data_parallel_size  # rank -> its last handshake's number
        self._coordinator_addresses: CoordinatorAddresses | None = None
        self.desk: HandshakeDesk | None = None  # the handshake socket, when kept open
        self.progress = progress
        if progress is not None:
            progress.children = lambda: self.children
        try:
            if front_end and p.data_parallel_size > 1:
                self.coordinator = start_process(
                    run_dp_coordinator, "DPCoordinator", args=(p.data_parallel_size, host)
                )
            start = p.data_parallel_start_rank
            for rank in range(start, start + p.local_engine_count):
                self.engines.append(self._start_engine(rank))
        except BaseException:
            self.shutdown()
            raise

    def _start_engine(self, rank: int) -> ChildProcess:
        self._secrets[rank] = secret = os.urandom(16)
        return start_process(
            run_engine_core,
            f"EngineCore_DP{rank}",
            args=(self.config, self.handshake_address, rank, self.shutdown_timeout, secret),
        )

    def restart_engine(
        self,
        rank: int,
        ctx: zmq.Context[Any],
        inputs: list[str],
        outputs: list[str],
        keys: list[bytes],
    ) -> ChildProcess:
        """Replace this host's engine core of `rank` (dead, or killed here) by a new process
        of the same config and rank, and run its handshake; returns the new child. Raises as
        `handshake` does when it cannot start."""
        new = self.start_again(rank)
        self.handshake(ctx, inputs, outputs, keys, ranks=[rank])
        return new

    def restart_coordinator(self) -> ChildProcess:
        """Replace the (dead) DP coordinator by a new one bound to the same addresses; returns
        the new child once it is ready."""
        old = self.coordinator
        addresses = self._coordinator_addresses
        assert old is not None and addresses is not None
        if old.exitcode is None:  # (read without reaping: the process monitor reaps)
            old.process.kill()
        shutdown_processes([old], timeout=1.0)
        return self._start_coordinator(addresses)

    def _start_coordinator(self, addresses: CoordinatorAddresses) -> ChildProcess:
        self.coordinator = new = start_process(
            run_dp_coordinator,
            "DPCoordinator",
            args=(self.num_engines, front_end_host(self.config), addresses),
        )
        wait_for_ready([new], envs.engine_ready_timeout_s())
        return new

    # -- scaling (`POST /scale`, `engine_scale.py`) -----------------------------------------

    def add_engines(self, n: int) -> list[ChildProcess]:
        """Admit the ranks from `num_engines` up to `n`; returns the children started for
        them: engine cores of this host (each says HELLO to `desk`, kept open), or none
        where engines run on other hosts (`multi_node`): a new rank is then another host's,
        started there with `treadle serve --headless` (this host keeps its `-dpl`)."""
        start = self.num_engines
        self._launches.extend([0] * (n - start))  # (in place: the desk reads this list)
        remote = self.config.parallel.multi_node
        new = [] if remote else [self._start_engine(rank) for rank in range(start, n)]
        self.engines.extend(new)
        self._set_size(n)
        return new

    def remove_engines(self, n: int) -> list[ChildProcess]:
        """Forget the ranks from `n` up; returns their children, for the caller to stop."""
        gone = self.engines[n - self.start_rank :]
        del self.engines[n - self.start_rank :]
        del self._launches[n:]
        for rank in range(n, self.num_engines):
            self._secrets.pop(rank, None)
        self._set_size(n)
        return gone

    def _set_size(self, n: int) -> None:
        self.num_engines = n
        self.local_ranks = range(self.start_rank, self.start_rank + len(self.engines))

    def resize_coordinator(self) -> ChildProcess:
        """Replace the DP coordinator by one for `num_engines` engines on the same addresses
        (engines and front ends reconnect; the wave number comes back with the next
        `start_wave`); the caller has made the old one's exit expected."""
        old, addresses = self.coordinator, self._coordinator_addresses
        assert old is not None and addresses is not None
        old.process.terminate()
        stop_watched([old], timeout=5.0)  # (its process monitor reaps it)
        return self._start_coordinator(addresses)

    @property
    def children(self) -> list[ChildProcess]:
        return [*self.engines, *([self.coordinator] if self.coordinator else [])]

    def coordinator_addresses(self, timeout: float) -> CoordinatorAddresses | None:
        if self.coordinator is None:
            return None
        if self._coordinator_addresses is None:
            payload = wait_for_ready([self.coordinator], timeout)[0]
            self._coordinator_addresses = msgspec.msgpack.decode(payload, type=CoordinatorAddresses)
        return self._coordinator_addresses

    def handshake(
        self,
        ctx: zmq.Context[Any],
        inputs: list[str],
        outputs: list[str],
        keys: list[bytes],
        watch: Sequence[ChildProcess] = (),
        ranks: Sequence[int] | None = None,
        keep: bool = False,
    ) -> dict[int, Handshake]:
        """Give every engine (local or remote; or only those of `ranks`) the front ends' and
        the coordinator's addresses and a token for each front end's `keys` entry, and wait
        until each has loaded its model; returns each rank's READY message. `keep`: the
        handshake socket stays open (`desk`) for the engines that start later, whose
        handshake the caller then answers (`engine_rejoin.py`)."""
        if len(keys) != len(inputs):
            raise ValueError("one key per front end")
        expected = set(range(self.num_engines) if ranks is None else ranks)
        if ranks is not None:  # a restart: only the new processes can fail it
            watch = [*watch, *(self.engines[r - self.start_rank] for r in ranks)]
        timeout = envs.engine_ready_timeout_s()
        deadline = time.monotonic() + timeout
        coordinator = self.coordinator_addresses(timeout)
        addresses = Handshake(
            HandshakeStatus.ADDRESSES,
            inputs=inputs,
            outputs=outputs,
            coordinator_input=coordinator.engine_publish if coordinator else "",
            coordinator_output=coordinator.engine_stats if coordinator else "",
        )
        sock = make_zmq_socket(
            ctx, self.handshake_address, zmq.ROUTER, linger=0, options=inbound_options()
        )
        on_phase = self.progress.report if self.progress is not None else None
        desk = HandshakeDesk(sock, addresses, keys, self._launches, self._check_secret, on_phase)
        desk.expect(expected)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        everyone = ranks is None
        self.watch(poller, watch, everyone)
        try:
            while set(desk.ready) != expected:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(expected - set(desk.ready))
                    raise TimeoutError(
                        f"engine core(s) {missing} were not ready within {timeout} s; raise "
                        "TREADLE_ENGINE_READY_TIMEOUT_S if loading the model takes longer"
                    )
                events = dict(poller.poll(int(min(remaining, 1.0) * 1000)))
                self.check(poller, events, watch, everyone)
                if sock in events:
                    hello = desk.on_message(sock.recv_multipart())
                    if isinstance(hello, Hello) and hello.rank >= self.num_engines:
                        if keep and self.config.parallel.multi_node:  # `POST /scale` may add it
                            desk.hold(hello)
                        else:
                            desk.refuse(hello, f"this server has no engine rank {hello.rank}")
                    elif isinstance(hello, Hello):  # a second one for its rank
                        desk.refuse(hello, f"engine rank {hello.rank} has said HELLO already")
                    elif hello is not None and on_phase is not None:  # its READY
                        on_phase(hello, StartupPhase.HANDSHAKE)
                    for rank in [r for r in desk.failed if r not in self.local_ranks]:
                        raise RuntimeError(  # (ours say why on their ready pipes)
                            f"engine core {rank} of another host failed to start: "
                            f"{desk.failed[rank]}"
                        )
                    for reply in desk.take():
                        sock.send_multipart(reply)
        except BaseException:
            desk.close()
            raise
        if keep:
            self.desk = desk
        else:
            desk.close()
        return desk.ready

    def start_again(self, rank: int) -> ChildProcess:
        """Replace this host's engine core of `rank` (dead, or killed here) by a new process
        of the same config and rank, which then says HELLO (to `desk`, kept open)."""
        i = rank - self.start_rank
        old = self.engines[i]
        if old.exitcode is None:  # (read without reaping: the process monitor reaps)
            old.process.kill()
        shutdown_processes([old], timeout=1.0)
        self.engines[i] = new = self._start_engine(rank)
        return new

    def check_started(self, child: ChildProcess) -> None:
        """Raise the start-up error of a local child that failed or died (without a poller)."""
        if child.exitcode is not None:
            child.process.join(1.0)
            _raise_if_failed(child)
            raise RuntimeError(
                f"the {child.name} process died during start-up: {describe_exit(child.exitcode)}"
            )

    def _check_secret(self, rank: int, secret: bytes) -> None:
        """An engine of this host must show the secret its process was started with; one of
        another host (`--headless`) is taken on first use."""
        if rank in self.local_ranks and not hmac.compare_digest(
            secret, self._secrets.get(rank, b"")
        ):
            raise ValueError(f"a HELLO for engine rank {rank} without its secret")

    def watch(
        self, poller: zmq.Poller, extra: Sequence[ChildProcess] = (), everyone: bool = True
    ) -> None:
        """Register what `check` needs: every local child's sentinel and ready pipe (or only
        those of `extra`)."""
        for child in [*(self.children if everyone else ()), *extra]:
            poller.register(child.sentinel, zmq.POLLIN)
            if not child.is_ready and not child.ready_reader.closed:
                poller.register(child.ready_reader.fileno(), zmq.POLLIN)

    def check(
        self,
        poller: zmq.Poller,
        events: dict[Any, int],
        extra: Sequence[ChildProcess] = (),
        everyone: bool = True,
    ) -> None:
        """Raise the start-up error of a local child that failed or died."""
        for child in [*(self.children if everyone else ()), *extra]:
            if not child.ready_reader.closed and child.ready_reader.fileno() in events:
                poller.unregister(child.ready_reader.fileno())  # it says one thing, once
                _raise_if_failed(child)
            if child.sentinel in events:
                child.process.join(1.0)
                _raise_if_failed(child)
                raise RuntimeError(
                    f"the {child.name} process died during start-up: "
                    f"{describe_exit(child.exitcode)}"
                )

    def shutdown(self, timeout: float = 5.0) -> None:
        if self.desk is not None:
            self.desk.close()
        # The engine cores are asked to stop (SIGUSR1, as a front end asks: a normal end,
        # logged as one, not as "Received SIGTERM"); SIGTERM follows for any still running
        # after `timeout`. A stop during the start-up terminates them all at once, as before
        # (an engine that is stopping already ignores SIGUSR1).
        stopped_early = self.progress is not None and self.progress.stopping
        asked = [] if stopped_early else self.engines
        signal_children(asked, signal.SIGUSR1)
        for child in self.children:
            if child not in asked and child.exitcode is None:
                child.process.terminate()
        shutdown_processes(self.children, timeout=timeout)
        if self._coordinator_addresses is not None:  # in case it was killed
            remove_ipc_files(msgspec.structs.astuple(self._coordinator_addresses))


def _raise_if_failed(child: ChildProcess) -> None:
    """Raise the child's own start-up error if it sent one on its ready pipe."""
    reader = child.ready_reader
    try:
        if reader.poll():
            status, payload = reader.recv()
            if status == ReadyStatus.FAILED:
                logger.error("%s failed to start:\n%s", child.name, payload)
                last = str(payload).strip().splitlines()[-1]
                raise RuntimeError(f"the {child.name} process failed to start: {last}")
            child.ready_payload, child.is_ready = payload, True
    except (EOFError, OSError):
        pass
