"""The DP coordinator's state machine over real zmq sockets: stats snapshots for the front
ends, and waves (START_DP_WAVE to the other engines; complete once every engine is idle)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq

from treadle.core.dp_coordinator import DPCoordinator
from treadle.wire.engine import DPStats, EngineCoreOutputs, SchedulerStats, StartDPWave


class Harness:
    def __init__(self, coordinator: DPCoordinator, ctx: zmq.Context[Any]) -> None:
        self.c = coordinator
        a = coordinator.addresses
        self.push = ctx.socket(zmq.PUSH)
        self.push.connect(a.engine_stats)
        self.front = ctx.socket(zmq.SUB)
        self.front.setsockopt(zmq.SUBSCRIBE, b"")
        self.front.connect(a.front_publish)
        self.engines = ctx.socket(zmq.SUB)
        self.engines.setsockopt(zmq.SUBSCRIBE, b"")
        self.engines.connect(a.engine_publish)
        # Both subscriptions have reached the coordinator once the front end gets a snapshot.
        self.first = self.front_message(timeout=5.0)

    def send(self, engine: int, **fields: Any) -> None:
        self.push.send(msgspec.msgpack.encode(EngineCoreOutputs(engine, **fields)))
        deadline = time.monotonic() + 2
        while self.push.poll(0, zmq.POLLOUT) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(5):
            self.c.poll_once(20)

    def front_message(self, timeout: float = 1.0) -> DPStats | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.c.poll_once(20)
            if self.front.poll(0):
                last = None
                while self.front.poll(0):
                    last = msgspec.msgpack.decode(self.front.recv(), type=DPStats)
                return last
        return None

    def front_until(self, want: Callable[[DPStats], bool], timeout: float = 10.0) -> DPStats:
        """The snapshots until one `want`s (the last one after `timeout`): on a busy machine
        the engine's message may reach the coordinator after a snapshot or two."""
        deadline = time.monotonic() + timeout
        state = self.front_message()
        while (state is None or not want(state)) and time.monotonic() < deadline:
            state = self.front_message() or state
        assert state is not None, "no snapshot reached the front end"
        return state

    def wave_messages(self) -> list[StartDPWave]:
        time.sleep(0.05)
        out = []
        while self.engines.poll(0):
            out.append(msgspec.msgpack.decode(self.engines.recv(), type=StartDPWave))
        return out


@pytest.fixture
def harness() -> Iterator[Harness]:
    coordinator = DPCoordinator(num_engines=2, engine_host=None)
    ctx: zmq.Context[Any] = zmq.Context()
    h = Harness(coordinator, ctx)
    yield h
    for sock in (h.push, h.front, h.engines):
        sock.close(linger=0)
    ctx.term()
    h.c.close()


def test_a_new_front_end_gets_the_state_at_once(harness: Harness) -> None:
    assert harness.first == DPStats([[0, 0, 0.0], [0, 0, 0.0]], wave=0, wave_running=False)


def test_stats_reach_the_front_ends(harness: Harness) -> None:
    harness.send(1, scheduler_stats=SchedulerStats(num_running_reqs=3, num_waiting_reqs=2))
    state = harness.front_until(lambda s: s.engines[1][:2] == [2, 3])
    assert state.engines[1][:2] == [2, 3] and state.engines[0][:2] == [0, 0]


def test_a_wave_starts_once_and_completes_when_every_engine_is_idle(harness: Harness) -> None:
    harness.wave_messages()
    harness.send(0, start_wave=0)
    assert harness.wave_messages() == [StartDPWave(wave=0, exclude=0)]
    state = harness.front_until(lambda s: s.wave_running)
    assert state.wave_running and state.wave == 0

    harness.send(1, start_wave=0)  # a second engine joins: no second broadcast
    assert harness.wave_messages() == []
    harness.send(0, wave_complete=0)  # engine 1 still busy: the wave goes on
    assert harness.c.wave_running and harness.c.wave == 0
    harness.send(1, wave_complete=0)
    assert not harness.c.wave_running and harness.c.wave == 1
    state = harness.front_until(lambda s: not s.wave_running)
    assert not state.wave_running and state.wave == 1

    harness.send(1, start_wave=1)  # the next request starts wave 1
    assert harness.wave_messages() == [StartDPWave(wave=1, exclude=1)]


def test_malformed_and_unknown_engine_messages_are_dropped(harness: Harness) -> None:
    harness.push.send(b"\xc1 not msgpack")
    harness.send(7, start_wave=0)
    for _ in range(5):
        harness.c.poll_once(20)
    assert not harness.c.wave_running
    harness.send(0, start_wave=0)
    assert harness.c.wave_running


def test_a_restarted_coordinator_binds_the_same_addresses_and_catches_up_on_the_wave(
    harness: Harness,
) -> None:
    """What `EngineLauncher.restart_coordinator` relies on: the engines' and front ends'
    sockets reconnect to a new coordinator on the old addresses, which learns the wave the
    engines are in from their next `start_wave`."""
    addresses = harness.c.addresses
    harness.c.close()  # (the dead one's ipc files are gone or stale: both bind again)
    harness.c = DPCoordinator(num_engines=2, engine_host=None, addresses=addresses)
    assert harness.c.addresses == addresses
    assert harness.front_message(timeout=5.0) is not None  # the front end reconnected
    harness.send(1, start_wave=7)  # the engines are in wave 7; the new one knew 0
    assert harness.c.wave == 7 and harness.c.wave_running  # (an engine's PUSH reconnected)
