"""Pipeline stage to stage: one step's `hidden_states` and `residual` of the scheduled tokens.

Each rank of stage s PUSHes to the rank of the same TP rank in stage s + 1, which PULLs. The
executor says where each receiving rank binds (`stage_addresses`): an ipc socket (0600,
removed on close) when the sending rank runs on the same node, else `tcp://<its node's
address>:0`. The receiver binds first and publishes the address it got (the real port, read
back: never probed) in the store where the ranks met for torch.distributed; the sender reads
it there and connects (`open_stage_link`). So the executor needs no second round trip to
learn ports, and any executor whose ranks share a store (mp's file, the `StoreServer` of Ray
and `--nnodes`) links stages across hosts the same way.

A tcp stage socket is keyed as every other cross-host socket (`make_zmq_socket` ->
`cluster_auth.secure`): with a cluster secret the PULL is a CURVE server that admits only the
cluster's client key, and a peer without it is refused and logged; the executor refuses a
non-loopback layout without a secret unless `--insecure-cluster`.

A step is three frames: a fixed header (`<4sqq`: dtype code, rows, width) and the two tensors'
own memory (sent zero-copy, received into fresh writable memory: the next stage's norms add
into the residual in place). Nothing is unpickled; a message whose frames do not match its
header is an error of the step, never a crash (over tcp the peer is another host). A stage
whose step fails before it sent its output sends the failure instead (`b"FAIL"`, the text):
each later stage raises it in turn, so the last stage's reply carries the error at once
instead of the engine core waiting out its step timeout. A step larger than
TREADLE_ZMQ_MAX_MSG_BYTES, which the PULL would refuse by dropping the connection, fails in
the sender instead (and so reaches the next stage as such a failure).

Why ZMQ and not the broadcast ring: the sizes are small (rows x hidden x 4 bytes: 2.3 KB per
decode token of the default model, 4.7 MB for a 2048-token prefill chunk) and the pair is
point to point; `benchmarks/pp_bench.py --transfer` measures a round trip against the step.
"""

from __future__ import annotations

import struct
from typing import Any

import torch
import zmq
from torch.distributed import Store

from treadle.ipc.inbound import check_outbound, inbound_options
from treadle.ipc.zmq_utils import get_bound_address, make_zmq_socket

_HEADER = struct.Struct("<4sqq")
_FAIL = b"FAIL"
_FAIL_TEXT_MAX = 4096
_DTYPES = {b"f32\0": torch.float32, b"bf16": torch.bfloat16, b"f16\0": torch.float16}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}
_STORE_KEY = "treadle/pp-stage/{rank}"


class StageLinkError(RuntimeError):
    """A stage-to-stage message that does not match its header."""


class StageLink:
    """This rank's ends: a PULL bound at `recv_from` (None on the first stage; `address` is
    where it bound, the real port of a `tcp://host:0`), and a PUSH to the next stage's PULL
    (`send_to` now, or `connect` later; none on the last stage)."""

    def __init__(self, recv_from: str | None, send_to: str | None = None) -> None:
        self.ctx = zmq.Context(io_threads=1)
        self.pull: zmq.Socket[Any] | None = None
        self.push: zmq.Socket[Any] | None = None
        self.address: str | None = None
        if recv_from is not None:
            self.pull = make_zmq_socket(
                self.ctx, recv_from, zmq.PULL, bind=True, options=inbound_options()
            )
            self.address = get_bound_address(self.pull)
        if send_to is not None:
            self.connect(send_to)
        self.sent = False  # this step's output (or failure) went on: the worker resets it

    def connect(self, send_to: str) -> None:
        assert self.push is None
        self.push = make_zmq_socket(self.ctx, send_to, zmq.PUSH, bind=False, linger=0)

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        assert self.push is not None
        hidden, residual = hidden.contiguous(), residual.contiguous()
        header = _HEADER.pack(_CODES[hidden.dtype], hidden.shape[0], hidden.shape[1])
        frames: list[bytes | memoryview] = [header, _bytes_view(hidden), _bytes_view(residual)]
        check_outbound(frames, "a pipeline stage's output")
        self.push.send_multipart(frames, copy=False)
        self.sent = True

    def send_failure(self, text: str) -> None:
        """Tell the next stage that this step failed here (it raises `StageLinkError`)."""
        assert self.push is not None
        self.push.send_multipart([_FAIL, text.encode()[:_FAIL_TEXT_MAX]])
        self.sent = True

    def recv(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.pull is not None
        frames = self.pull.recv_multipart(copy=False)
        if len(frames) == 2 and frames[0].bytes == _FAIL:
            text = frames[1].buffer[:_FAIL_TEXT_MAX].tobytes()
            raise StageLinkError(text.decode(errors="replace"))
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


def open_stage_link(
    store: Store, rank: int, tp: int, pp: int, stage_addresses: list[str | None]
) -> StageLink:
    """This rank's link (its stage is rank // tp): bind where `stage_addresses[rank]` says
    (not on the first stage) and publish the bound address in `store`; then connect to the
    address that the next stage's rank of the same TP rank published (not on the last stage;
    `store.get` waits for it). Each rank publishes before it waits, so none waits for another
    that waits for it."""
    stage = rank // tp
    link = StageLink(stage_addresses[rank] if stage > 0 else None)
    try:
        if link.address is not None:
            store.set(_STORE_KEY.format(rank=rank), link.address)
        if stage < pp - 1:
            link.connect(store.get(_STORE_KEY.format(rank=rank + tp)).decode())
    except BaseException:
        link.close()
        raise
    return link


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The tensor's own memory as bytes (bfloat16 has no buffer format of its own)."""
    if not t.numel():
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
