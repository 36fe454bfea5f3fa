"""The engine core's input thread with the tensor ring (`--tensor-ipc shm`): a request's tensor
read from its front end's ring is the tensor sent; a handle it cannot read (the ring gone,
another deployment's ring) refuses that request, and the thread goes on."""

from __future__ import annotations

import queue
import uuid
from typing import Any

import torch
import zmq

from treadle.core.engine_core_io import InputItem, InputReader
from treadle.ipc.serial import MsgpackEncoder
from treadle.ipc.tensor_ring import TensorRingWriter, ring_name
from treadle.sampling_params import SamplingParams
from treadle.wire.engine import EngineCoreRequest, EngineCoreRequestType


def _reader(address: str) -> tuple[InputReader, queue.Queue[InputItem]]:
    inputs: queue.Queue[InputItem] = queue.Queue()
    reader = InputReader(
        None,  # type: ignore[arg-type]  # (no sockets: messages are handed in)
        [address],
        "",
        [b""],
        inputs,
        queue.Queue(),
        lambda reason: None,
    )
    return reader, inputs


def _add_frames(encoder: MsgpackEncoder, tensor: torch.Tensor) -> list[Any]:
    req = EngineCoreRequest(
        request_id="r1",
        prompt_token_ids=[0] * 3,
        sampling_params=SamplingParams(),
        arrival_time=0.0,
        prompt_embeds=tensor,
    )
    frames = [EngineCoreRequestType.ADD.value, *encoder.encode(req)]
    return [zmq.Frame(bytes(f)) for f in frames]


def test_ring_tensors_arrive_and_unreadable_handles_refuse_the_request() -> None:
    address = f"ipc:///tmp/{uuid.uuid4()}"
    image = torch.randn(3, 336, 336).to(torch.float16)
    reader, inputs = _reader(address)
    ring = TensorRingWriter(ring_name(address), 4 << 20)
    encoder = MsgpackEncoder(tensor_ring=ring)
    try:
        frames = _add_frames(encoder, image)
        assert len(frames) == 2 and len(frames[1].bytes) < 1024
        reader._on_request(frames)
        kind, req = inputs.get_nowait()
        assert kind is EngineCoreRequestType.ADD and torch.equal(req.prompt_embeds, image)

        other = TensorRingWriter(ring_name(address + "-other"), 4 << 20)  # not its front end's
        try:
            reader._on_request(_add_frames(MsgpackEncoder(tensor_ring=other), image))
        finally:
            other.close()
        stale = _add_frames(encoder, image)
    finally:
        ring.close()
    fresh, fresh_inputs = _reader(address)  # (one that had not mapped the ring before)
    fresh._on_request(stale)  # the ring is gone
    for q, why in ((inputs, "not one of this engine's front ends"), (fresh_inputs, "is gone")):
        kind, (request_id, client, reason) = q.get_nowait()
        assert kind is EngineCoreRequestType.REFUSE and (request_id, client) == ("r1", 0)
        assert why in reason
    assert reader.drops.dropped == 1 and fresh.drops.dropped == 1
