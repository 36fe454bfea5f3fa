"""The cluster secret (`ipc/cluster_auth.py`): with it every tcp socket speaks CURVE; a peer
without it, with another secret or with a leaked server key is refused and logged. Real
sockets on loopback."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from treadle.config import ParallelConfig
from treadle.ipc import cluster_auth
from treadle.ipc.shm_broadcast import MessageQueue
from treadle.ipc.shm_message import MsgpackCodec
from treadle.ipc.zmq_utils import get_bound_address, make_zmq_socket

SECRET = "s3cret-of-the-cluster-0123456789"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def refusals() -> Iterator[_Records]:
    handler = _Records()
    log = logging.getLogger("treadle.ipc.cluster_auth")
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.delenv(cluster_auth.ENV_SECRET_FILE, raising=False)
    monkeypatch.setenv(cluster_auth.ENV_SECRET, SECRET)
    return SECRET


def _wait_for(pred: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_a_peer_with_the_secret_gets_in_and_others_are_refused_and_logged(
    secret: str, refusals: _Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    other: zmq.Context[Any] = zmq.Context()
    socks: list[zmq.Socket[Any]] = []
    try:
        server = make_zmq_socket(ctx, "tcp://127.0.0.1:0", zmq.ROUTER, linger=0)
        socks.append(server)
        addr = get_bound_address(server)
        member = make_zmq_socket(ctx, addr, zmq.DEALER, bind=False, linger=0)
        socks.append(member)
        member.send(b"from a member")
        assert server.poll(10_000)
        assert server.recv_multipart()[-1] == b"from a member"

        # No CURVE at all (what vLLM's sockets accept), then another secret.
        plain = other.socket(zmq.DEALER)
        plain.linger = 0
        plain.connect(addr)
        plain.send(b"plain")
        socks.append(plain)
        monkeypatch.setenv(cluster_auth.ENV_SECRET, "another-secret-entirely-0000")
        wrong = make_zmq_socket(other, addr, zmq.DEALER, bind=False, linger=0)
        wrong.send(b"wrong secret")
        socks.append(wrong)
        # The server's public key leaked, the client key is made up: ZAP says no.
        leaked = other.socket(zmq.DEALER)
        leaked.linger = 0
        leaked.curve_serverkey = cluster_auth._keys(SECRET.encode()).server_public
        leaked.curve_publickey, leaked.curve_secretkey = zmq.curve_keypair()
        leaked.connect(addr)
        leaked.send(b"leaked key")
        socks.append(leaked)
        assert not server.poll(2_000), server.recv_multipart()
        assert _wait_for(lambda: any("Refused a peer at 127.0.0.1" in r for r in refusals.lines))
        assert any("no CURVE handshake" in r for r in refusals.lines), refusals.lines

        # The member still talks after all that.
        member.send(b"again")
        assert server.poll(10_000) and server.recv_multipart()[-1] == b"again"
    finally:
        for s in socks:
            s.close(linger=0)
        other.term()
        ctx.term()  # the ZAP thread lets the context go


def test_the_leaked_server_key_alone_is_refused_by_zap(secret: str, refusals: _Records) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    other: zmq.Context[Any] = zmq.Context()
    server = make_zmq_socket(ctx, "tcp://127.0.0.1:0", zmq.ROUTER, linger=0)
    leaked = other.socket(zmq.DEALER)
    try:
        leaked.linger = 0
        leaked.curve_serverkey = cluster_auth._keys(SECRET.encode()).server_public
        leaked.curve_publickey, leaked.curve_secretkey = zmq.curve_keypair()
        leaked.connect(get_bound_address(server))
        leaked.send(b"leaked key")
        assert not server.poll(1_500)
        assert _wait_for(lambda: any("not the cluster's" in r for r in refusals.lines))
    finally:
        leaked.close(0)
        server.close(0)
        other.term()
        ctx.term()


def test_without_a_secret_sockets_are_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cluster_auth.ENV_SECRET, raising=False)
    monkeypatch.delenv(cluster_auth.ENV_SECRET_FILE, raising=False)
    assert cluster_auth.cluster_keys() is None
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        server = make_zmq_socket(ctx, "tcp://127.0.0.1:0", zmq.ROUTER, linger=0)
        assert server.getsockopt(zmq.MECHANISM) == zmq.NULL
        plain = ctx.socket(zmq.DEALER)
        plain.linger = 0
        plain.connect(get_bound_address(server))
        plain.send(b"hi")
        assert server.poll(10_000)
        plain.close()
        server.close()
    finally:
        ctx.term()


def test_the_broadcast_queue_reaches_a_remote_reader_only_with_the_secret(
    secret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = MessageQueue(
        n_reader=1, n_local_reader=0, connect_ip="127.0.0.1", codec=MsgpackCodec()
    )
    handle = writer.export_handle()
    assert handle.remote_subscribe_addr.startswith("tcp://127.0.0.1:")
    readers: list[MessageQueue] = []

    def join() -> None:
        reader = MessageQueue.create_from_handle(handle, 0, MsgpackCodec())
        readers.append(reader)
        reader.wait_until_ready(timeout=10)

    try:
        t = threading.Thread(target=join, daemon=True)
        t.start()
        writer.wait_until_ready(timeout=10)
        t.join(10)
        writer.enqueue(("step", np.arange(4)), timeout=10)
        got = readers[0].dequeue(timeout=10)
        assert got[0] == "step" and list(got[1]) == [0, 1, 2, 3]
    finally:
        for r in readers:
            r.close()
        writer.close()

    # A reader without the secret never completes the subscription handshake.
    writer = MessageQueue(
        n_reader=1, n_local_reader=0, connect_ip="127.0.0.1", codec=MsgpackCodec()
    )
    monkeypatch.delenv(cluster_auth.ENV_SECRET)
    outsider: list[MessageQueue] = []
    t = threading.Thread(
        target=lambda: outsider.append(
            MessageQueue.create_from_handle(writer.export_handle(), 0, MsgpackCodec())
        ),
        daemon=True,
    )
    try:
        t.start()
        with pytest.raises(TimeoutError):
            writer.wait_until_ready(timeout=2)
    finally:
        writer.close()
        t.join(5)
        for r in outsider:
            r.close()


def test_keys_come_from_the_secret_and_bad_secrets_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = cluster_auth._keys(b"a" * 16), cluster_auth._keys(b"b" * 16)
    assert a == cluster_auth._keys(b"a" * 16)
    assert len({a.server_public, a.client_public, b.server_public, b.client_public}) == 4
    assert zmq.curve_public(a.server_secret) == a.server_public

    path = tmp_path / "cluster.secret"
    path.write_bytes(b"short\n")
    with pytest.raises(ValueError, match="5 bytes; use at least 16"):
        cluster_auth.read_secret_file(str(path))
    with pytest.raises(ValueError, match="No such file"):
        cluster_auth.read_secret_file(str(tmp_path / "missing"))
    path.write_bytes(SECRET.encode() + b"\n")  # the newline an editor adds is not the secret
    assert cluster_auth.read_secret_file(str(path)) == SECRET.encode()
    monkeypatch.setenv(cluster_auth.ENV_SECRET, "tiny")
    with pytest.raises(ValueError, match="TREADLE_CLUSTER_SECRET"):
        cluster_auth.cluster_keys()


def test_a_non_loopback_cross_host_setup_needs_a_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(cluster_auth.ENV_SECRET, raising=False)
    monkeypatch.delenv(cluster_auth.ENV_SECRET_FILE, raising=False)
    remote = dict(
        data_parallel_size=2,
        data_parallel_size_local=1,
        data_parallel_address="10.1.2.3",
        data_parallel_rpc_port=5555,
    )
    with pytest.raises(ValueError, match="--cluster-secret-file .*--insecure-cluster"):
        ParallelConfig(**remote).check()  # type: ignore[arg-type]
    ParallelConfig(**remote, insecure_cluster=True).check()  # type: ignore[arg-type]
    path = tmp_path / "cluster.secret"
    path.write_text(SECRET)
    ParallelConfig(**remote, cluster_secret_file=str(path)).check()  # type: ignore[arg-type]
    # Loopback "hosts" (127.0.0.2 too) and one host need nothing.
    ParallelConfig(**{**remote, "data_parallel_address": "127.0.0.2"}).check()  # type: ignore[arg-type]
    ParallelConfig(data_parallel_size=2).check()
    assert cluster_auth.is_loopback("localhost") and cluster_auth.is_loopback("::1")
    assert not cluster_auth.is_loopback("10.1.2.3")
