"""The engine core's side of the start-up handshake (ARCHITECTURE §5; the front end's side
is `frontend/handshake.py`), on a DEALER to the front end's handshake ROUTER:

    engine --HELLO (rank, launch secret)--> front end
        <--ADDRESSES (sockets, coordinator, launch number, a token per front end)--
        (or <--REFUSED (reason)--: the start-up fails saying why)
    --PHASE (loading weights, profiling / allocating the KV cache)--> front end
    (the engine loads, sizes its KV cache) --READY (limits, KV blocks, pid)--> front end
        (or --FAILED (its start-up error)-->: a head on another host learns why at once)

`join_front_end` runs it around `load` (which builds the `EngineCore`) and returns the
addresses and, per front end, the ready message the engine sends first on that front end's
request socket (with its token: `ipc/engine_auth.py`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from treadle import envs
from treadle.core.engine_core_io import LINGER_MS
from treadle.ipc.engine_auth import routing_id
from treadle.ipc.inbound import inbound_options
from treadle.ipc.zmq_utils import make_zmq_socket
from treadle.logger import init_logger
from treadle.wire.control import Handshake, HandshakeStatus, StartupPhase

if TYPE_CHECKING:
    from treadle.core.engine_core import EngineCore

logger = init_logger(__name__)

_FIRST_WAIT_LOG_S = 5.0  # a HELLO unanswered this long is logged, then every _WAIT_LOG_S
_WAIT_LOG_S = 30.0
MAX_FAILED_CHARS = 2000  # of a start-up error sent to the front end


def join_front_end(
    ctx: zmq.Context[Any],
    handshake_address: str,
    dp_rank: int,
    secret: bytes,
    load: Callable[[Handshake, Callable[[StartupPhase], None]], EngineCore],
) -> tuple[Handshake, list[bytes]]:
    """HELLO, then `load(addresses, say)` (`say(phase)` tells the front end how far the
    start-up got: `/health/startup`), then READY. Returns (ADDRESSES, the first message for
    each request socket). Raises `TimeoutError` (no answer within
    TREADLE_ENGINE_READY_TIMEOUT_S) or `RuntimeError` (refused, or a malformed answer)."""
    hs = make_zmq_socket(
        ctx,
        handshake_address,
        zmq.DEALER,
        bind=False,
        identity=routing_id(),
        linger=LINGER_MS,
        options=inbound_options(),
    )
    encode, decode = msgspec.msgpack.encode, msgspec.msgpack.Decoder(Handshake).decode
    try:
        hs.send(encode(Handshake(HandshakeStatus.HELLO, rank=dp_rank, secret=secret)))
        timeout = envs.engine_ready_timeout_s()
        deadline = time.monotonic() + timeout
        wait_s = _FIRST_WAIT_LOG_S
        while not hs.poll(int(max(0.0, min(wait_s, deadline - time.monotonic())) * 1000)):
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no front end answered at {handshake_address} within {timeout} s "
                    "(TREADLE_ENGINE_READY_TIMEOUT_S)"
                )
            # A rank the head does not have yet waits there until POST /scale adds it.
            logger.info(
                "Engine rank %d: no answer yet from the front end at %s (not up yet, or it "
                "has no rank %d until POST /scale adds it); waiting up to %.0f s more",
                dp_rank,
                handshake_address,
                dp_rank,
                deadline - time.monotonic(),
            )
            wait_s = _WAIT_LOG_S
        addresses = decode(hs.recv())
        if addresses.status is HandshakeStatus.REFUSED:
            raise RuntimeError(f"the front end refused this engine core: {addresses.reason}")
        if addresses.status is not HandshakeStatus.ADDRESSES:
            raise RuntimeError(f"the front end answered HELLO with {addresses.status}")
        if len(addresses.tokens) != len(addresses.inputs):
            raise RuntimeError("the front end sent no token for each of its request sockets")
        if addresses.launch > 1 and envs.test_fail_restart_rank() == dp_rank:
            raise RuntimeError("TREADLE_TEST_FAIL_RESTART_RANK: a restart fails to start")

        def say(phase: StartupPhase) -> None:  # how far the start-up got (`/health/startup`)
            hs.send(
                encode(Handshake(HandshakeStatus.PHASE, rank=dp_rank, secret=secret, phase=phase))
            )

        try:
            engine = load(addresses, say)
        except Exception as e:  # the front end hears why (a head far away waits on it)
            reason = f"{type(e).__name__}: {e}"[:MAX_FAILED_CHARS]
            failed = Handshake(HandshakeStatus.FAILED, rank=dp_rank, secret=secret, reason=reason)
            hs.send(encode(failed))
            raise
        info = Handshake(
            HandshakeStatus.READY,
            num_blocks=engine.num_blocks,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            pid=os.getpid(),
            rank=dp_rank,
        )
        hs.send(encode(msgspec.structs.replace(info, secret=secret)))
    finally:
        hs.close()
    # The first message on each request socket: what this engine found, and its proof.
    ready = [
        encode(msgspec.structs.replace(info, launch=addresses.launch, token=token))
        for token in addresses.tokens
    ]
    return addresses, ready
