"""Stage to stage: hidden + residual over ZMQ (ipc on one node, tcp between nodes, keyed by
the cluster secret), out of band, a failure passed on, and the ends meeting in a store."""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import zmq

from treadle.ipc import cluster_auth
from treadle.ipc.zmq_utils import get_open_zmq_ipc_path
from treadle.worker.pp_transfer import StageLink, StageLinkError, open_stage_link

SECRET = "stage-link-test-secret-0123456789"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 300])
def test_hidden_and_residual_arrive_equal_and_writable(dtype: torch.dtype, rows: int) -> None:
    address = get_open_zmq_ipc_path()
    receiver, sender = StageLink(address, None), StageLink(None, address)
    try:
        hidden, residual = torch.randn(rows, 64).to(dtype), torch.randn(rows, 64).to(dtype)
        sender.send(hidden, residual.t().contiguous().t())  # a strided one goes contiguous
        got_hidden, got_residual = receiver.recv()
        assert torch.equal(got_hidden, hidden) and torch.equal(got_residual, residual)
        assert got_residual.dtype == dtype and got_residual.shape == (rows, 64)
        got_residual.add_(1)  # the next stage's norms add into it in place
        assert sender.sent
    finally:
        sender.close()
        receiver.close()


def test_a_failed_stage_makes_the_next_one_raise_its_error() -> None:
    address = get_open_zmq_ipc_path()
    receiver, sender = StageLink(address, None), StageLink(None, address)
    try:
        sender.send_failure("pipeline stage 0 failed: IndexError: list index out of range")
        with pytest.raises(StageLinkError, match="stage 0 failed: IndexError"):
            receiver.recv()
        sender.push.send_multipart([b"nonsense"])  # type: ignore[union-attr]
        with pytest.raises(StageLinkError, match="1 frames, not 3"):
            receiver.recv()
    finally:
        sender.close()
        receiver.close()


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


def _no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cluster_auth.ENV_SECRET, raising=False)
    monkeypatch.delenv(cluster_auth.ENV_SECRET_FILE, raising=False)


def _tcp_pair() -> tuple[StageLink, StageLink]:
    receiver = StageLink("tcp://127.0.0.1:0")
    assert receiver.address is not None and receiver.address.startswith("tcp://127.0.0.1:")
    assert not receiver.address.endswith(":0")  # the real port, read back
    return receiver, StageLink(None, receiver.address)


@pytest.mark.parametrize("keyed", [False, True], ids=["no-secret", "secret"])
def test_a_tcp_link_carries_a_step_with_or_without_the_secret(
    keyed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_secret(monkeypatch)
    if keyed:
        monkeypatch.setenv(cluster_auth.ENV_SECRET, SECRET)
    receiver, sender = _tcp_pair()
    try:
        assert receiver.pull is not None
        mechanism = receiver.pull.getsockopt(zmq.MECHANISM)
        assert mechanism == (zmq.CURVE if keyed else zmq.NULL)
        hidden, residual = torch.randn(7, 64), torch.randn(7, 64)
        sender.send(hidden, residual)
        assert receiver.pull.poll(10_000)
        got_hidden, got_residual = receiver.recv()
        assert torch.equal(got_hidden, hidden) and torch.equal(got_residual, residual)
    finally:
        sender.close()
        receiver.close()


def test_a_peer_without_the_secret_is_refused_and_logged(
    monkeypatch: pytest.MonkeyPatch, refusals: _Records
) -> None:
    """A keyed PULL takes nothing from a sender with no CURVE or another secret; a member's
    message whose frames do not match its header is an error of the step, not a tensor."""
    _no_secret(monkeypatch)
    monkeypatch.setenv(cluster_auth.ENV_SECRET, SECRET)
    receiver = StageLink("tcp://127.0.0.1:0")
    assert receiver.address is not None and receiver.pull is not None
    senders = []
    try:
        monkeypatch.delenv(cluster_auth.ENV_SECRET)
        senders.append(StageLink(None, receiver.address))  # plain tcp
        monkeypatch.setenv(cluster_auth.ENV_SECRET, "another-secret-entirely-0000")
        senders.append(StageLink(None, receiver.address))
        for sender in senders:
            sender.send(torch.zeros(1, 8), torch.zeros(1, 8))
        assert not receiver.pull.poll(2_000)
        deadline = time.monotonic() + 10
        while not any("Refused a peer at 127.0.0.1" in r for r in refusals.lines):
            assert time.monotonic() < deadline, refusals.lines
            time.sleep(0.05)

        monkeypatch.setenv(cluster_auth.ENV_SECRET, SECRET)
        member = StageLink(None, receiver.address)
        senders.append(member)
        assert member.push is not None
        lying = struct.pack("<4sqq", b"f32\0", 1 << 40, 1 << 20)  # claims 4 PiB
        member.push.send_multipart([lying, b"x" * 16, b"x" * 16])
        assert receiver.pull.poll(10_000)
        with pytest.raises(StageLinkError, match="16 bytes for"):
            receiver.recv()
        member.push.send_multipart([b"FAIL", b"y" * 10_000])
        with pytest.raises(StageLinkError) as failed:
            receiver.recv()
        assert len(str(failed.value)) == 4096  # a peer's text is cut, as the sender cuts it
    finally:
        for sender in senders:
            sender.close()
        receiver.close()


def test_the_ends_meet_in_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """-tp 2 -pp 2: each rank of stage 1 binds where the executor says (port 0 over tcp) and
    publishes the address it got; stage 0's rank of the same TP rank reads it and connects."""
    _no_secret(monkeypatch)
    store: Any = dist.HashStore()
    addresses = [None, None, "tcp://127.0.0.1:0", get_open_zmq_ipc_path()]
    links = [open_stage_link(store, r, 2, 2, addresses) for r in (2, 3, 0, 1)]
    try:
        receivers, senders = links[:2], links[2:]
        assert all(link.push is None for link in receivers)
        assert all(link.pull is None and link.address is None for link in senders)
        for receiver, sender, rows in zip(receivers, senders, (3, 5), strict=True):
            sender.send(torch.full((rows, 4), float(rows)), torch.zeros(rows, 4))
            assert receiver.pull is not None and receiver.pull.poll(10_000)
            assert receiver.recv()[0].shape == (rows, 4)
        tcp = store.get("treadle/pp-stage/2").decode()
        assert tcp.startswith("tcp://127.0.0.1:") and not tcp.endswith(":0")
        assert store.get("treadle/pp-stage/3").decode() == addresses[3]
    finally:
        for link in links:
            link.close()
