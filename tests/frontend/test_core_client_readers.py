"""The front end's readers: what arrives on the PULL is checked before anything acts on it
(`OutputReader`), dropped messages are logged without flooding the log (`DropLog`), and a
reader that fails is logged with its traceback and makes the engine dead, never a silent
wedge."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from treadle.config import CacheConfig, EngineConfig, ModelConfig
from treadle.frontend.async_client import AsyncMPClient
from treadle.frontend.core_client import EngineDeadError
from treadle.frontend.output_reader import OutputReader
from treadle.ipc.engine_auth import EngineIdentities, engine_token, new_key, seal_control
from treadle.ipc.inbound import DropLog, MessageTooLargeError, check_outbound
from treadle.ipc.serial import MsgpackEncoder
from treadle.sampling_params import SamplingParams
from treadle.wire.control import (
    ENGINE_CORE_DEAD,
    ENGINE_CORE_STOPPED,
    MAX_ERROR_CHARS,
    MAX_FRAMES,
    MAX_LINE_CHARS,
    MAX_LOG_LINES,
    DeathReport,
)
from treadle.wire.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Logprobs,
)


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    """Records of treadle's loggers (which do not propagate to the root logger)."""
    found: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = found.append  # type: ignore[method-assign]
    root = logging.getLogger("treadle")
    root.addHandler(handler)
    yield found
    root.removeHandler(handler)


def frames(obj: Any) -> list[bytes]:
    return [bytes(b) for b in MsgpackEncoder().encode(obj)]


def out(**kwargs: Any) -> EngineCoreOutputs:
    return EngineCoreOutputs(0, [EngineCoreOutput("r", **kwargs)])


KEY = new_key()


def reader_of(num_engines: int = 2) -> OutputReader:
    """A reader whose engine 1 is at launch 1 (engine 0 has not connected yet)."""
    engines = EngineIdentities(KEY, num_engines)
    engines.admit(b"engine 1", 1, 1, engine_token(KEY, 1, 1))
    return OutputReader(engines, vocab_size=100)


def sealed(*frames: bytes, rank: int = 1, launch: int = 1) -> list[bytes]:
    return seal_control([engine_token(KEY, rank, launch)], rank, launch, list(frames))[0]


GOOD_LOGPROBS = Logprobs(token_ids=[[5, 6]], logprobs=[[-0.1, -2.0]], ranks=[1])


@pytest.mark.parametrize(
    ("message", "why"),
    [
        ([b"\xc1"], "malformed"),
        ([frames(out(new_token_ids=[5]))[0][:-1]], "malformed"),  # truncated
        ([msgspec.msgpack.encode([0, "not a list"])], "malformed"),  # wrong field type
        ([b"ENGINE_CORE_DEAX"], "malformed"),  # the length of a control frame, not one
        (frames(EngineCoreOutputs(2)), "unknown engine index 2 (2 engines)"),
        (frames(EngineCoreOutputs(-1)), "unknown engine index -1"),
        (frames(out(new_token_ids=[100])), "token ids outside [0, 100)"),
        (frames(out(new_token_ids=[-1])), "token ids outside [0, 100)"),
        (
            frames(out(new_token_ids=[5, 6], new_logprobs=GOOD_LOGPROBS)),
            "logprobs do not have one row per token",
        ),
        (
            frames(out(new_token_ids=[5], new_logprobs=Logprobs([[5]], [[]], [1]))),
            "a logprobs row is empty, uneven or outside the vocabulary",
        ),
        (
            frames(out(new_token_ids=[5], new_logprobs=Logprobs([[500]], [[0.0]], [1]))),
            "a logprobs row is empty, uneven or outside the vocabulary",
        ),
    ],
)
def test_output_reader_drops_and_logs_what_cannot_be_used(
    message: list[bytes], why: str, records: list[logging.LogRecord]
) -> None:
    reader = reader_of()
    assert reader.read(message) is None
    assert reader.drops.dropped == 1
    assert len(records) == 1 and records[0].levelno == logging.ERROR
    assert why in records[0].getMessage()


