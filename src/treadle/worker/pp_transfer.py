"""Pipeline stage to stage: one step's `hidden_states` and `residual` of the scheduled tokens.

Each rank of stage s PUSHes to the rank of the same TP rank in stage s + 1, which PULLs on its
own ipc socket (0600, removed on close; the executor names the addresses). A step is three
frames: a fixed header (`<4sqq`: dtype code, rows, width) and the two tensors' own memory
(sent zero-copy, received into fresh writable memory: the next stage's norms add into the
residual in place). Nothing is pickled; a message whose frames do not match its header is an
error of the step (the peer is our own process, so it means a bug, not an attack). A stage
whose step fails before it sent its output sends the failure instead (`b"FAIL"`, the text):
each later stage raises it in turn, so the last stage's reply carries the error at once
instead of the engine core waiting out its step timeout.

Why ZMQ and not the broadcast ring: the sizes are small (rows x hidden x 4 bytes: 2.3 KB per
decode token of the default model, 4.7 MB for a 2048-token prefill chunk) and the pair is
point to point; `benchmarks/pp_bench.py --transfer` measures a round trip against the step.
"""

from __future__ import annotations

import struct
from typing import Any

import torch
import zmq

from treadle.ipc.inbound import inbound_options
from treadle.ipc.zmq_utils import make_zmq_socket

_HEADER = struct.Struct("<4sqq")
_FAIL = b"FAIL"
_DTYPES = {b"f32\0": torch.float32, b"bf16": torch.bfloat16, b"f16\0": torch.float16}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}


class StageLinkError(RuntimeError):
    """A stage-to-stage message that does not match its header."""


class StageLink:
    """This rank's ends: `recv_from` (its own PULL address; None on the first stage) and
    `send_to` (the next stage's PULL address; None on the last stage)."""

    def __init__(self, recv_from: str | None, send_to: str | None) -> None:
        self.ctx = zmq.Context(io_threads=1)
        self.pull: zmq.Socket[Any] | None = None
        self.push: zmq.Socket[Any] | None = None
        if recv_from is not None:
            self.pull = make_zmq_socket(
                self.ctx, recv_from, zmq.PULL, bind=True, options=inbound_options()
            )
        if send_to is not None:
            self.push = make_zmq_socket(self.ctx, send_to, zmq.PUSH, bind=False, linger=0)
        self.sent = False  # this step's output (or failure) went on: the worker resets it

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        assert self.push is not None
        hidden, residual = hidden.contiguous(), residual.contiguous()
        header = _HEADER.pack(_CODES[hidden.dtype], hidden.shape[0], hidden.shape[1])
        frames: list[bytes | memoryview] = [header, _bytes_view(hidden), _bytes_view(residual)]
        self.push.send_multipart(frames, copy=False)
        self.sent = True

    def send_failure(self, text: str) -> None:
        """Tell the next stage that this step failed here (it raises `StageLinkError`)."""
        assert self.push is not None
        self.push.send_multipart([_FAIL, text.encode()[:4096]])
        self.sent = True

    def recv(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.pull is not None
        frames = self.pull.recv_multipart(copy=False)
        if len(frames) == 2 and frames[0].bytes == _FAIL:
            raise StageLinkError(frames[1].bytes.decode(errors="replace"))
        if len(frames) != 3 or len(frames[0].buffer) != _HEADER.size:
            raise StageLinkError(f"a stage message of {len(frames)} frames, not 3")
        code, rows, width = _HEADER.unpack(frames[0].buffer)
        dtype = _DTYPES.get(code)
        if dtype is None or rows < 0 or width < 1:
            raise StageLinkError(f"a stage message with header {(code, rows, width)}")
        nbytes = rows * width * dtype.itemsize
        out = []
        for frame in frames[1:]:
            if len(frame.buffer) != nbytes:
                raise StageLinkError(
                    f"a stage tensor of {len(frame.buffer)} bytes for [{rows}, {width}] {dtype}"
                )
            if not nbytes:
                out.append(torch.empty(0, width, dtype=dtype))
                continue
            memory = bytearray(frame.buffer)  # writable: norms add into the residual in place
            out.append(torch.frombuffer(memory, dtype=dtype).view(rows, width))
        return out[0], out[1]

    def close(self) -> None:
        for sock in (self.pull, self.push):
            if sock is not None:
                sock.close(linger=0)
        self.ctx.term()


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The tensor's own memory as bytes (bfloat16 has no buffer format of its own)."""
    if not t.numel():
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
