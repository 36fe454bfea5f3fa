"""`POST /scale` with several API servers (issue 42 item 3): the API server's side. The
`treadle serve` supervisor owns the engines, so it runs the scale (`cli/supervised_scale.py`)
and every API server applies the same steps, each acknowledged (`engine_events.ScaleAck`):

    POST /scale -> ScaleAsk -> supervisor
    out: ScaleStep(admit, N)  every API server admits ranks old..N-1 on its request socket
         (their hello is awaited), acks; the supervisor starts them and runs their handshake
    in:  ScaleStep(drain, N)  every API server sends nothing new to ranks N..old-1; what runs
         there finishes (or moves after drain_timeout, as one API server's scale does), acks;
         ScaleStep(release, N) (when some are other hosts'): every API server asks those to
         stop (`RELEASE`, on its request socket) and acks once their STOPPED frame came;
         the supervisor stops this host's (SIGUSR1: their STOPPED frame and exit are expected)
    both: Scaled(old, N)      every API server resizes its slots, router and loggers (for new
         ranks once their hello came), acks; one event, counted (`/topology`: `events`)
    ScaleEnded                the answer to the API server that asked (its HTTP 200, or why not)
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from treadle import envs
from treadle.frontend.engine_events import (
    ScaleAck,
    ScaleAsk,
    Scaled,
    ScaleEnded,
    ScaleEvent,
    ScaleStep,
)
from treadle.frontend.engine_state import Death, EngineState
from treadle.frontend.engine_watch import ENGINE_PING_TIMEOUT_S
from treadle.logger import init_logger

if TYPE_CHECKING:
    from treadle.frontend.async_client import AsyncMPClient
    from treadle.frontend.engine_scale import EngineScaler

logger = init_logger(__name__)


class ScaleRefused(ValueError):
    """The scale cannot be done as asked (HTTP 400; `busy`: 409, try again later)."""

    def __init__(self, message: str, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy


class SupervisedScale:
    def __init__(self, client: AsyncMPClient, scaler: EngineScaler) -> None:
        self.client = client
        self.scaler = scaler
        self._asked: asyncio.Future[ScaleEnded] | None = None
        self._hellos: dict[int, asyncio.Future[None]] = {}  # new rank -> its hello
        self._theirs: list[int] = []  # ranks of other hosts leaving that still run (scale in)

    async def scale(self, n: int, drain_timeout: float) -> int:
        """Ask the supervisor; returns the size before once every API server applied it.
        Raises `ScaleRefused` (its refusal), or `RuntimeError` (a failure)."""
        client = self.client
        publish = client.watch.publish
        if publish is None or client.loop is None:
            raise ScaleRefused("this API server has no channel to its supervisor")
        if self._asked is not None:
            raise ScaleRefused("a scale is already under way: try again when it ends", busy=True)
        self._asked = client.loop.create_future()
        try:
            publish(ScaleAsk(client.client_index, n, drain_timeout))
            limit = drain_timeout + envs.scale_join_timeout_s() + 2 * envs.engine_ready_timeout_s()
            ended = await asyncio.wait_for(asyncio.shield(self._asked), limit)
        finally:
            self._asked = None
        if ended.error:
            if ended.busy or ended.error.startswith("refused: "):
                raise ScaleRefused(ended.error.removeprefix("refused: "), busy=ended.busy)
            raise RuntimeError(ended.error)
        return ended.old

    async def on_event(self, event: ScaleEvent) -> None:
        """(The supervisor reader, one event at a time: nothing here waits long.)"""
        client = self.client
        if isinstance(event, ScaleEnded):
            asked = self._asked
            if event.client_index == client.client_index and asked and not asked.done():
                asked.set_result(event)
        elif isinstance(event, ScaleStep) and event.step == "admit":
            self._admit(event.size)
            self._ack("admit", event.size)
        elif isinstance(event, ScaleStep) and event.step == "drain":
            client.spawn(self._drain(event.size, event.drain_timeout), "scale-in drain")
        elif isinstance(event, ScaleStep) and event.step == "release":
            client.spawn(self._release(event.size), "scale-in release")
        elif isinstance(event, Scaled):
            self._scaled(event)

    def _ack(self, step: str, size: int) -> None:
        assert self.client.watch.publish is not None
        self.client.watch.publish(ScaleAck(self.client.client_index, step, size))

    # -- scale out ------------------------------------------------------------------------

    def _admit(self, n: int) -> None:
        """Ranks up to `n` may say hello on the request socket (their slots come with
        `Scaled`); each one's hello is awaited."""
        client = self.client
        old = client.num_engines
        if n <= old:
            return
        client.engines.resize(n)
        for rank in range(old, n):
            self._hellos[rank] = client.watch.expect_hello(rank)

    def _scaled(self, event: Scaled) -> None:
        client = self.client
        old, n = client.num_engines, event.size
        if n > old:
            self.scaler.resize(n)
            client.restarts.started(event.pids, first=old)
            for rank in range(old, n):  # (a hello that came first found no slot to count in)
                hello = self._hellos.get(rank)
                if hello is not None and hello.done():
                    client.restarts.new_launch(rank, event.pids[rank - old])
            client.spawn(self._await_hellos(range(old, n), n), "scale-out hellos")
            logger.info("Scaled out from %d to %d engines", old, n)
            return
        for rank in range(n, old):
            client.fail_calls(rank, f"engine core {rank} was removed (POST /scale)")
        self.scaler.resize(n)  # (also what an `admit` grew, when the scale-out failed)
        client.watch.expected_stops = 0  # (a STOPPED frame comes before the exit)
        for rank in [r for r in self._hellos if r >= n]:
            client.watch.forget_hello(rank)
            del self._hellos[rank]
        if n < old:
            logger.info("Scaled in from %d to %d engines", old, n)
        self._ack("scaled", n)

    async def _await_hellos(self, ranks: range, n: int) -> None:
        hellos = [self._hellos[r] for r in ranks if r in self._hellos]
        try:
            await asyncio.wait_for(asyncio.gather(*hellos), ENGINE_PING_TIMEOUT_S)
        except TimeoutError:
            logger.error("Scaling out: engine core(s) %s did not say hello in time", list(ranks))
        finally:
            for rank in ranks:
                self.client.watch.forget_hello(rank)
                self._hellos.pop(rank, None)
        self._ack("scaled", n)

    # -- scale in -------------------------------------------------------------------------

    async def _drain(self, n: int, drain_timeout: float) -> None:
        """As one API server's scale in (`engine_scale.py`), up to the stop: the supervisor
        stops the engines once every API server has drained."""
        client = self.client
        restarts = client.restarts
        leaving = range(n, client.num_engines)
        running = [r for r in leaving if restarts.slots[r].state is not EngineState.LOST]
        restarts.drain(leaving)
        client.watch.expected_stops += len(running)  # each says STOPPED to every API server
        local = client.watch.local_ranks
        self._theirs = [r for r in running if r not in local] if self.scaler.remote else []
        logger.info(
            "Scaling in to %d engines: EngineCore_DP%s take no new request; draining %d "
            "request(s) (at most %.0f s)",
            n,
            list(leaving),
            sum(client.inflight.count(r) for r in leaving),
            drain_timeout,
        )
        deadline = time.monotonic() + drain_timeout
        while any(self.scaler.draining(r) for r in leaving) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = [r for r in leaving if self.scaler.draining(r)]
        if left:
            why = f"scale in: the drain timeout of {drain_timeout:.0f} s passed"
            logger.warning("Scaling in: %s; moving what EngineCore_DP%s run", why, left)
            await restarts.lost(left, Death(f"{why}; its requests resume on the others"))
        # The supervisor stops them (and replaces the DP coordinator) once every API server
        # acknowledged: their sockets' peers leave on purpose (information, not a warning).
        for rank in leaving:
            client.watch.note_gone(f"EngineCore_DP{rank} stopped (POST /scale)", True)
        client.watch.note_gone("the DP coordinator was replaced (POST /scale)", True)
        self._ack("drain", n)

    async def _release(self, n: int) -> None:
        """The leaving engines of other hosts are asked to stop (each API server asks: the
        first one's call stops it) and their STOPPED frames awaited; this host's, the
        supervisor stops after."""
        theirs, self._theirs = self._theirs, []
        watch = self.client.watch
        await self.scaler.release(theirs, max(0, watch.expected_stops - len(theirs)))
        self._ack("release", n)
