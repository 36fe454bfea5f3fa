"""Which peer of a front end's request ROUTER is engine core `rank` (issue 28): bound only by
proof, never by a routing identity anyone can claim.

Every front end (each API server) makes a key, `new_key()`, known only to it and to whoever
runs its engines' handshake (the launcher in the same process, or the `treadle serve`
supervisor, which gets it on the API server's ready pipe). Each handshake of engine `rank`
gets a launch number that grows per rank (`EngineLauncher`), and for each front end
`engine_token(key, rank, launch)`. The engine's DEALERs connect with a fresh random routing
identity and send `(rank, launch, token)` first; the front end (`EngineIdentities.admit`)
binds `rank` to that peer only when the token is right and the launch is not older than the
one it has:

    launch >  current: a new engine process of that rank (started after a death)
    launch == current: the same engine, connected again (after a dropped connection)
    launch <  current, wrong token, unknown rank: refused (the caller logs it)

There is no `ROUTER_HANDOVER`: a peer that claims a bound routing identity is ignored by
libzmq, and routing identities are random, so that no peer can squat on one either.

The output PULL cannot tell its peers apart, so an engine's control messages there (it
stopped, it died, and why) carry their own proof as their last frame: `seal_control` appends
`(rank, launch)` and an HMAC of the message under that launch's token, and the front end
(`EngineIdentities.check_control`) acts on one only if the proof holds for a launch not
older than the one it has. Any other process of the same user can push into the PULL; it
cannot stop, kill or blame an engine.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence

__all__ = [
    "EngineIdentities",
    "EngineRefusedError",
    "engine_token",
    "new_key",
    "routing_id",
    "seal_control",
]

_KEY_BYTES = 32
_PROOF = struct.Struct("<II")  # a control message's last frame: (rank, launch), then the MAC
_MAC_BYTES = hashlib.sha256().digest_size


def new_key() -> bytes:
    return os.urandom(_KEY_BYTES)


def routing_id() -> bytes:
    """A fresh routing identity for one DEALER connection of an engine core."""
    return os.urandom(16)


def engine_token(key: bytes, rank: int, launch: int) -> bytes:
    """What launch `launch` of engine `rank` shows the front end that owns `key`."""
    msg = b"treadle-engine:%d:%d" % (rank, launch)
    return hmac.new(key, msg, hashlib.sha256).digest()


def _control_mac(token: bytes, frames: Sequence[bytes]) -> bytes:
    mac = hmac.new(token, b"treadle-control", hashlib.sha256)
    for frame in frames:
        mac.update(len(frame).to_bytes(8, "little"))
        mac.update(frame)
    return mac.digest()


def seal_control(
    tokens: Sequence[bytes], rank: int, launch: int, frames: list[bytes]
) -> list[list[bytes]]:
    """The control message `frames` of launch `launch` of engine `rank`, for each front end
    (`tokens`: that launch's token of each), with its proof as the last frame."""
    proof = _PROOF.pack(rank, launch)
    return [[*frames, proof + _control_mac(token, frames)] for token in tokens]


class EngineRefusedError(ValueError):
    """A peer's claim to be an engine core was refused (the message says why)."""


class EngineIdentities:
    """The front end's map: engine rank -> the routing identity of its current connection."""

    def __init__(self, key: bytes, num_engines: int) -> None:
        self.key = key
        self.num_engines = num_engines
        self._routes: list[bytes] = [b""] * num_engines  # b"": not connected (sends drop)
        self._launches = [0] * num_engines

    def admit(self, routing: bytes, rank: int, launch: int, token: bytes) -> bool:
        """Bind `rank` to the peer `routing` if it proves it is that engine; returns whether it
        is a new launch (False: the same engine connected again). Raises
        `EngineRefusedError` otherwise, and changes nothing."""
        if not 0 <= rank < self.num_engines:
            raise EngineRefusedError(f"unknown engine rank {rank} ({self.num_engines} engines)")
        if not hmac.compare_digest(token, engine_token(self.key, rank, launch)):
            raise EngineRefusedError(f"a wrong or missing token for engine rank {rank}")
        current = self._launches[rank]
        if launch < current:
            raise EngineRefusedError(
                f"launch {launch} of engine rank {rank} is older than the current one ({current})"
            )
        self._routes[rank] = routing
        self._launches[rank] = launch
        return launch > current

    def check_control(self, frames: Sequence[bytes]) -> int:
        """The rank of the engine that sent the control message `frames` (its last frame the
        proof of `seal_control`). Raises `EngineRefusedError` when the proof is missing or
        wrong, or names an unknown rank or an older launch than the current one."""
        *body, proof = frames
        if len(proof) != _PROOF.size + _MAC_BYTES:
            raise EngineRefusedError("no proof of which engine sent it")
        rank, launch = _PROOF.unpack_from(proof)
        if not 0 <= rank < self.num_engines:
            raise EngineRefusedError(f"unknown engine rank {rank} ({self.num_engines} engines)")
        mac = _control_mac(engine_token(self.key, rank, launch), body)
        if not hmac.compare_digest(proof[_PROOF.size :], mac):
            raise EngineRefusedError(f"a wrong proof for engine rank {rank}")
        if launch < self._launches[rank]:
            raise EngineRefusedError(
                f"launch {launch} of engine rank {rank} is older than the current one "
                f"({self._launches[rank]})"
            )
        return rank

    def resize(self, n: int) -> None:
        """Ranks added (not connected yet) or the highest removed (`POST /scale`)."""
        old, self.num_engines = self.num_engines, n
        self._routes = self._routes[:n] + [b""] * (n - old)
        self._launches = self._launches[:n] + [0] * (n - old)

    def identity(self, rank: int) -> bytes:
        return self._routes[rank]

    def launch(self, rank: int) -> int:
        return self._launches[rank]

    @property
    def connected(self) -> int:
        return sum(1 for r in self._routes if r)
