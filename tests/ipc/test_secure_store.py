"""The rendezvous store behind the cluster secret (`ipc/secure_store.py`): TCPStore's
semantics over a ZMQ ROUTER, CURVE-keyed with the secret; a peer without it gets nothing and is
logged; a bad request never stops the server. Real sockets on loopback."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import msgspec
import pytest
import zmq

from treadle.ipc import cluster_auth, secure_store
from treadle.ipc.secure_store import DistStoreError, SecureStore, StoreServer

SECRET = "s3cret-of-the-store-0123456789ab"


@pytest.fixture
def server() -> Iterator[StoreServer]:
    srv = StoreServer("127.0.0.1", 0)
    yield srv
    srv.close()


def _client(srv: StoreServer, reply_s: float = 5.0) -> SecureStore:
    return SecureStore("127.0.0.1", srv.port, timeout=timedelta(seconds=5), reply_s=reply_s)


def test_tcpstore_semantics(server: StoreServer) -> None:
    store = _client(server)
    store.set("a", b"\x00\x01")
    store.set("s", "text")  # str is stored as its UTF-8
    assert store.get("a") == b"\x00\x01" and store.get("s") == b"text"
    assert store.add("n", 2) == 2 and store.add("n", -5) == -3 and store.get("n") == b"-3"
    assert store.check(["a", "n"]) and not store.check(["a", "missing"])
    assert store.compare_set("c", "", "first") == b"first"  # absent + expected "" -> set
    assert store.compare_set("c", "wrong", "second") == b"first"  # no change, current back
    assert store.compare_set("c", "first", "second") == b"second"
    assert store.num_keys() == 4
    assert store.delete_key("c") and not store.delete_key("c")
    with pytest.raises(DistStoreError, match="does not hold a number"):
        store.add("a", 1)
    store.close()


def test_get_and_wait_block_until_another_thread_sets(server: StoreServer) -> None:
    store = _client(server)
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(store.get("later")))
    waiter.start()
    time.sleep(0.3)
    assert not got
    _client(server).set("later", b"now")
    waiter.join(5)
    assert got == [b"now"]
    store.wait(["later"], timedelta(seconds=1))
    started = time.monotonic()
    with pytest.raises(DistStoreError, match="timed out waiting for never"):
        store.wait(["never"], timedelta(seconds=0.3))
    assert time.monotonic() - started < 3


def test_a_bad_request_is_answered_or_dropped_and_the_server_goes_on(server: StoreServer) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        for junk in (b"", b"\xc1", b"\x93\x01\x02\x03", msgspec.msgpack.encode([1, "get"])):
            sock.send(junk)  # no id to answer: dropped
        sock.send(msgspec.msgpack.encode([7, "rm -rf", "k", None, 0.0]))
        assert msgspec.msgpack.decode(sock.recv()) == [7, False, "unknown store operation 'rm -rf'"]
        sock.send(msgspec.msgpack.encode([8, "set", "k" * 2000, b"v", 0.0]))
        assert msgspec.msgpack.decode(sock.recv())[1] is False
        sock.send(msgspec.msgpack.encode([9, "get", "k", None, -1.0]))
        assert "a wait of -1.0 s" in msgspec.msgpack.decode(sock.recv())[2]
    finally:
        sock.close()
        ctx.term()
    store = _client(server)
    store.set("still", b"here")
    assert store.get("still") == b"here"


def test_blocking_calls_waiting_at_once_are_bounded(
    server: StoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(secure_store, "MAX_PARKED", 3)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        for rid in range(4):
            sock.send(msgspec.msgpack.encode([rid, "get", f"never{rid}", None, 30.0]))
        assert msgspec.msgpack.decode(sock.recv()) == [3, False, "3 calls wait already"]
    finally:
        sock.close()
        ctx.term()


def test_a_call_nobody_answers_fails_instead_of_hanging() -> None:
    srv = StoreServer("127.0.0.1", 0)
    store = _client(srv, reply_s=0.5)
    store.set("k", b"v")
    srv.close()
    started = time.monotonic()
    with pytest.raises(DistStoreError, match="did not answer add"):
        store.add("k2", 1)
    assert time.monotonic() - started < 3


def test_with_the_secret_a_peer_without_it_gets_nothing_and_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(cluster_auth.ENV_SECRET_FILE, raising=False)
    monkeypatch.setenv(cluster_auth.ENV_SECRET, SECRET)
    srv = StoreServer("127.0.0.1", 0)
    try:
        member = _client(srv)
        member.set("plan", b"sealed")
        assert member.get("plan") == b"sealed"
        monkeypatch.delenv(cluster_auth.ENV_SECRET)
        caplog.set_level(logging.WARNING, logger="treadle.ipc.cluster_auth")
        outsider = _client(srv, reply_s=1.0)
        with pytest.raises(DistStoreError, match="did not answer"):
            outsider.set("plan", b"forged")
        monkeypatch.setenv(cluster_auth.ENV_SECRET, "another-secret-0123456789abcdef")
        with pytest.raises(DistStoreError, match="did not answer"):
            _client(srv, reply_s=1.0).get("plan")
        monkeypatch.setenv(cluster_auth.ENV_SECRET, SECRET)
        assert member.get("plan") == b"sealed"  # untouched
        deadline = time.monotonic() + 5
        while "Refused a peer" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "Refused a peer" in caplog.text
    finally:
        srv.close()
