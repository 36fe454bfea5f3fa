"""Front end <-> engine core control messages that carry no tensors (no torch here, so an API
server's engine client can read them): the start-up handshake, utility calls, the frames that
say an engine stopped or died (with why it died), and the DP coordinator's addresses."""

from __future__ import annotations

import os
import traceback
from enum import StrEnum
from typing import Annotated, Any, Final

import msgspec

# Messages on an engine's output PUSH, to every front end: `[ENGINE_CORE_STOPPED]`, and
# `[ENGINE_CORE_DEAD, msgpack DeathReport]` (the bare frame, from an older sender: no report).
ENGINE_CORE_DEAD: Final = b"ENGINE_CORE_DEAD"  # a fatal error: fail every request
ENGINE_CORE_STOPPED: Final = b"ENGINE_CORE_STOPPED"  # stopped by a signal: all were answered

# The "client index" of an engine core's output item that goes to the DP coordinator (its
# stats and wave events) instead of a front end. Never on the wire.
COORDINATOR: Final = -1


class HandshakeStatus(StrEnum):
    """What a `Handshake` message is (ARCHITECTURE §5; `frontend/handshake.py` draws the
    exchange). On the wire as its text; an unknown one fails the decode."""

    HELLO = "HELLO"  # engine -> front end: my rank (and my launcher's secret)
    ADDRESSES = "ADDRESSES"  # front end -> engine: where to connect, this launch's tokens
    REFUSED = "REFUSED"  # front end -> engine, instead of ADDRESSES: why not
    PHASE = "PHASE"  # engine -> front end: what its start-up does now
    READY = "READY"  # engine -> front end: loaded, KV cache sized
    FAILED = "FAILED"  # engine -> front end, instead of READY: its start-up error (reason)


class StartupPhase(StrEnum):
    """How far an engine's start-up got, in order (`/health/startup` and `/topology` show
    it). The engine core says each of the middle three in a PHASE message on the handshake
    socket; the front end knows the others. treadle compiles no kernels (it runs eagerly), so
    there is no such phase."""

    STARTING = "starting"  # its process runs; it has not been answered yet
    LOADING_WEIGHTS = "loading weights"  # (and starting the TP workers, which load theirs)
    PROFILING_KV_CACHE = "profiling the KV cache"  # how many KV blocks fit
    ALLOCATING_KV_CACHE = "allocating the KV cache"
    HANDSHAKE = "handshake"  # loaded (READY): connecting to the front ends' request sockets
    READY = "ready"  # every engine connected and the front end serves


class Handshake(msgspec.Struct, omit_defaults=True):
    """Messages on the handshake socket, in both directions, and the engine's first message
    on each front end's request socket (`ipc/engine_auth.py`)."""

    status: HandshakeStatus
    inputs: list[str] = []
    outputs: list[str] = []
    coordinator_input: str = ""  # XPUB of the DP coordinator (the engine subscribes)
    coordinator_output: str = ""  # PULL of the DP coordinator (the engine pushes)
    num_blocks: int = 0
    max_model_len: int = 0
    vocab_size: int = 0
    pid: int = 0  # the engine core's process (READY): front ends on its host watch it
    rank: int = 0  # HELLO, READY and the first message on a request socket: the DP rank
    # HELLO and READY: the secret the engine's own launcher gave it (the launcher on this host
    # answers only the process it started; an engine of another host is taken on first use).
    secret: bytes = b""
    launch: int = 0  # ADDRESSES, and the first message on a request socket: this launch's number
    tokens: list[bytes] = []  # ADDRESSES: per front end, `engine_token(its key, rank, launch)`
    token: bytes = b""  # the first message on a request socket: that front end's token
    reason: str = ""  # REFUSED (instead of ADDRESSES): why the front end refuses this engine;
    # FAILED (with rank and secret): the engine's start-up error (what a remote one's head says)
    # PHASE (with rank and secret, between ADDRESSES and READY): what the engine starts doing.
    # An unknown phase fails the decode: the message is dropped.
    phase: StartupPhase | None = None


class UtilityRequest(msgspec.Struct, array_like=True):
    """Front end -> engine core: call `EngineCore.<method>(*args)`, answer `call_id`."""

    client_index: int
    call_id: int
    method: str
    args: list[Any] = []


class CoordinatorAddresses(msgspec.Struct, array_like=True):
    """Where the DP coordinator binds (it sends them on its ready pipe; a restarted one gets
    them back and binds the same)."""

    front_publish: str  # XPUB -> front ends
    engine_stats: str  # PULL <- engines
    engine_publish: str  # XPUB -> engines


# A death report's bounds: the sender cuts to them, the receiver's decoder refuses more.
MAX_ERROR_CHARS: Final = 1000
MAX_FRAMES: Final = 4
MAX_LOG_LINES: Final = 8
MAX_LINE_CHARS: Final = 300
_Line = Annotated[str, msgspec.Meta(max_length=MAX_LINE_CHARS)]


class DeathReport(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Why an engine core dies, sent with ENGINE_CORE_DEAD (at most a few KB; the front end
    decodes it as untrusted input: `DeathReport.decode`). Its exit code or signal is not
    here: the process that sees it exit adds that."""

    engine_index: Annotated[int, msgspec.Meta(ge=0)]
    error: Annotated[str, msgspec.Meta(max_length=MAX_ERROR_CHARS)]  # "Type: message"
    frames: Annotated[list[_Line], msgspec.Meta(max_length=MAX_FRAMES)] = []  # innermost last
    log_tail: Annotated[list[_Line], msgspec.Meta(max_length=MAX_LOG_LINES)] = []

    @classmethod
    def of(cls, engine_index: int, e: BaseException, log_tail: list[str]) -> DeathReport:
        """The report of exception `e`: its type and message, its last frames
        ("file.py:line in function"), and the last lines this process logged."""
        frames = [
            _cut(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}", MAX_LINE_CHARS)
            for f in traceback.extract_tb(e.__traceback__)[-MAX_FRAMES:]
        ]
        return cls(
            engine_index,
            _cut(f"{type(e).__name__}: {e}", MAX_ERROR_CHARS),
            frames,
            [_cut(line, MAX_LINE_CHARS) for line in log_tail[-MAX_LOG_LINES:]],
        )

    def describe(self) -> str:
        """One line: "RuntimeError: boom (at engine_core.py:210 in step)"."""
        return f"{self.error} (at {self.frames[-1]})" if self.frames else self.error


_decode_report = msgspec.msgpack.Decoder(DeathReport).decode


def decode_death_report(payload: bytes) -> DeathReport:
    """Decode a report from the socket: raises (`msgspec.DecodeError`, `ValueError`) on
    anything malformed or over the bounds."""
    if len(payload) > 4 * (MAX_ERROR_CHARS + (MAX_FRAMES + MAX_LOG_LINES + 1) * MAX_LINE_CHARS):
        raise ValueError(f"a death report of {len(payload)} bytes is too large")
    return _decode_report(payload)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


MAX_STARTUP_RANKS: Final = 4096  # (bounds `StartupPhases.phases`: far above any DP size)


class StartupPhases(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The `treadle serve` supervisor -> each of its API servers while the engines start
    (a PUB socket over ipc, `cli/supervise.py`): every engine's start-up phase, by DP rank,
    as the supervisor's handshake sees them. Sent every half second until the handshake is
    done, so that each API server's `/health/startup` and `/topology` say how far it got."""

    phases: Annotated[list[StartupPhase], msgspec.Meta(max_length=MAX_STARTUP_RANKS)]
