"""treadle.ipc.zmq_utils: sockets, addresses, identities, request type bytes."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from treadle.ipc.serial import MsgpackDecoder, MsgpackEncoder
from treadle.ipc.zmq_utils import (
    EngineCoreRequestType,
    get_bound_address,
    get_ip,
    get_open_zmq_ipc_path,
    get_tcp_uri,
    ipc_listening,
    make_zmq_socket,
    remove_ipc_files,
    split_zmq_path,
    zmq_socket_ctx,
)
from treadle.sampling_params import SamplingParams
from treadle.wire.engine import EngineCoreRequest

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_request_type_bytes() -> None:
    assert EngineCoreRequestType.ADD.value == b"\x00"
    assert EngineCoreRequestType.ABORT.value == b"\x01"
    assert EngineCoreRequestType.START_DP_WAVE.value == b"\x02"
    assert EngineCoreRequestType.UTILITY.value == b"\x03"


def test_ipc_path_uses_the_base_path(rpc_dir: Path) -> None:
    path = get_open_zmq_ipc_path()
    assert path.startswith(f"ipc://{rpc_dir}/") and len(path) == len(f"ipc://{rpc_dir}/") + 36
    assert get_open_zmq_ipc_path() != path


def test_ipc_path_too_long(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_RPC_BASE_PATH", "/tmp/" + "x" * 100)
    with pytest.raises(ValueError, match="TREADLE_RPC_BASE_PATH"):
        get_open_zmq_ipc_path()


def test_socket_options_by_type(ctx: zmq.Context[Any]) -> None:
    for socket_type in (zmq.ROUTER, zmq.DEALER, zmq.PUSH, zmq.PULL):
        sock = make_zmq_socket(ctx, get_open_zmq_ipc_path(), socket_type, bind=True)
        assert sock.getsockopt(zmq.SNDHWM) == 0 and sock.getsockopt(zmq.RCVHWM) == 0
        sock.close()
    sock = make_zmq_socket(ctx, get_open_zmq_ipc_path(), zmq.PUB, linger=123)
    assert sock.getsockopt(zmq.SNDHWM) == 1000 and sock.getsockopt(zmq.LINGER) == 123
    sock.close()


def test_bind_by_default_except_push_sub_xsub(ctx: zmq.Context[Any], rpc_dir: Path) -> None:
    path = get_open_zmq_ipc_path()
    for socket_type in (zmq.PUSH, zmq.SUB, zmq.XSUB):
        sock = make_zmq_socket(ctx, path, socket_type)  # connects: makes no socket file
        assert not list(rpc_dir.iterdir())
        sock.close()
    sock = make_zmq_socket(ctx, path, zmq.PULL)  # binds
    assert [p.name for p in rpc_dir.iterdir()] == [path.rsplit("/", 1)[1]]
    sock.close()


def test_ipc_socket_file_is_private_and_removed_at_close(ctx: zmq.Context[Any]) -> None:
    path = get_open_zmq_ipc_path()
    pull = make_zmq_socket(ctx, path, zmq.PULL)
    file = split_zmq_path(path)[1]
    assert stat.S_IMODE(os.stat(file).st_mode) == 0o600
    push = make_zmq_socket(ctx, path, zmq.PUSH)
    push.send(b"hi")
    assert pull.recv() == b"hi"
    push.close()
    pull.close()
    assert not os.path.exists(file)


def test_tcp_port_zero_reads_back_the_real_port(ctx: zmq.Context[Any]) -> None:
    pull = make_zmq_socket(ctx, get_tcp_uri("127.0.0.1", 0), zmq.PULL)
    addr = get_bound_address(pull)
    scheme, host, port = split_zmq_path(addr)
    assert (scheme, host) == ("tcp", "127.0.0.1") and int(port) > 0
    push = make_zmq_socket(ctx, addr, zmq.PUSH)
    push.send(b"over tcp")
    assert pull.recv() == b"over tcp"
    push.close()
    pull.close()


def test_address_helpers() -> None:
    assert get_tcp_uri("10.0.0.1", 5555) == "tcp://10.0.0.1:5555"
    assert get_tcp_uri("::1", 5555) == "tcp://[::1]:5555"
    assert split_zmq_path("tcp://[::1]:5555") == ("tcp", "::1", "5555")
    assert split_zmq_path("ipc:///tmp/x") == ("ipc", "/tmp/x", "")
    with pytest.raises(ValueError):
        split_zmq_path("nonsense")


def test_xpub_is_verbose(ctx: zmq.Context[Any]) -> None:
    path = get_open_zmq_ipc_path()
    pub = make_zmq_socket(ctx, path, zmq.XPUB)
    subs = []
    for _ in range(2):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(path)
        subs.append(sub)
    # Verbose: each (identical) subscription is passed up, not only the first.
    assert pub.poll(5000) and pub.recv() == b"\x01"
    assert pub.poll(5000) and pub.recv() == b"\x01"
    for sub in subs:
        sub.close(0)
    pub.close()


def test_router_dealer_request_with_identity(ctx: zmq.Context[Any]) -> None:
    path = get_open_zmq_ipc_path()
    router = make_zmq_socket(ctx, path, zmq.ROUTER)
    dealer = make_zmq_socket(ctx, path, zmq.DEALER, bind=False, identity=b"\x01\x00")
    dealer.send(b"READY")  # registers the identity with the ROUTER
    identity, msg = router.recv_multipart()
    assert identity == b"\x01\x00" and msg == b"READY"
    req = EngineCoreRequest("r1", [1, 2, 3], SamplingParams())
    frames = MsgpackEncoder().encode(req)
    router.send_multipart([identity, EngineCoreRequestType.ADD.value, *frames], copy=False)
    type_frame, *data = dealer.recv_multipart(copy=False)
    assert EngineCoreRequestType(type_frame.bytes) is EngineCoreRequestType.ADD
    assert MsgpackDecoder(EngineCoreRequest).decode(data) == req
    dealer.close()
    router.close()


def test_zmq_socket_ctx_closes_and_cleans_up(rpc_dir: Path) -> None:
    path = get_open_zmq_ipc_path()
    with zmq_socket_ctx(path, zmq.PULL) as sock:
        assert sock.socket_type == zmq.PULL
        assert list(rpc_dir.iterdir())
    assert not list(rpc_dir.iterdir())


def test_host_ip_is_the_source_of_tcp_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """TREADLE_HOST_IP: a second "host" of one machine talks from its own loopback address."""
    monkeypatch.setenv("TREADLE_HOST_IP", "127.0.0.2")
    assert get_ip() == "127.0.0.2"
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        server = make_zmq_socket(ctx, "tcp://127.0.0.1:0", zmq.ROUTER, linger=0)
        client = make_zmq_socket(ctx, get_bound_address(server), zmq.DEALER, bind=False, linger=0)
        client.send(b"hi")
        assert server.poll(10_000) and server.recv_multipart()[-1] == b"hi"
        peers = [c for c in psutil.Process().net_connections("tcp") if c.raddr]
        port = int(get_bound_address(server).rsplit(":", 1)[1])
        assert [c.laddr.ip for c in peers if c.raddr.port == port] == ["127.0.0.2"]
        client.close()
        server.close()
    finally:
        ctx.term()
    monkeypatch.setenv("TREADLE_HOST_IP", "host-b")
    with pytest.raises(ValueError, match="TREADLE_HOST_IP='host-b': give this host's IP"):
        get_ip()


def test_ipc_listening_says_whether_a_front_end_still_listens() -> None:
    """What the engine core's log line of a dropped front end rests on (issue 42 item 9): a
    front end that stopped or died does not listen; one that dropped a peer still does."""
    ctx: zmq.Context[Any] = zmq.Context()
    address = get_open_zmq_ipc_path()
    try:
        sock = make_zmq_socket(ctx, address, zmq.ROUTER, linger=0)
        assert ipc_listening(address)
        sock.close(linger=0)
        time.sleep(0.1)
        assert not ipc_listening(address)
        assert not ipc_listening("ipc:///nowhere/at-all")
    finally:
        ctx.term()
        remove_ipc_files([address])
