"""The engine core's part of `GET /topology`: the `get_topology`
utility on a real (in-process) engine core, through the wire encoding."""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec
import pytest

from treadle import LLM, SamplingParams
from treadle.ipc.serial import MsgpackDecoder, MsgpackEncoder
from treadle.wire.engine import UtilityOutput
from treadle.wire.topology import EngineReport


@pytest.fixture(scope="module")
def llm(inprocess_llm: Callable[..., LLM]) -> LLM:
    return inprocess_llm(max_model_len=64)


def test_get_topology_reports_this_process_load_and_counts(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm.generate(["Hello there", "Once upon a time"], params)
    core = llm.engine_core
    # As a utility call answers it: encoded, decoded as Any, converted by the front end.
    frames = MsgpackEncoder().encode(UtilityOutput(7, result=core.get_topology()))
    raw = MsgpackDecoder(UtilityOutput).decode(frames).result
    report = msgspec.convert(raw, EngineReport)
    me = report.processes[0]
    assert (me.title, me.pid) == ("EngineCore_DP0", os.getpid())
    assert me.rss_bytes > 0 and me.started > 0
    assert len(report.processes) == 1  # world size 1: no worker processes
    assert report.broadcast is None and report.worker_replies == []
    assert report.num_blocks == core.num_blocks and report.used_blocks == 0
    assert report.generated_tokens == 10
    assert report.steps >= 5
    assert report.steps_per_s > 0 and report.generated_tokens_per_s > 0
    assert report.stats.num_running_reqs == 0
    assert report.channels.inputs == []  # in-process: no sockets
