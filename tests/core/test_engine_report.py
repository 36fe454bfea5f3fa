"""The engine core's part of `GET /topology`: `StepMeter`'s rates, and the `get_topology`
utility on a real (in-process) engine core, through the wire encoding."""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec
import pytest

from treadle import LLM, SamplingParams
from treadle.core.engine_report import RATE_WINDOW_S, StepMeter
from treadle.ipc.serial import MsgpackDecoder, MsgpackEncoder
from treadle.wire.engine import UtilityOutput
from treadle.wire.topology import EngineReport


def test_step_meter_averages_over_the_window() -> None:
    meter = StepMeter()
    assert meter.rates(now=100.0) == (0.0, 0.0, 0.0)
    for i in range(40):  # 10 steps/s for 4 s, 8 scheduled and 2 generated tokens each
        meter.on_step(8, 2, now=100.0 + i / 10)
    steps, scheduled, generated = meter.rates(now=104.0)
    assert steps == pytest.approx(10.0)
    assert scheduled == pytest.approx(80.0)
    assert generated == pytest.approx(20.0)
    assert (meter.steps, meter.scheduled_tokens, meter.generated_tokens) == (40, 320, 80)


def test_step_meter_covers_the_burst_after_an_idle_spell() -> None:
    meter = StepMeter()
    meter.on_step(1, 1, now=0.0)
    for i in range(10):  # a minute later: 20 steps/s for half a second
        meter.on_step(1, 1, now=60.0 + i / 20)
    assert meter.rates(now=60.5)[0] == pytest.approx(20.0)
    assert meter.rates(now=60.5 + RATE_WINDOW_S + 1) == (0.0, 0.0, 0.0)  # idle again: none


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
