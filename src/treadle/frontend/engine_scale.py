"""Engines that join and leave while serving (issue 25, `POST /scale`): an API server that
started its engines itself (`RestartMode.OWN`, `--api-server-count 1`, every engine on this
host) changes its data-parallel size. With several API servers (`RestartMode.FOLLOW`) the
supervisor runs it and every API server follows (`scale_follow.py`), with the same steps.

Scale out, ranks old..N-1: the launcher starts their engine cores, which do their handshake on
the handshake socket kept open while serving (`engine_rejoin.py:EngineJoins.handshake`) and
connect to the request socket (their first message, a new launch, ends the wait as a restarted
engine's does); only then does every per-rank list grow (the router, the restart state, the
output checks, the listener's metrics, dashboard windows and health pings) and the DP
coordinator is replaced by one for N engines on the same addresses. A start that fails
stops what it started and leaves the size as it was.

With engines on other hosts (`-dpl` < `-dp`: `--headless` ones) this host keeps its `-dpl`
engines and a new rank is another host's: nothing starts here; the rank is admitted on the
handshake socket and `POST /scale` waits for the HELLO of an engine started there with
`treadle serve --headless -dp N -dpl 1 -dpr R` (one that came first waits for it:
`HandshakeDesk.hold`; else within TREADLE_SCALE_JOIN_TIMEOUT_S), then for its READY
(`engine_rejoin.py:EngineJoins.join`), then goes on as above. Such ranks are watched as the
first remote ones are (a disconnect and a silence: `EngineWatch.unwatched`).

Scale in, ranks N..old-1 (the highest): they are `draining` (no new request; a request pinned
to one gets 503), what they run finishes there; after the drain timeout what is left moves to
the others through the resume path (`EngineRestarts.lost`: sent again with what its client
has, so greedy text is the same). Then each process is asked to stop (SIGUSR1) and stops (its
`ENGINE_CORE_STOPPED` frame and exit 0 are expected, not the server's stop), the lists shrink
and the coordinator is replaced. A `lost` rank is removed the same way, with nothing to drain.
An engine of another host is asked through its request socket instead (`release`: the
`RELEASE` utility call, which it takes as SIGUSR1), and its STOPPED frame is awaited (at
most RELEASE_S); it exits 0, and so does its `--headless` CLI when no other engine of its
is left. This host's own `-dpl` engines are never removed there.
"""

from __future__ import annotations

import asyncio
import signal
import time
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

from treadle.frontend.engine_state import Death, EngineState, RestartMode
from treadle.frontend.engine_watch import ENGINE_PING_TIMEOUT_S
from treadle.frontend.handshake import MAX_ENGINES
from treadle.frontend.scale_follow import ScaleRefused, SupervisedScale
from treadle.ipc.process import ChildProcess, signal_children, stop_watched
from treadle.logger import init_logger

if TYPE_CHECKING:
    from treadle.frontend.async_client import AsyncMPClient

logger = init_logger(__name__)

MAX_DATA_PARALLEL_SIZE = MAX_ENGINES
"""The most engines `POST /scale` starts (each is a process with its model and KV cache)."""

NO_COORDINATOR = (
    "the server started with --data-parallel-size 1 (no DP coordinator): start it with "
    "--data-parallel-size 2 or more to scale"
)
RELEASE_S = 30.0
"""How long a removed engine of another host has to say it stopped (it has no requests)."""


def check_local(n: int, local: int, remote: bool) -> None:
    """With engines on other hosts, `POST /scale` adds and removes those: this host's stay."""
    if remote and n < local:
        raise ScaleRefused(
            f"data_parallel_size {n} would remove engines of this host: with engines on other "
            f"hosts, POST /scale adds and removes those, and this host's {local} "
            "(--data-parallel-size-local) stay; scale to at least that"
        )