def test_output_reader_passes_good_outputs_and_control_frames() -> None:
    reader = reader_of()
    good = out(new_token_ids=[5], new_logprobs=GOOD_LOGPROBS)
    assert reader.read(frames(good)) == good
    assert reader.read(sealed(ENGINE_CORE_STOPPED)) == ENGINE_CORE_STOPPED
    assert reader.read(sealed(ENGINE_CORE_STOPPED, rank=0)) == ENGINE_CORE_STOPPED
    assert reader.drops.dropped == reader.refusals.dropped == 0


def test_control_frames_without_their_senders_proof_are_refused(
    records: list[logging.LogRecord],
) -> None:
    """Any local process can push into the PULL (issue 42 item 9): a stop or a death (with a
    report to be blamed on the next real death) counts only with the engine's proof."""
    reader = reader_of()
    report = msgspec.msgpack.encode(DeathReport(1, "RuntimeError: forged"))
    for message in (
        [ENGINE_CORE_STOPPED],
        [ENGINE_CORE_DEAD],
        [ENGINE_CORE_DEAD, report],
        [ENGINE_CORE_DEAD, report, b"\x01\x00\x00\x00\x01\x00\x00\x00" + b"m" * 32],
        seal_control([engine_token(new_key(), 1, 1)], 1, 1, [ENGINE_CORE_STOPPED])[0],
        sealed(ENGINE_CORE_STOPPED, launch=0),  # an older launch
        [*sealed(ENGINE_CORE_DEAD, report)[:1], sealed(ENGINE_CORE_DEAD, report)[2]],
    ):
        assert reader.read(message) is None, message
    assert reader.refusals.dropped == 7 and reader.drops.dropped == 0
    assert all("nothing stops" in r.getMessage() for r in records)
    assert "Refused ENGINE_CORE_STOPPED on the output socket" in records[0].getMessage()


def raised_report(engine_index: int = 1) -> DeathReport:
    def step() -> None:
        raise RuntimeError("boom " + "x" * 5000)

    try:
        step()
    except RuntimeError as e:
        return DeathReport.of(engine_index, e, [f"INFO line {i} " + "y" * 500 for i in range(20)])
    raise AssertionError


def test_a_death_report_is_bounded_and_says_what_raised_where() -> None:
    report = raised_report()
    assert report.error.startswith("RuntimeError: boom x") and len(report.error) == 1000
    assert (
        report.frames[-1].startswith("test_core_client_readers.py:")
        and "in step" in (report.frames[-1])
    )
    assert len(report.log_tail) == MAX_LOG_LINES and report.log_tail[-1].startswith("INFO line 19")
    assert all(len(line) <= MAX_LINE_CHARS for line in report.log_tail + report.frames)
    assert report.describe() == f"{report.error} (at {report.frames[-1]})"
    reader = reader_of()
    assert reader.read(sealed(ENGINE_CORE_DEAD, msgspec.msgpack.encode(report))) == report


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"\xc1", "malformed death report"),
        (msgspec.msgpack.encode([1, "E", [], [], "extra"]), "malformed death report"),
        (msgspec.msgpack.encode([-1, "E"]), "malformed death report"),
        (msgspec.msgpack.encode([0, "E"]), "engine index 0 from engine 1"),
        (msgspec.msgpack.encode([1, "E" * (MAX_ERROR_CHARS + 1)]), "malformed death report"),
        (msgspec.msgpack.encode([1, "E", ["f"] * (MAX_FRAMES + 1)]), "malformed death report"),
        (msgspec.msgpack.encode([1, "E", [], ["l" * 10_000]]), "malformed death report"),
        (b"\x00" * 100_000, "too large"),
    ],
)
def test_a_bad_death_report_is_dropped_but_the_death_stays(
    payload: bytes, why: str, records: list[logging.LogRecord]
) -> None:
    reader = reader_of()
    assert reader.read(sealed(ENGINE_CORE_DEAD, payload)) == ENGINE_CORE_DEAD
    assert reader.drops.dropped == 1 and why in records[0].getMessage()


