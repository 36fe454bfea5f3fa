"""Malformed frames on treadle's ZMQ sockets: each is dropped with a log line, and the live
process keeps serving the same greedy tokens.

- A live engine core's input socket: this test plays the front end (it binds the ROUTER and
  the PULL and runs the handshake), so it can send the engine anything.
- A live `treadle serve`'s output PULL and request ROUTER: this test connects to their ipc
  files as any local process could.

Both run with TREADLE_ZMQ_MAX_MSG_BYTES=1MiB, so that a 2 MiB frame is above the cap.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from serve_helpers import RemoteServer
from treadle.config import CacheConfig, EngineConfig, ModelConfig
from treadle.frontend.launcher import EngineLauncher
from treadle.ipc.serial import MsgpackDecoder, MsgpackEncoder
from treadle.ipc.zmq_utils import get_bound_address, get_open_zmq_ipc_path, make_zmq_socket
from treadle.sampling_params import SamplingParams
from treadle.wire.control import UtilityRequest
from treadle.wire.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    MultiModalInput,
)

CAP = 1 << 20
KEY = b"k" * 32
HUGE = b"x" * (2 * CAP)
ADD, ABORT, UTILITY = (
    t.value
    for t in (EngineCoreRequestType.ADD, EngineCoreRequestType.ABORT, EngineCoreRequestType.UTILITY)
)
PROMPT = [504, 3575, 282, 4649, 314, 1303, 1300, 253]


def _with_embeds(header: tuple[Any, ...] | None, pickled: bool = False) -> bytes:
    """An ADD payload whose `prompt_embeds` is a tensor extension with this header
    (dtype, shape, bytes or frame index), or a pickle extension."""
    raw = msgspec.msgpack.decode(bytes(MsgpackEncoder().encode(_request("embeds"))[0]))
    # fields 3-7 (eos_token_id .. priority) at their defaults, then prompt_embeds (field 8)
    raw = [*raw[:8], *[None, 0.0, 0, 0, 0][max(0, len(raw) - 3) :]]
    ext = (
        msgspec.msgpack.Ext(3, b"\x80\x05N.")
        if pickled
        else msgspec.msgpack.Ext(1, msgspec.msgpack.encode(header))
    )
    return msgspec.msgpack.encode([*raw, ext])


def _request(rid: str, client_index: int = 0) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return EngineCoreRequest(rid, PROMPT, params, client_index=client_index)


class FrontEnd:
    """The front end's side of one live engine core: ROUTER + PULL, the handshake, reading."""

    def __init__(self, config: EngineConfig) -> None:
        self.launcher = EngineLauncher(config)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.router = make_zmq_socket(self.ctx, get_open_zmq_ipc_path(), zmq.ROUTER, linger=0)
        self.pull = make_zmq_socket(self.ctx, get_open_zmq_ipc_path(), zmq.PULL, linger=0)
        self.launcher.handshake(
            self.ctx, [get_bound_address(self.router)], [get_bound_address(self.pull)], [KEY]
        )
        assert self.router.poll(60_000)
        self.identity, _ready = self.router.recv_multipart()
        self.encoder, self.decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
        self.calls = 0
        self.log_path = Path()

    def send(self, *frames: bytes) -> None:
        self.router.send_multipart([self.identity, *frames])

    def send_obj(self, kind: bytes, obj: Any) -> None:
        self.send(kind, *(bytes(b) for b in self.encoder.encode(obj)))

    def outputs(self, timeout_s: float = 30.0) -> Iterator[EngineCoreOutputs]:
        """Outputs until `timeout_s` passes; what the ROUTER receives meanwhile is read (as a
        real front end does: that also lets zmq retire a dropped connection): only the engine
        sends there, its ready message when it connects again, with a new routing identity."""
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        poller.register(self.router, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(int(left * 1000) + 1))
            if self.router in events:
                self.identity = self.router.recv_multipart()[0]
            if self.pull in events:
                yield self.decoder.decode(self.pull.recv_multipart())

    def answers(self, timeout_s: float = 5.0) -> bool:
        """A utility call gets its reply (the engine is alive and connected)."""
        self.calls += 1
        self.send_obj(UTILITY, UtilityRequest(0, self.calls, "get_stats"))
        for out in self.outputs(timeout_s):
            if out.utility_output is not None and out.utility_output.call_id == self.calls:
                return out.utility_output.failure_message is None
        return False

    def greedy(self, rid: str) -> list[int]:
        self.send_obj(ADD, _request(rid))
        tokens: list[int] = []
        for out in self.outputs():
            for o in out.outputs:
                if o.request_id == rid:
                    tokens += o.new_token_ids
                    if o.finish_reason is not None:
                        return tokens
        raise TimeoutError(rid)

    def close(self) -> None:
        self.launcher.shutdown()
        self.router.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()


