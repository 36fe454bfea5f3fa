"""How far the engines' start-up got, for an API server that serves HTTP while they start
(`/health/startup`, `/topology`; `entrypoints/openai/starting.py`).

Written by the thread that builds the engine client (the launcher's handshake: each engine's
PHASE messages, then its READY), read by the event loop: each write replaces one list item
or a flag, which a reader sees whole. Only the start-up is followed: once `finish`ed, later
reports (a restarted engine's) are ignored; `/topology` shows such an engine `restarting`.

With several API servers the supervisor runs the handshake: its own `StartupProgress` is
published every half second (`StartupPhases`, `cli/supervise.py`) and each API server's
`follow_phases` thread copies it into the API server's own. Such a copy knows nothing until
the first message comes (`heard`): meanwhile its API server holds what it would answer, so
that two probes to two API servers never see the phases go back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from treadle.ipc.inbound import inbound_options
from treadle.ipc.process import ChildProcess
from treadle.ipc.zmq_utils import make_zmq_socket
from treadle.logger import init_logger
from treadle.wire.control import StartupPhase, StartupPhases

logger = init_logger(__name__)


class StartupProgress:
    def __init__(self, num_engines: int, follows: bool = False) -> None:
        self.phases = [StartupPhase.STARTING] * num_engines  # per DP rank
        # Set once `phases` are known: at once, unless they are copied from the supervisor
        # (`follows`), then at its first message (`follow_phases`).
        self.heard = threading.Event()
        if not follows:
            self.heard.set()
        self.done = False
        self.stopping = False  # a stop signal came during the start-up (`stop`)
        self.changed = threading.Event()  # set by each change (the supervisor publishes it)
        # The local children of the start-up (the launcher's engines and DP coordinator), so
        # that a stop during the start-up can end them (`stop`).
        self.children: Callable[[], list[ChildProcess]] = list

    def report(self, rank: int, phase: StartupPhase) -> None:
        """Engine `rank` began `phase` (any thread)."""
        if not self.done and 0 <= rank < len(self.phases):
            logger.debug("Engine core %d: %s", rank, phase)
            self.phases[rank] = phase
            self.changed.set()

    def finish(self) -> None:
        """Every engine is connected and the client is built."""
        self.phases = [StartupPhase.READY] * len(self.phases)
        self.done = True
        self.heard.set()
        self.changed.set()

    def resize(self, n: int) -> None:
        """Engines added or removed while serving (`POST /scale`): those present are ready."""
        self.phases = [StartupPhase.READY] * n

    def connecting(self) -> bool:
        """Every engine is loaded and connecting to the front end(s): the client is built
        within moments."""
        return not self.done and all(p is StartupPhase.HANDSHAKE for p in self.phases)

    def describe(self) -> str:
        """The phase, when every engine is in the same one; else each engine's."""
        if len(set(self.phases)) == 1:
            return str(self.phases[0])
        return ", ".join(f"engine {rank}: {phase}" for rank, phase in enumerate(self.phases))

    def to_json(self) -> list[dict[str, object]]:
        return [{"dp_rank": rank, "phase": phase} for rank, phase in enumerate(self.phases)]

    def stop(self) -> None:
        """End the start-up (a stop signal): terminate its local children, so that the
        thread that waits for them fails at once instead of waiting for the model to load
        (an API server that waits for a supervisor's engines reads `stopping`)."""
        self.stopping = True
        self.heard.set()  # (nothing more will come: what waits for it answers now)
        for child in self.children():
            if child.exitcode is None:  # (without reaping it: the monitor does)
                child.process.terminate()


def startup_address(notes: str) -> str:
    """Where an API server of a supervisor binds the SUB of the supervisor's `StartupPhases`
    while its engine client is built (beside the SUB of its notes, `AttachTo.supervisor`);
    the supervisor's PUB connects."""
    return f"{notes}-startup"


_decode_phases = msgspec.msgpack.Decoder(StartupPhases).decode


def follow_phases(progress: StartupProgress, address: str) -> threading.Thread:
    """Copy the supervisor's `StartupPhases` on `address` into `progress` until it is done or
    stopped (a thread; the SUB is bound there and closed at the end, which removes its file).
    A message that does not decode, or has another number of engines, is ignored."""

    def run() -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        sock = make_zmq_socket(ctx, address, zmq.SUB, True, linger=0, options=inbound_options())
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            while not (progress.done or progress.stopping):
                if not sock.poll(200):
                    continue
                try:
                    phases = _decode_phases(sock.recv()).phases
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                if len(phases) == len(progress.phases):
                    for rank, phase in enumerate(phases):
                        # Ready at the supervisor: connecting to this API server.
                        ready = phase is StartupPhase.READY
                        progress.report(rank, StartupPhase.HANDSHAKE if ready else phase)
                    progress.heard.set()
        finally:
            sock.close(linger=0)
            ctx.term()

    thread = threading.Thread(target=run, name="startup-phases", daemon=True)
    thread.start()
    return thread
