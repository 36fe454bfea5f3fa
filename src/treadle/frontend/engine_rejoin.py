"""The handshake socket while serving (issue 25): an API server that started its engines
(`RestartMode.OWN`) keeps it open after start-up and answers it from the event loop, for two
kinds of engine core that start later.

- Ours, restarted (`handshake`): its HELLO with the new process's secret is answered as at
  start-up, and the restart waits for its READY (or its start-up error).
- One of another host (`treadle serve --headless --data-parallel-start-rank R`) started
  again after its engine was lost: a HELLO of a remote rank R that is `lost` is answered
  with a new launch of R (taken on first use, as at start-up); its first message on the
  request socket then makes R serve again (`EngineWatch.on_new_launch`,
  `EngineRestarts.rejoined`). A HELLO of a rank that still serves is refused (the engine
  fails its start-up saying why) unless that engine does not answer a call within
  ENGINE_PING_TIMEOUT_S: then it is lost first (its requests resume on the others) and the
  new one takes its place. This host's own ranks never rejoin this way (a HELLO of one
  without its process's secret is dropped).
- One of another host for a rank that `POST /scale` adds (`join`): its HELLO is answered
  once the scale admits the rank, whether it came first (held: `HandshakeDesk.hold`) or
  within TREADLE_SCALE_JOIN_TIMEOUT_S after; the scale waits for its READY.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, Protocol

import zmq.asyncio

from treadle import envs
from treadle.config import EngineConfig
from treadle.frontend.engine_restarts import EngineRestarts
from treadle.frontend.engine_state import EngineState
from treadle.frontend.engine_watch import EngineWatch
from treadle.frontend.handshake import HandshakeDesk, Hello
from treadle.frontend.launcher import EngineLauncher
from treadle.ipc.process import ChildProcess
from treadle.logger import init_logger
from treadle.wire.control import Handshake

logger = init_logger(__name__)


def join_timeout(rank: int, loading: bool, config: EngineConfig) -> str:
    """What a scale out says when the engine of another host for `rank` did not join."""
    if loading:
        return (
            f"the engine core of another host for rank {rank} said HELLO but was not ready "
            f"within {envs.engine_ready_timeout_s()} s (TREADLE_ENGINE_READY_TIMEOUT_S): stop "
            "it on its host"
        )
    p = config.parallel
    return (
        f"no engine core of another host said HELLO for rank {rank} within "
        f"{envs.scale_join_timeout_s()} s (TREADLE_SCALE_JOIN_TIMEOUT_S): on its host, start "
        f"`treadle serve MODEL --headless -dp {rank + 1} -dpl 1 -dpr {rank} -dpa "
        f"{p.data_parallel_address or '127.0.0.1'} -dpp {p.data_parallel_rpc_port}` with this "
        "server's other flags, before POST /scale or within that time"
    )


def failed_join(rank: int, error: str) -> str:
    return f"the engine core of another host for rank {rank} failed to start: {error}"


class Spawner(Protocol):
    def spawn(self, coro: Coroutine[Any, Any, None], what: str, fatal: bool = True) -> None: ...


class EngineJoins:
    def __init__(
        self,
        client: Spawner,
        launcher: EngineLauncher,
        desk: HandshakeDesk,
        restarts: EngineRestarts,
        watch: EngineWatch,
    ) -> None:
        self.client = client
        self.launcher = launcher
        self.desk = desk
        self.restarts = restarts
        self.watch = watch
        self._joining: set[int] = set()  # remote ranks whose HELLO waits for a ping
        self._sock: zmq.asyncio.Socket | None = None

    async def run(self) -> None:
        """Read the handshake socket (a background task, while the client runs)."""
        self._sock = zmq.asyncio.Socket.from_socket(self.desk.sock)
        while True:
            if await self._sock.poll(1000):  # (each second at least: held HELLOs expire)
                got = self.desk.on_message(await self._sock.recv_multipart(copy=False))
                if isinstance(got, Hello):
                    self.client.spawn(self._join(got), f"join of engine rank {got.rank}", False)
            self.desk.decide_early()
            await self._send()

    async def _send(self) -> None:
        for reply in self.desk.take():
            if self._sock is not None:
                await self._sock.send_multipart(reply)

    async def handshake(self, rank: int, child: ChildProcess) -> None:
        """Our new process of `rank` (`EngineLauncher.start_again`) says HELLO and READY;
        raises its start-up error if it fails or dies first, `TimeoutError` if it is late."""
        self.desk.expect([rank])
        timeout = envs.engine_ready_timeout_s()
        deadline = time.monotonic() + timeout
        while rank not in self.desk.ready:
            self.launcher.check_started(child)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"engine core {rank} was not ready within {timeout} s; raise "
                    "TREADLE_ENGINE_READY_TIMEOUT_S if loading the model takes longer"
                )
            await asyncio.sleep(0.05)

    async def join(self, rank: int) -> Handshake:
        """`POST /scale` adds `rank`, another host's: its engine's HELLO (held already, or
        within TREADLE_SCALE_JOIN_TIMEOUT_S) is answered, and its READY awaited (within
        TREADLE_ENGINE_READY_TIMEOUT_S); returns the READY. Raises `TimeoutError` saying what
        to start where."""
        desk = self.desk
        desk.expect([rank])
        desk.decide_early()
        await self._send()
        join_s, ready_s = envs.scale_join_timeout_s(), envs.engine_ready_timeout_s()
        deadline, loading = time.monotonic() + join_s, False
        while rank not in desk.ready:
            if rank in desk.failed:
                raise RuntimeError(failed_join(rank, desk.failed[rank]))
            if self.watch.client.ended:  # (the server stops)
                raise RuntimeError(f"the server stopped while rank {rank} joined")
            if not loading and desk.joining(rank):  # greeted: it loads now
                deadline, loading = time.monotonic() + ready_s, True
            if time.monotonic() > deadline:
                raise TimeoutError(join_timeout(rank, loading, self.launcher.config))
            await asyncio.sleep(0.05)
        return desk.ready[rank]

    async def _join(self, hello: Hello) -> None:
        """A HELLO the desk did not expect: a remote engine that rejoins its rank, or not."""
        rank = hello.rank
        if rank >= self.launcher.num_engines:  # (not ours yet: `POST /scale` may add it)
            if self.launcher.config.parallel.multi_node:
                self.desk.hold(hello)
                await self._send()
            else:
                self.desk.drops.drop("Dropped a HELLO for engine rank %d: not one of ours", rank)
            return
        if rank in self.launcher.local_ranks:
            self.desk.drops.drop(
                "Dropped a HELLO for engine rank %d on the handshake socket: that engine runs "
                "on this host, and this is not its process",
                rank,
            )
            return
        if rank in self._joining:
            self.desk.refuse(hello, f"another engine core is joining as rank {rank}")
            await self._send()
            return
        self._joining.add(rank)
        try:
            if self.restarts.states[rank].serves:
                if await self.watch.answers(rank):
                    self.desk.refuse(
                        hello,
                        f"engine rank {rank} is up and answers: stop it first, or give this "
                        "one another --data-parallel-start-rank",
                    )
                    return
                await self.restarts.lost([rank])  # (its requests resume on the others)
            state = self.restarts.states[rank]
            if state is not EngineState.LOST:
                self.desk.refuse(hello, f"engine rank {rank} is {state}")
                return
            logger.warning(
                "An engine core of another host joins as rank %d (lost before): answering its "
                "handshake",
                rank,
            )
            self.desk.greet(hello)
        finally:
            self._joining.discard(rank)
            await self._send()