@pytest.fixture
def front_end(
    tiny_model_factory: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[FrontEnd]:
    rpc_dir = tempfile.mkdtemp(prefix="trd-")  # (short: ipc addresses have 107 bytes)
    monkeypatch.setenv("TREADLE_RPC_BASE_PATH", rpc_dir)
    monkeypatch.setenv("TREADLE_ZMQ_MAX_MSG_BYTES", str(CAP))
    monkeypatch.setenv("TREADLE_LOGGING_LEVEL", "INFO")
    monkeypatch.setenv("TREADLE_WORKER_MULTIPROC_METHOD", "spawn")  # the child reads the env
    model = str(tiny_model_factory("llama"))
    config = EngineConfig(
        ModelConfig(model, max_model_len=256), CacheConfig(kv_cache_memory=4 << 20)
    )
    # The engine's log goes to a file: its stderr is this process's fd 2 when it starts.
    log = open(tmp_path / "engine.log", "w")  # noqa: SIM115 - closed below
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        fe = FrontEnd(config)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        log.close()
    fe.log_path = tmp_path / "engine.log"
    try:
        yield fe
    finally:
        fe.close()
        shutil.rmtree(rpc_dir, ignore_errors=True)


def test_malformed_frames_to_a_live_engine_core(front_end: FrontEnd) -> None:
    expected = front_end.greedy("before")
    assert len(expected) == 8
    good = bytes(front_end.encoder.encode(_request("x"))[0])
    cases: list[tuple[list[bytes], str]] = [
        ([ADD, b"\xc1garbage"], "Dropped a malformed message"),
        ([b"\x09", good], "Dropped a malformed message"),  # no such type byte
        ([EngineCoreRequestType.EXECUTOR_FAILED.value, good], "is not accepted from a front end"),
        ([EngineCoreRequestType.FRONTEND_GONE.value, b"\xa0"], "is not accepted from a front end"),
        ([ADD, good[: len(good) // 2]], "Dropped a malformed message"),  # truncated msgpack
        ([ADD, msgspec.msgpack.encode(["id", "not a list", 3])], "Dropped a malformed message"),
        ([ABORT, msgspec.msgpack.encode({"a": 1})], "Dropped a malformed message"),
        ([UTILITY, msgspec.msgpack.encode([0, "one", "get_stats"])], "Dropped a malformed"),
        ([ADD], "Dropped a malformed message"),  # no payload frame
    ]
    for frames, _ in cases:
        front_end.send(*frames)
    assert front_end.answers()
    time.sleep(2.1)  # the log takes a burst of 10 lines, then one a second
    front_end.send_obj(ADD, _request("lost", client_index=5))
    front_end.send_obj(UTILITY, UtilityRequest(9, 1, "get_stats"))
    assert front_end.answers()
    assert front_end.greedy("after-garbage") == expected

    # An ADD whose sampling params do not decode still names its request and client: its
    # sender gets an error for it instead of waiting forever.
    raw = msgspec.msgpack.decode(bytes(front_end.encoder.encode(_request("undecodable"))[0]))
    raw[2] = "not sampling params"
    front_end.send(ADD, msgspec.msgpack.encode(raw))
    refused = next(
        o for out in front_end.outputs() for o in out.outputs if o.request_id == "undecodable"
    )
    assert refused.finish_reason == FinishReason.ERROR and refused.new_token_ids == []

    # Above the cap: zmq drops the connection, which comes back. A request in flight then is
    # aborted (a dead front end's would run on for nobody), and this live front end hears it.
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    front_end.send_obj(ADD, EngineCoreRequest("running", PROMPT, params))
    # (it must be running first: an ADD still in the socket's buffer when the huge frame
    # drops the connection is lost with it, as on any dropped connection)
    next(o for out in front_end.outputs() for o in out.outputs if o.request_id == "running")
    front_end.send(ADD, HUGE)
    end = next(
        o
        for out in front_end.outputs()
        for o in out.outputs
        if o.request_id == "running" and o.finish_reason is not None
    )
    assert end.finish_reason == FinishReason.ABORT, end
    assert end.stop_reason == "the front end's connection dropped", end
    deadline = time.monotonic() + 20
    while not front_end.answers(1.0):
        assert time.monotonic() < deadline, "the engine never answered again"
    assert front_end.greedy("after-huge") == expected

    log = front_end.log_path.read_text()
    assert log.count("Dropped a malformed message") >= 7, log
    assert log.count("is not accepted from a front end") == 2, log
    assert "Dropped ADD 'lost': client index 5 has no socket (1 front ends)" in log, log
    assert "Dropped UTILITY 'get_stats': client index 9 has no socket" in log, log
    assert "The connection to the front end at ipc://" in log, log  # the huge frame
    assert "Aborting the 1 request(s) of front end 0: its connection dropped" in log, log
    assert "Traceback" not in log and "Engine core failed" not in log, log

    # prompt_embeds tensors whose header lies (issue 23 item 5): a missing frame, a dtype that
    # is no tensor's, a shape far larger than its bytes (nothing allocated), a negative size,
    # a pickle where a tensor goes: each dropped, the engine serves the same text after
    for header in (
        ("float32", [2, 64], 7),
        ("complex999", [2, 64], b"\0" * 512),
        ("float32", [10**6, 10**6], b"\0" * 512),
        ("float32", [-2, 64], b"\0" * 512),
    ):
        front_end.send(ADD, _with_embeds(header))
    front_end.send(ADD, _with_embeds(None, pickled=True))
    assert front_end.greedy("after-bad-tensors") == expected
    log = front_end.log_path.read_text()
    assert "Traceback" not in log and "Engine core failed" not in log, log

    # Images (issue 39): one sent to this text-only model is refused for its request; an
    # image whose pixel header lies is dropped; the engine serves the same text after.
    params = SamplingParams(temperature=0.0, max_tokens=4)
    image = MultiModalInput(torch.zeros(3, 28, 28), len(PROMPT), 1, "h" * 64)
    front_end.send_obj(ADD, EngineCoreRequest("img", [*PROMPT, 7], params, mm_inputs=[image]))
    refused = next(o for out in front_end.outputs() for o in out.outputs if o.request_id == "img")
    assert refused.finish_reason == FinishReason.ERROR and "text only" in str(refused.stop_reason)
    frames = MsgpackEncoder().encode(EngineCoreRequest("lying", PROMPT, params, mm_inputs=[image]))
    mm_field = EngineCoreRequest.__struct_fields__.index("mm_inputs")
    raw = msgspec.msgpack.decode(
        bytes(frames[0]), ext_hook=lambda code, data: msgspec.msgpack.Ext(code, bytes(data))
    )
    for header in (("float32", [10**6, 10**6], b"\0" * 512), ("float32", [3, 28, 28], 9)):
        raw[mm_field][0][0] = msgspec.msgpack.Ext(1, msgspec.msgpack.encode(header))
        front_end.send(ADD, msgspec.msgpack.encode(raw))
    assert front_end.greedy("after-bad-images") == expected
    log = front_end.log_path.read_text()
    assert "Traceback" not in log and "Engine core failed" not in log, log


# -- the API server's sockets ----------------------------------------------------------------


def _connect(
    rpc_dir: Path, ctx: zmq.Context[Any], socket_type: int, skip: tuple[str, ...] = ()
) -> zmq.Socket[Any]:
    """A socket of `socket_type` connected to the one ipc file (but those of `skip`) whose
    socket accepts it (zmq refuses the handshake between socket types that do not pair)."""
    for path in sorted(rpc_dir.iterdir()):
        if f"ipc://{path}" in skip:
            continue
        sock = ctx.socket(socket_type)
        sock.setsockopt(zmq.LINGER, 2000)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(f"ipc://{path}")
        ok = monitor.poll(2000) and (
            parse_monitor_message(monitor.recv_multipart())["event"]
            == zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        sock.disable_monitor()
        monitor.close(linger=0)
        if ok:
            return sock
        sock.close(linger=0)
    raise LookupError(f"no socket in {rpc_dir} takes a {socket_type}")


def _greedy_text(server: RemoteServer, model: str) -> str:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def _wait_for(server: RemoteServer, text: str, count: int = 1, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while server.output().count(text) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.output().count(text) >= count, (text, server.output())


def test_malformed_frames_to_a_live_api_servers_sockets(server_factory, tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(
        [str(tiny_model_factory("llama")), "--max-model-len", "256"],
        env={"TREADLE_ZMQ_MAX_MSG_BYTES": str(CAP)},
    )
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    expected = _greedy_text(server, model)
    ctx: zmq.Context[Any] = zmq.Context()
    encoder = MsgpackEncoder()
    try:
        push = _connect(server.rpc_dir, ctx, zmq.PUSH)
        valid = bytes(encoder.encode(EngineCoreOutputs(0, [EngineCoreOutput("nobody", [5])]))[0])
        for frame, line in [
            (b"\xc1garbage", "Dropped a malformed engine output"),
            (valid[:-2], "Dropped a malformed engine output"),  # truncated msgpack
            (msgspec.msgpack.encode(["zero", "outputs"]), "Dropped a malformed engine output"),
            (b"ENGINE_CORE_DEAX", "Dropped a malformed engine output"),  # not the real one
            (
                bytes(encoder.encode(EngineCoreOutputs(7))[0]),
                "Dropped an engine output: unknown engine index 7 (1 engines)",
            ),
            (
                bytes(encoder.encode(EngineCoreOutputs(0, [EngineCoreOutput("x", [10**9])]))[0]),
                "Dropped an engine output: request 'x': token ids outside [0, 49152)",
            ),
        ]:
            before = server.output().count(line)
            push.send(frame)
            _wait_for(server, line, before + 1)
        assert _greedy_text(server, model) == expected

        push.send(HUGE)  # above the cap: zmq drops this peer
        _wait_for(server, "A peer of the output socket disconnected")
        push.close(linger=0)

        # Two ROUTERs take a DEALER: the request socket, and the handshake socket (kept open
        # for restarted engines); each drops what it cannot use.
        channels = httpx.get(server.url + "/topology", timeout=30).json()["channels"]
        request_socket = next(c["address"] for c in channels if c["kind"] == "requests")
        handshake = _connect(server.rpc_dir, ctx, zmq.DEALER, skip=(request_socket,))
        handshake.send_multipart([b"\xc1garbage"])
        handshake.send(msgspec.msgpack.encode({"status": "READY", "rank": 0}))
        handshake.send(msgspec.msgpack.encode({"status": "HELLO", "rank": 0}))  # no secret
        _wait_for(server, "Dropped a message on the handshake socket", 2)
        _wait_for(server, "this host, and this is not its process")
        handshake.close(linger=0)
        others = tuple(f"ipc://{p}" for p in server.rpc_dir.iterdir())
        dealer = _connect(
            server.rpc_dir, ctx, zmq.DEALER, skip=tuple(a for a in others if a != request_socket)
        )
        dealer.send_multipart([ADD, b"\xc1garbage"])
        _wait_for(server, "Dropped a message on the request socket (3 frames, ")
        dealer.send(HUGE)
        _wait_for(server, "A peer of the request socket disconnected")
        dealer.close(linger=0)
        assert _greedy_text(server, model) == expected
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        ctx.destroy(linger=0)
    log = server.output()
    assert "Traceback" not in log and "Engine core is dead" not in log, log
    assert not re.search(r"ERROR .*(failed|died)", log), log
