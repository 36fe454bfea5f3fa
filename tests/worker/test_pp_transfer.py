"""Stage to stage: hidden + residual over ZMQ ipc, out of band, and a failure passed on."""

from __future__ import annotations

import pytest
import torch

from treadle.ipc.zmq_utils import get_open_zmq_ipc_path
from treadle.worker.pp_transfer import StageLink, StageLinkError


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