class EngineScaler:
    def __init__(self, client: AsyncMPClient, remote: bool, local: int) -> None:
        """`remote`: some engines run on other hosts (new ranks are theirs); `local`: how
        many run here (`-dpl`)."""
        self.client = client
        self.remote = remote
        self.local = local
        self.scaling = False
        self._retired: list[ChildProcess] = []  # stopped on purpose: their exits are expected
        self.releasing: list[int] = []  # ranks leaving that still run (a scale in)
        # With several API servers the supervisor scales, and every API server follows.
        self.supervised = SupervisedScale(client, self)
        client.restarts.scale_events = self.supervised.on_event

    def retired(self, child: ChildProcess) -> bool:
        return any(child is c for c in self._retired)

    def check(self, n: int) -> None:
        """Raise `ScaleRefused` saying what to change when this client cannot scale to `n`."""
        client = self.client
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ScaleRefused(f"data_parallel_size must be an integer of at least 1, not {n!r}")
        if n > MAX_DATA_PARALLEL_SIZE:
            raise ScaleRefused(f"data_parallel_size {n} is above {MAX_DATA_PARALLEL_SIZE}")
        if self.scaling:
            raise ScaleRefused("a scale is already under way: try again when it ends", busy=True)
        for rank, state in enumerate(client.engine_states):
            if state in (EngineState.RESTARTING, EngineState.RESUMING):
                raise ScaleRefused(
                    f"engine core {rank} is {state}: try again once /health/ready is 200",
                    busy=True,
                )
        check_local(n, self.local, self.remote)
        if client.mode is RestartMode.FOLLOW:  # the supervisor checks the rest
            return
        launcher = client.launcher
        if launcher is None or client.mode is not RestartMode.OWN or client.joins is None:
            raise ScaleRefused(
                "POST /scale needs engine restarts on (--max-engine-restarts > 0): new engines "
                "do their handshake on the socket that restarts keep open"
            )
        if launcher.coordinator is None:
            raise ScaleRefused(NO_COORDINATOR)

    async def scale(self, n: int, drain_timeout: float) -> int:
        """Scale to `n` engines; returns the size before. Raises `ScaleRefused`, or what a
        new engine's start raised (the size is then as before)."""
        self.check(n)
        old = self.client.num_engines
        if n == old:
            return old
        self.scaling = True
        try:
            if self.client.mode is RestartMode.FOLLOW:
                return await self.supervised.scale(n, drain_timeout)
            if n > old:
                await self._out(old, n)
            else:
                await self._in(old, n, drain_timeout)
        finally:
            self.scaling = False
        return old

    # -- scale out ------------------------------------------------------------------------

    async def _out(self, old: int, n: int) -> None:
        client = self.client
        launcher, joins, monitor = client.launcher, client.joins, client.monitor
        assert launcher is not None and joins is not None and monitor is not None
        where = "waiting for the --headless engine(s) of" if self.remote else "starting"
        logger.info(
            "Scaling out from %d to %d engines: %s EngineCore_DP%d..%d", old, n, where, old, n - 1
        )
        start = time.monotonic()
        client.engines.resize(n)  # (their first message on the request socket is admitted)
        hellos = {rank: client.watch.expect_hello(rank) for rank in range(old, n)}
        children = await asyncio.to_thread(launcher.add_engines, n)
        pids = [child.process.pid or 0 for child in children]
        for child in children:
            monitor.add(child)
        try:
            for rank, child in zip(range(old, old + len(children)), children, strict=True):
                await joins.handshake(rank, child)
                logger.info(
                    "Scaling out: EngineCore_DP%d (pid %d) is ready", rank, pids[rank - old]
                )
            for rank in range(old + len(children), n):  # another host's
                pids.append((await joins.join(rank)).pid)
                logger.info("Scaling out: EngineCore_DP%d of another host is ready", rank)
            await asyncio.wait_for(asyncio.gather(*hellos.values()), ENGINE_PING_TIMEOUT_S)
        except BaseException as e:
            logger.error("Scaling out to %d engines failed: %s; stopping the new ones", n, e)
            self._retired.extend(children)
            for child in children:
                child.process.kill()
            await asyncio.to_thread(stop_watched, children, 0.0)
            joins.desk.forget(range(old, n))
            launcher.remove_engines(old)
            client.engines.resize(old)
            raise
        finally:
            for rank in hellos:
                client.watch.forget_hello(rank)
        self.resize(n)
        client.restarts.started(pids, first=old)
        await self._new_coordinator()
        logger.info("Scaled out from %d to %d engines in %.1f s", old, n, time.monotonic() - start)

    # -- scale in -------------------------------------------------------------------------

    async def _in(self, old: int, n: int, drain_timeout: float) -> None:
        client = self.client
        restarts = client.restarts
        leaving = range(n, old)
        lost = [r for r in leaving if restarts.slots[r].state is EngineState.LOST]
        self.releasing = [r for r in leaving if r not in lost]  # (moved ones too: they run)
        restarts.drain(leaving)
        logger.info(
            "Scaling in from %d to %d engines: EngineCore_DP%d..%d take no new request; "
            "draining %d request(s) (at most %.0f s)%s",
            old,
            n,
            n,
            old - 1,
            sum(client.inflight.count(r) for r in leaving),
            drain_timeout,
            f"; {lost} are lost" if lost else "",
        )
        deadline = time.monotonic() + drain_timeout
        while any(self.draining(r) for r in leaving) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = [r for r in leaving if self.draining(r)]
        if left:
            why = f"scale in: the drain timeout of {drain_timeout:.0f} s passed"
            logger.warning("Scaling in: %s; moving what EngineCore_DP%s run", why, left)
            await restarts.lost(left, Death(f"{why}; its requests resume on the others"))
        await self._stop(n)
        logger.info("Scaled in from %d to %d engines", old, n)

    def draining(self, rank: int) -> bool:
        client = self.client
        return client.restarts.slots[rank].state is EngineState.DRAINING and (
            client.inflight.count(rank) > 0
        )

    async def _stop(self, n: int) -> None:
        """Stop the processes of the ranks from `n` up: each that still runs is asked to stop
        (SIGUSR1: a SIGTERM alone is a death, `core/engine_stop.py`; what it still has was
        moved and aborted there), says STOPPED and exits 0."""
        client = self.client
        assert client.launcher is not None
        for rank in range(n, client.num_engines):
            client.fail_calls(rank, f"engine core {rank} was removed (POST /scale)")
        theirs = [r for r in self.releasing if r not in client.launcher.local_ranks]
        before = client.watch.expected_stops
        client.watch.expected_stops += len(theirs)
        await self.release(theirs, before)
        if client.joins is not None:
            client.joins.desk.forget(range(n, client.num_engines))
        children = client.launcher.remove_engines(n)
        self._retired.extend(children)
        # (By its sentinel: `is_alive` would reap it, which is the process monitor's job.)
        running = [child for child in children if not wait([child.sentinel], 0)]
        client.watch.expected_stops += len(running)
        signal_children(running, signal.SIGUSR1)
        await asyncio.to_thread(stop_watched, children, 30.0)
        for child in running:
            logger.info("Scaling in: %s stopped", child.describe())
        self.resize(n)
        await self._new_coordinator()
        # A STOPPED frame comes before its exit: one not read by now never comes (killed).
        client.watch.expected_stops = 0

    async def release(self, ranks: list[int], keep: int) -> None:
        """Ask these engines of other hosts to stop (`RELEASE`: they have no request left)
        and wait, at most RELEASE_S, until each has said STOPPED here (the stops still
        expected fall to `keep`: this host's, which come after)."""
        client = self.client
        if not ranks:
            return
        for rank in ranks:
            await client.release(rank)
        deadline = time.monotonic() + RELEASE_S
        while client.watch.expected_stops > keep and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if client.watch.expected_stops > keep:
            logger.warning(
                "Scaling in: EngineCore_DP%s (other hosts) did not say they stopped within "
                "%.0f s; removed all the same",
                ranks,
                RELEASE_S,
            )
        else:
            logger.info("Scaling in: EngineCore_DP%s (other hosts) released and stopped", ranks)
        for rank in ranks:  # (their connections drop next)
            client.watch.note_gone(
                f"EngineCore_DP{rank} of another host was released (POST /scale)", True
            )

    # -- both -----------------------------------------------------------------------------

    def resize(self, n: int) -> None:
        client = self.client
        watch = client.watch
        if self.remote:  # every rank but this host's is another host's, watched so
            watch.unwatched = [r for r in range(n) if r not in watch.local_ranks]
        client.num_engines = n
        client.engines.resize(n)
        client.router.resize(n)
        client.restarts.resize(n)
        client.reader.num_engines = n
        client.listener.on_resize(n)

    async def _new_coordinator(self) -> None:
        launcher, monitor = self.client.launcher, self.client.monitor
        assert launcher is not None and launcher.coordinator is not None and monitor is not None
        self._retired.append(launcher.coordinator)
        new = await asyncio.to_thread(launcher.resize_coordinator)
        monitor.add(new)
        logger.info("The DP coordinator now counts %d engines", launcher.num_engines)
