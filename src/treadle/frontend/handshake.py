"""The front end's handshake socket, one message at a time (ARCHITECTURE §2, §5, §8): what
`EngineLauncher.handshake` runs at start-up, and what an API server with its own engines keeps
open while serving (`engine_rejoin.py`: its restarted engines, and a `--headless` engine
that rejoins a lost rank).

    engine --HELLO (rank, secret)--> desk
        --ADDRESSES (front ends, coordinator, launch number, a token per front end)--> engine
        (or --REFUSED (reason)--> engine, which fails its start-up saying why)
    engine --PHASE (loading weights, profiling the KV cache, ...)--> desk (`on_phase`)
    engine loads the model, sizes its KV cache --READY--> desk
        (or --FAILED (its start-up error)--> desk: kept in `failed`, for whoever waits)

The desk answers the ranks it `expect`s: a HELLO of one of them starts a new launch of that
rank (`launches`, shared with the launcher), and a HELLO with another secret, a second HELLO
of a rank already greeted, or anything else of a rank not expected is handed back to the
caller (`Hello`: `greet` or `refuse` it) or dropped with a rate-limited log line. The desk
only reads and decides: the replies wait in `outbox` for the caller to send. An engine of
this host must show the secret its process was started with; one of another host is taken
on first use (nothing else can prove it).

A HELLO for a rank this server does not have (yet) is handed back too; where engines of
other hosts may join (`POST /scale`), the caller `hold`s it: one per rank, logged, until
`POST /scale` admits that rank (`expect`, then `decide_early` greets it) or for at most
TREADLE_ENGINE_READY_TIMEOUT_S (as long as the engine itself waits for an answer), after
which it is refused saying why. Ranks from MAX_ENGINES up are dropped.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from treadle import envs
from treadle.ipc.engine_auth import engine_token
from treadle.ipc.inbound import DropLog
from treadle.logger import init_logger
from treadle.wire.control import Handshake, HandshakeStatus, StartupPhase

logger = init_logger(__name__)

MAX_ENGINES = 64
"""The most engine ranks a server runs (`POST /scale` stops there)."""


@dataclass(frozen=True)
class Hello:
    """A HELLO the desk did not expect: the caller greets or refuses it."""

    peer: bytes
    rank: int
    secret: bytes


class HandshakeDesk:
    def __init__(
        self,
        sock: zmq.Socket[Any],
        addresses: Handshake,
        keys: list[bytes],
        launches: list[int],
        check_secret: Callable[[int, bytes], None],
        on_phase: Callable[[int, StartupPhase], None] | None = None,
    ) -> None:
        self.sock = sock
        self.addresses = addresses  # ADDRESSES without launch and tokens
        self.keys = keys
        self.launches = launches  # rank -> its last launch number (the launcher's list)
        self.check_secret = check_secret  # raises ValueError for a HELLO without its secret
        self.on_phase = on_phase  # told each PHASE of a greeted rank
        self.expected: set[int] = set()
        self.ready: dict[int, Handshake] = {}  # rank -> its READY, since it was expected
        self.failed: dict[int, str] = {}  # rank -> its start-up error (FAILED), since expected
        self._greeted: dict[int, tuple[bytes, bytes]] = {}  # rank -> (its secret, the reply)
        self.early: dict[int, tuple[Hello, float]] = {}  # rank not (yet) ours -> HELLO, since
        self.drops = DropLog(logger)
        self.outbox: list[list[bytes]] = []  # replies the caller sends (`take`), in order
        self._decode = msgspec.msgpack.Decoder(Handshake).decode

    def expect(self, ranks: list[int] | set[int] | range) -> None:
        """Answer a new launch of each of `ranks` (forgetting any handshake of it before)."""
        for rank in ranks:
            self.expected.add(rank)
            self._greeted.pop(rank, None)
            self.ready.pop(rank, None)
            self.failed.pop(rank, None)

    def on_message(self, frames: list[Any]) -> Hello | int | None:
        """One message: answers an expected rank's HELLO; returns the rank whose READY this
        is, or a `Hello` the desk did not expect (None: answered, or dropped and logged)."""
        try:  # anyone may connect to the handshake socket
            peer, payload = (f.bytes if isinstance(f, zmq.Frame) else bytes(f) for f in frames)
            msg = self._decode(payload)
            rank = msg.rank
            if not 0 <= rank < MAX_ENGINES:
                raise ValueError(f"unknown engine rank {rank}")
            if rank >= len(self.launches):  # (a rank `POST /scale` may add: the caller holds it)
                if msg.status is HandshakeStatus.HELLO:
                    return Hello(peer, rank, msg.secret)
                raise ValueError(f"{msg.status} of engine rank {rank}, which is not one of ours")
            expected = rank in self.expected and rank not in self.ready
            if msg.status is HandshakeStatus.HELLO and (not expected or rank in self._greeted):
                return Hello(peer, rank, msg.secret)
            if not expected:
                raise ValueError(f"unexpected {msg.status} of engine rank {rank}")
            if msg.status is HandshakeStatus.HELLO:
                self.greet(Hello(peer, rank, msg.secret))
                return None
            if rank not in self._greeted:
                raise ValueError(f"{msg.status} from engine rank {rank} before HELLO")
            if not hmac.compare_digest(msg.secret, self._greeted[rank][0]):
                raise ValueError(f"not the secret of engine rank {rank}'s HELLO")
            if msg.status is HandshakeStatus.FAILED:
                self.failed[rank] = msg.reason[:2000]
                self._greeted.pop(rank, None)
                logger.warning(
                    "Engine rank %d says its start-up failed: %s", rank, self.failed[rank]
                )
                return None
            if msg.status is HandshakeStatus.PHASE and msg.phase is not None:
                if self.on_phase is not None:
                    self.on_phase(rank, msg.phase)
                return None
            if msg.status is not HandshakeStatus.READY:
                raise ValueError(f"{msg.status} is no message of an engine (rank {rank})")
        except Exception as e:
            self.drops.drop("Dropped a message on the handshake socket: %s", e)
            return None
        self.ready[rank] = msg
        return rank

    def greet(self, hello: Hello) -> None:
        """Answer the HELLO with the addresses and the tokens of a new launch of its rank.
        Raises `ValueError` for an engine of this host without its secret."""
        rank = hello.rank
        self.check_secret(rank, hello.secret)
        self.expect([rank])
        self.launches[rank] += 1
        launch = self.launches[rank]
        tokens = [engine_token(key, rank, launch) for key in self.keys]
        reply = msgspec.structs.replace(self.addresses, launch=launch, tokens=tokens)
        self._greeted[rank] = (hello.secret, msgspec.msgpack.encode(reply))
        self.outbox.append([hello.peer, self._greeted[rank][1]])

    def refuse(self, hello: Hello, reason: str) -> None:
        """Tell the engine that said `hello` why it is refused (it fails its start-up)."""
        logger.warning("Refused an engine core for rank %d: %s", hello.rank, reason)
        refusal = Handshake(HandshakeStatus.REFUSED, rank=hello.rank, reason=reason)
        self.outbox.append([hello.peer, msgspec.msgpack.encode(refusal)])

    def admits(self, rank: int) -> bool:
        """Whether a HELLO of `rank` would be greeted now (expected, not greeted yet)."""
        return (
            rank < len(self.launches)
            and rank in self.expected
            and rank not in self._greeted
            and rank not in self.ready
        )

    def forget(self, ranks: range) -> None:
        """Ranks removed (`POST /scale`), or whose scale out failed: expected no more."""
        for rank in ranks:
            self.expected.discard(rank)
            self._greeted.pop(rank, None)
            self.ready.pop(rank, None)
            self.failed.pop(rank, None)

    def hold(self, hello: Hello) -> None:
        """Keep the HELLO of an engine of another host for a rank this server does not have
        (yet), until `POST /scale` admits it (`decide_early`); a second one is refused."""
        rank = hello.rank
        if rank in self.early:
            self.refuse(hello, f"another engine core already waits to join as rank {rank}")
            return
        self.early[rank] = (hello, time.monotonic())
        logger.warning(
            "An engine core of another host says HELLO for engine rank %d, which this server "
            "does not have (it runs %d engines): it waits until POST /scale "
            '{"data_parallel_size": %d} (or more) adds that rank, for at most %d s',
            rank,
            len(self.launches),
            rank + 1,
            envs.engine_ready_timeout_s(),
        )

    def decide_early(self) -> None:
        """Greet each held HELLO whose rank is admitted now; refuse those held too long."""
        limit = envs.engine_ready_timeout_s()
        for rank, (hello, since) in list(self.early.items()):
            if self.admits(rank):
                del self.early[rank]
                logger.info("Engine rank %d was added: answering the HELLO that waited", rank)
                try:
                    self.greet(hello)
                except ValueError as e:  # (a rank of this host: never one of another host's)
                    self.refuse(hello, str(e))
            elif time.monotonic() - since > limit:
                del self.early[rank]
                self.refuse(
                    hello,
                    f"this server has no engine rank {rank}: no POST /scale added it within "
                    f"{limit} s (TREADLE_ENGINE_READY_TIMEOUT_S)",
                )

    def joining(self, rank: int) -> bool:
        """Whether an engine of `rank` was answered and has not said READY yet."""
        return rank in self._greeted and rank not in self.ready

    def take(self) -> list[list[bytes]]:
        """The replies to send now (the caller owns the socket's sends: sync, or asyncio)."""
        out, self.outbox = self.outbox, []
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
