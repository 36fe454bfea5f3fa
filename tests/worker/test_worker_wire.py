"""The worker calls' codecs (`treadle.wire.worker`): what crosses hosts is msgpack, decoded into
the methods' own types, and a message that is not one is refused without running anything."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from treadle.ipc.shm_message import PickleCodec
from treadle.sampling_params import SamplingParams
from treadle.wire.engine import Logprobs
from treadle.wire.worker import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    WorkerCallCodec,
    WorkerReplyCodec,
    call_codec,
    reader_codec,
    reply_codec,
)


def _step() -> SchedulerOutput:
    return SchedulerOutput(
        new_requests=[
            NewRequestData(
                "a",
                [1, 2, 3],
                3,
                SamplingParams(temperature=0.0, max_tokens=7, stop=["x"]),
                [4, 5],
                0,
                eos_token_id=2,
                prompt_embeds=torch.randn(3, 8),
            )
        ],
        cached_requests=[CachedRequestData("b", [9], 17, new_token_ids=[5, 6])],
        num_scheduled_tokens={"a": 3, "b": 1},
        total_num_scheduled_tokens=4,
        finished_request_ids={"c", "d"},
        grammar_request_ids=["b"],
        grammar_bitmask=np.random.default_rng(0).integers(
            -(2**31), 2**31 - 1, (1, 400_000), dtype=np.int32
        ),
        spec_tokens={"b": [7, 8]},
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, msgspec.Struct):
        return type(a) is type(b) and all(
            _same(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("cross_host", [False, True])
def test_a_step_and_its_reply_round_trip_in_their_own_types(cross_host: bool) -> None:
    step = _step()
    calls, replies = call_codec(cross_host), reply_codec(cross_host)
    bufs = calls.dumps(("execute_model", (step,), None, 0))
    assert len(bufs) == 2  # the 1.6 MB bitmask travels out of band
    got = calls.loads([bytes(b) for b in bufs])
    calls.release(bufs)
    assert got[0] == "execute_model" and got[2] is None and got[3] == 0
    assert _same(got[1][0], step)

    out = ModelRunnerOutput(
        sampled={"a": 4},
        logprobs={"a": Logprobs([[4, 1]], [[-0.5, -1.0]], [1])},
        prompt_logprobs={"a": (1, Logprobs([[2]], [[-2.0]], [3]))},
        accepted={"b": [7]},
        pooled={"a": torch.ones(8)},
    )
    method, ok, result = replies.loads(replies.dumps(("execute_model", True, out)))
    assert (method, ok) == ("execute_model", True) and _same(result, out)


def test_other_methods_travel_as_plain_data() -> None:
    calls, replies = WorkerCallCodec(), WorkerReplyCodec()
    method, args, kwargs, rank = calls.loads(
        calls.dumps(("load_kv_blocks", ("/tmp/x", {3: 4}), {"k": [1]}, None))
    )
    assert (method, args, kwargs, rank) == ("load_kv_blocks", ("/tmp/x", {3: 4}), {"k": [1]}, None)
    assert calls.loads(calls.dumps((None, (), None, None))) == (None, (), None, None)  # stop
    assert replies.loads(replies.dumps(("kv_identity", True, {"n": 2}))) == (
        "kv_identity",
        True,
        {"n": 2},
    )
    assert replies.loads(replies.dumps(("execute_model", False, "ValueError: no"))) == (
        "execute_model",
        False,
        "ValueError: no",
    )


def test_a_message_that_is_not_a_call_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    calls, replies = WorkerCallCodec(), WorkerReplyCodec()
    for codec in (calls, replies):
        with pytest.raises(msgspec.DecodeError):
            codec.loads([pickle.dumps(("execute_model", (Exploit(),), None, 0))])
    assert not marker.exists()
    bad = [
        msgspec.msgpack.encode(["execute_model", [["not a step"]], None, 0]),
        msgspec.msgpack.encode(["execute_model", [], None, "rank"]),
        msgspec.msgpack.encode(["execute_model", True, [1, 2, 3]]),
        b"\xc1",
        b"",
    ]
    for message in bad:
        for codec in (calls, replies):
            with pytest.raises(msgspec.DecodeError):
                codec.loads([message])


def test_a_reader_takes_the_codec_its_handle_names() -> None:
    assert isinstance(reader_codec("pickle"), PickleCodec)
    assert isinstance(reader_codec("worker-call"), WorkerCallCodec)
    assert isinstance(reader_codec("worker-reply"), WorkerReplyCodec)
    with pytest.raises(ValueError, match="unknown worker queue codec"):
        reader_codec("marshal")
