"""`HandshakeDesk`: what the front end answers on its handshake socket (no socket: the
replies wait in its outbox)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from treadle.frontend.handshake import HandshakeDesk, Hello
from treadle.ipc.engine_auth import engine_token
from treadle.wire.control import Handshake, HandshakeStatus, StartupPhase


def check_secret(rank: int, secret: bytes) -> None:
    if rank == 0 and secret != b"s0":  # rank 0 runs here; rank 1 on another host
        raise ValueError("no secret")


def desk() -> HandshakeDesk:
    addresses = Handshake("ADDRESSES", inputs=["a"], outputs=["b"])
    return HandshakeDesk(None, addresses, [b"k" * 32], [0, 0], check_secret)  # type: ignore[arg-type]


def frames(peer: bytes, status: str, rank: int, secret: bytes = b"") -> list[Any]:
    return [peer, msgspec.msgpack.encode(Handshake(status, rank=rank, secret=secret))]


def replies(d: HandshakeDesk) -> list[tuple[bytes, Handshake]]:
    return [(p, msgspec.msgpack.decode(m, type=Handshake)) for p, m in d.take()]


def test_an_expected_rank_gets_a_new_launch_and_a_second_hello_goes_to_the_caller() -> None:
    d = desk()
    d.expect([0, 1])
    assert d.on_message(frames(b"p0", "HELLO", 0, b"wrong")) is None  # dropped
    assert d.take() == []
    assert d.on_message(frames(b"p0", "HELLO", 0, b"s0")) is None
    ((peer, reply),) = replies(d)
    assert peer == b"p0" and reply.launch == 1
    assert reply.tokens == [engine_token(b"k" * 32, 0, 1)]
    assert d.on_message(frames(b"p0", "READY", 0, b"s0")) == 0
    assert d.on_message(frames(b"p1", "HELLO", 1)) is None  # taken on first use
    assert [peer for peer, _ in replies(d)] == [b"p1"]
    assert isinstance(d.on_message(frames(b"p9", "HELLO", 1)), Hello)  # a second one
    assert d.on_message(frames(b"p1", "READY", 1)) == 1
    # Later: a HELLO of a rank not expected is the caller's to greet or refuse.
    hello = d.on_message(frames(b"p2", "HELLO", 1))
    assert isinstance(hello, Hello) and hello.peer == b"p2"
    d.refuse(hello, "engine rank 1 is up")
    assert replies(d) == [(b"p2", Handshake("REFUSED", rank=1, reason="engine rank 1 is up"))]
    d.greet(hello)
    ((peer, reply),) = replies(d)
    assert peer == b"p2" and reply.launch == 2 and 1 not in d.ready
    assert d.on_message(frames(b"p2", "READY", 1)) == 1
    assert d.on_message(frames(b"p3", "READY", 5)) is None  # unknown rank: dropped
    assert d.on_message([b"p3", b"\xc1"]) is None and d.drops.dropped >= 2


def test_a_status_outside_the_enum_fails_the_decode_and_is_dropped() -> None:
    """Statuses are `HandshakeStatus` on the wire: its text, and nothing else decodes."""
    d = desk()
    d.expect([0])
    assert msgspec.msgpack.encode(HandshakeStatus.HELLO) == msgspec.msgpack.encode("HELLO")
    before = d.drops.dropped
    assert d.on_message(frames(b"p0", "HELO", 0, b"s0")) is None
    assert d.drops.dropped == before + 1 and d.take() == []
    # ADDRESSES and REFUSED go from the front end to an engine, never the other way.
    assert d.on_message(frames(b"p0", "HELLO", 0, b"s0")) is None and len(d.take()) == 1
    assert d.on_message(frames(b"p0", "ADDRESSES", 0, b"s0")) is None
    assert 0 not in d.ready


def test_phases_of_a_greeted_rank_with_its_secret_are_told_and_others_dropped() -> None:
    told: list[tuple[int, StartupPhase]] = []
    addresses = Handshake("ADDRESSES", inputs=["a"], outputs=["b"])
    d = HandshakeDesk(
        None, addresses, [b"k" * 32], [0, 0], check_secret, lambda r, p: told.append((r, p))
    )  # type: ignore[arg-type]
    d.expect([0])

    def phase(secret: bytes, value: Any = StartupPhase.LOADING_WEIGHTS) -> list[Any]:
        msg = {"status": "PHASE", "rank": 0, "secret": secret, "phase": value}
        return [b"p0", msgspec.msgpack.encode(msg)]

    assert d.on_message(phase(b"s0")) is None and told == []  # before HELLO: dropped
    assert d.on_message(frames(b"p0", "HELLO", 0, b"s0")) is None
    d.take()
    assert d.on_message(phase(b"s0")) is None
    assert d.on_message(phase(b"other")) is None  # not its secret: dropped
    assert d.on_message(phase(b"s0", "compiling the universe")) is None  # fails the decode
    assert d.on_message(phase(b"s0", "profiling the KV cache")) is None
    assert told == [(0, StartupPhase.LOADING_WEIGHTS), (0, StartupPhase.PROFILING_KV_CACHE)]
    assert d.on_message(frames(b"p0", "READY", 0, b"s0")) == 0


def test_a_hello_for_a_rank_not_ours_yet_is_held_until_a_scale_admits_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`POST /scale` with engines on other hosts: a headless engine started for rank 2 of a
    2-engine server says HELLO first; it is held (a second one for rank 2 is refused), and
    answered once the scale admits rank 2; one never admitted is refused after
    TREADLE_ENGINE_READY_TIMEOUT_S, saying why."""
    d = desk()
    hello = d.on_message(frames(b"p2", "HELLO", 2))
    assert isinstance(hello, Hello) and hello.rank == 2
    assert d.on_message(frames(b"p2", "READY", 2)) is None  # not a HELLO: dropped
    d.hold(hello)
    d.hold(Hello(b"p8", 2, b""))
    assert [(p, r.status) for p, r in replies(d)] == [(b"p8", "REFUSED")]
    d.decide_early()
    assert d.take() == []  # still waits
    d.launches.append(0)  # the scale admits rank 2 (`EngineLauncher.add_engines`)
    d.expect([2])
    d.decide_early()
    ((peer, reply),) = replies(d)
    assert peer == b"p2" and reply.status == "ADDRESSES" and reply.launch == 1
    assert d.joining(2) and d.on_message(frames(b"p2", "READY", 2)) == 2
    # Held too long: refused.
    monkeypatch.setenv("TREADLE_ENGINE_READY_TIMEOUT_S", "0")
    late = d.on_message(frames(b"p3", "HELLO", 3))
    assert isinstance(late, Hello)
    d.hold(late)
    time.sleep(0.01)
    d.decide_early()
    ((peer, reply),) = replies(d)
    assert peer == b"p3" and reply.status == "REFUSED" and "no engine rank 3" in reply.reason
    assert d.on_message(frames(b"p9", "HELLO", 64)) is None  # past MAX_ENGINES: dropped


def test_a_failed_start_up_is_kept_for_whoever_waits_and_a_new_hello_is_greeted() -> None:
    """FAILED (instead of READY) from a greeted rank with its secret: the engine's error is
    kept (`POST /scale` answers with it at once instead of waiting for the ready timeout);
    from anyone else it is dropped."""
    d = desk()
    d.expect([1])
    assert d.on_message(frames(b"p1", "HELLO", 1, b"x")) is None and len(d.take()) == 1
    stranger = [b"p9", msgspec.msgpack.encode(Handshake("FAILED", rank=1, reason="no"))]
    assert d.on_message(stranger) is None and d.failed == {}  # not its secret
    failed = Handshake("FAILED", rank=1, secret=b"x", reason="OSError: no such model")
    assert d.on_message([b"p1", msgspec.msgpack.encode(failed)]) is None
    assert d.failed == {1: "OSError: no such model"} and not d.joining(1)
    assert d.on_message(frames(b"p2", "HELLO", 1)) is None  # another try: greeted
    assert [p for p, _ in replies(d)] == [b"p2"]
    d.expect([1])
    assert d.failed == {}
