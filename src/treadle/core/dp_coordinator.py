"""The DP coordinator process (only when `--data-parallel-size` > 1; ARCHITECTURE §2, §8).

    engines --PUSH--> [PULL]  coordinator  [XPUB] --> front ends (SUB): DPStats
                                           [XPUB] --> engines (XSUB): StartDPWave

It keeps each engine's `[waiting, running, kv_usage]`, from the stats the engines push, and
publishes them to the front ends every 100 ms while they change and every few seconds
otherwise (and at once to a new subscriber), for load balancing.

Waves: the coordinator owns the wave number. An engine that goes from idle to busy pushes
`start_wave`; if no wave runs, the coordinator starts one and broadcasts START_DP_WAVE to the
other engines. An engine that goes idle pushes `wave_complete`; when every engine is idle the
wave is complete and the number moves on. Wave changes are published to the front ends at
once (they stamp `current_wave` on requests). Events of one engine arrive in order (one PUSH
socket), so the set of busy engines is exact.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import msgspec
import zmq

from treadle.ipc.inbound import DropLog, inbound_options
from treadle.ipc.process import ReadyPipe
from treadle.ipc.zmq_utils import (
    get_bound_address,
    get_open_zmq_ipc_path,
    get_tcp_uri,
    make_zmq_socket,
)
from treadle.logger import init_logger
from treadle.wire.control import CoordinatorAddresses
from treadle.wire.engine import DPStats, EngineCoreOutputs, StartDPWave

logger = init_logger(__name__)

PUBLISH_INTERVAL_S = 0.1
IDLE_PUBLISH_INTERVAL_S = 3.0


def run_dp_coordinator(
    ready: ReadyPipe,
    num_engines: int,
    engine_host: str | None,
    addresses: CoordinatorAddresses | None = None,
) -> None:
    """Process entry. Engine-side sockets are tcp on `engine_host` when some engine runs on
    another host, ipc otherwise. A restarted coordinator gets its predecessor's `addresses`
    and binds them again: engines and front ends reconnect on their own."""
    stop = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    coordinator = DPCoordinator(num_engines, engine_host, addresses)
    try:
        ready.send_ready(msgspec.msgpack.encode(coordinator.addresses))
        while not stop:
            coordinator.poll_once(timeout_ms=100)
    finally:
        coordinator.close()


class DPCoordinator:
    def __init__(
        self,
        num_engines: int,
        engine_host: str | None,
        addresses: CoordinatorAddresses | None = None,
    ) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()

        def engine_side() -> str:
            return get_tcp_uri(engine_host, 0) if engine_host else get_open_zmq_ipc_path()

        if addresses is None:
            addresses = CoordinatorAddresses(get_open_zmq_ipc_path(), engine_side(), engine_side())
        limits = inbound_options()  # every socket here hears from other processes
        self.front_pub = make_zmq_socket(
            self.ctx, addresses.front_publish, zmq.XPUB, linger=0, options=limits
        )
        self.stats_in = make_zmq_socket(
            self.ctx, addresses.engine_stats, zmq.PULL, linger=0, options=limits
        )
        self.engine_pub = make_zmq_socket(
            self.ctx, addresses.engine_publish, zmq.XPUB, linger=0, options=limits
        )
        self.drops = DropLog(logger)
        self.addresses = CoordinatorAddresses(
            *(get_bound_address(s) for s in (self.front_pub, self.stats_in, self.engine_pub))
        )
        self.decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.stats: list[list[float]] = [[0, 0, 0.0] for _ in range(num_engines)]
        self.busy: set[int] = set()
        self.wave = 0
        self.wave_running = False
        self.changed = True
        self.last_publish = 0.0
        self.poller = zmq.Poller()
        for sock in (self.front_pub, self.stats_in, self.engine_pub):
            self.poller.register(sock, zmq.POLLIN)

    def poll_once(self, timeout_ms: int) -> None:
        for sock, _ in self.poller.poll(timeout_ms):
            if sock is self.stats_in:
                self._on_engine_message(self.stats_in.recv())
            elif sock is self.front_pub:
                if self.front_pub.recv()[:1] == b"\x01":  # a new subscriber: send it the state
                    self.changed = True
                    self.last_publish = 0.0
            else:
                self.engine_pub.recv()  # engines' subscriptions: nothing to do
        now = time.monotonic()
        since = now - self.last_publish
        if (self.changed and since >= PUBLISH_INTERVAL_S) or since >= IDLE_PUBLISH_INTERVAL_S:
            self._publish(now)

    def _on_engine_message(self, payload: bytes) -> None:
        try:
            msg = self.decoder.decode(payload)
        except msgspec.DecodeError as e:
            self.drops.drop("Dropped a malformed engine message: %s", e)
            return
        engine = msg.engine_index
        if not 0 <= engine < len(self.stats):
            self.drops.drop("Dropped a message from unknown engine %d", engine)
            return
        if msg.scheduler_stats is not None:
            s = msg.scheduler_stats
            new = [s.num_waiting_reqs, s.num_running_reqs, s.kv_cache_usage]
            if new != self.stats[engine]:
                self.stats[engine] = new
                self.changed = True
        if msg.start_wave is not None:
            if msg.start_wave > self.wave:  # (a restarted coordinator catches up)
                self.wave = msg.start_wave
            self.busy.add(engine)
            if not self.wave_running:
                self.wave_running = True
                logger.debug("DP wave %d started by engine %d", self.wave, engine)
                self.engine_pub.send(msgspec.msgpack.encode(StartDPWave(self.wave, engine)))
                self._publish(time.monotonic())
        if msg.wave_complete is not None:
            self.busy.discard(engine)
            if self.wave_running and not self.busy:
                logger.debug("DP wave %d complete: every engine is idle", self.wave)
                self.wave_running = False
                self.wave += 1
                self._publish(time.monotonic())

    def _publish(self, now: float) -> None:
        state = DPStats(self.stats, self.wave, self.wave_running)
        self.front_pub.send(msgspec.msgpack.encode(state))
        self.changed = False
        self.last_publish = now

    def close(self) -> None:
        for sock in (self.front_pub, self.stats_in, self.engine_pub):
            sock.close(linger=0)
        self.ctx.term()