def test_drop_log_writes_a_burst_then_one_line_a_second(
    records: list[logging.LogRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr("treadle.ipc.inbound.time.monotonic", lambda: now[0])
    drops = DropLog(logging.getLogger("treadle.test"), interval=1.0, burst=3)
    for _ in range(1000):
        drops.drop("Dropped %s", "x")
    assert drops.dropped == 1000 and len(records) == 3
    now[0] += 1.0
    drops.drop("Dropped %s", "y")
    assert len(records) == 4
    assert records[-1].getMessage() == "Dropped y (and 997 more dropped without a line)"


def test_senders_refuse_what_the_peer_would_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_ZMQ_MAX_MSG_BYTES", "1000")
    check_outbound([b"x" * 1000, memoryview(bytearray(1000))], "ok")
    with pytest.raises(MessageTooLargeError, match="this ADD message is 1001 bytes"):
        check_outbound([b"id", b"x" * 1001], "this ADD message")


def test_a_reader_that_fails_is_logged_and_makes_the_engine_dead(
    tiny_model_factory: Any, records: list[logging.LogRecord], tmp_path: Any
) -> None:
    """`on_outputs` raising (a bug downstream) ends the output reader: the traceback is
    logged, `on_dead` runs, pending and later calls fail with `EngineDeadError`."""
    config = EngineConfig(
        ModelConfig(str(tiny_model_factory("llama")), max_model_len=128),
        CacheConfig(kv_cache_memory=1 << 20),
    )
    dead: list[str] = []

    class Listener:
        def on_outputs(self, outputs: EngineCoreOutputs) -> None:
            if outputs.outputs:
                raise KeyError("a bug in the output processor")

        def on_failed(self, rank: int, request_ids: list[str], error: Exception) -> None: ...

        def on_event(self, kind: str, engine: int, count: int) -> None: ...

        def on_dead(self, reason: str) -> None:
            dead.append(reason)

        def on_stopped(self, reason: str) -> None: ...

    async def main() -> None:
        client = AsyncMPClient(config, Listener())
        try:
            client.start()
            assert await client.call_utility("get_stats") is not None
            params = SamplingParams(temperature=0.0, max_tokens=4)
            await client.add_request(EngineCoreRequest("r1", [1, 2, 3], params))
            for _ in range(600):
                if dead:
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(EngineDeadError):
                await client.call_utility("get_stats")
        finally:
            client.shutdown()

    asyncio.run(main())
    assert dead == [
        "the front end's engine output reader failed: KeyError: 'a bug in the output processor'"
    ]
    failed = [r for r in records if r.getMessage() == "The engine output reader failed"]
    assert failed and failed[0].exc_info is not None  # with its traceback


def test_an_end_seen_after_the_loop_closed_is_kept_not_raised(tiny_model_factory: Any) -> None:
    """The process monitor can see an engine core's exit after the server's loop has closed
    (a stop during shutdown): the client keeps the reason and raises nothing (it used to log
    "on_death failed ... Event loop is closed")."""
    config = EngineConfig(
        ModelConfig(str(tiny_model_factory("llama")), max_model_len=128),
        CacheConfig(kv_cache_memory=1 << 20),
    )
    client = AsyncMPClient(config, None)  # type: ignore[arg-type]  # (never told: no loop)
    try:
        client.loop = asyncio.new_event_loop()
        client.loop.close()
        client._mark_stopped("the EngineCore_DP0 process stopped")
        assert client.dead_reason == "the EngineCore_DP0 process stopped"
        client._mark_dead("a later death")
        assert client.dead_reason == "the EngineCore_DP0 process stopped"  # (the first kept)
    finally:
        client.loop = None
        client.shutdown()
