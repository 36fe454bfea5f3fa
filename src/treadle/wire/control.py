"""Front end <-> engine core control messages that carry no tensors (no torch here, so an API
server's engine client can read them): the start-up handshake, utility calls, the frames that
say an engine stopped or died, and the DP coordinator's addresses."""

from __future__ import annotations

from typing import Any, Final

import msgspec

# Single-frame messages on an engine's output PUSH, to every front end.
ENGINE_CORE_DEAD: Final = b"ENGINE_CORE_DEAD"  # a fatal error: fail every request
ENGINE_CORE_STOPPED: Final = b"ENGINE_CORE_STOPPED"  # stopped by a signal: all were answered

# The "client index" of an engine core's output item that goes to the DP coordinator (its
# stats and wave events) instead of a front end. Never on the wire.
COORDINATOR: Final = -1


class Handshake(msgspec.Struct, omit_defaults=True):
    """Messages on the handshake socket, in both directions, and the engine's first message
    on each front end's request socket (`ipc/engine_auth.py`)."""

    status: str  # HELLO | ADDRESSES | READY
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
