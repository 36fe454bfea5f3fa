"""How far the engines' start-up got, for an API server that serves HTTP while they start
(`/health/startup`, `/topology`; `entrypoints/openai/starting.py`).

Written by the thread that builds the engine client (the launcher's handshake: each engine's
PHASE messages, then its READY), read by the event loop: each write replaces one list item
or a flag, which a reader sees whole. Only the start-up is followed: once `finish`ed, later
reports (a restarted engine's) are ignored; `/topology` shows such an engine `restarting`.
"""

from __future__ import annotations

from collections.abc import Callable

from treadle.ipc.process import ChildProcess
from treadle.logger import init_logger
from treadle.wire.control import StartupPhase

logger = init_logger(__name__)


class StartupProgress:
    def __init__(self, num_engines: int) -> None:
        self.phases = [StartupPhase.STARTING] * num_engines  # per DP rank
        self.done = False
        # The local children of the start-up (the launcher's engines and DP coordinator), so
        # that a stop during the start-up can end them (`stop`).
        self.children: Callable[[], list[ChildProcess]] = list

    def report(self, rank: int, phase: StartupPhase) -> None:
        """Engine `rank` began `phase` (any thread)."""
        if not self.done and 0 <= rank < len(self.phases):
            logger.debug("Engine core %d: %s", rank, phase)
            self.phases[rank] = phase

    def finish(self) -> None:
        """Every engine is connected and the client is built."""
        self.phases = [StartupPhase.READY] * len(self.phases)
        self.done = True

    def resize(self, n: int) -> None:
        """Engines added or removed while serving (`POST /scale`): those present are ready."""
        self.phases = [StartupPhase.READY] * n

    def describe(self) -> str:
        """The phase, when every engine is in the same one; else each engine's."""
        if len(set(self.phases)) == 1:
            return str(self.phases[0])
        return ", ".join(f"engine {rank}: {phase}" for rank, phase in enumerate(self.phases))

    def to_json(self) -> list[dict[str, object]]:
        return [{"dp_rank": rank, "phase": phase} for rank, phase in enumerate(self.phases)]

    def stop(self) -> None:
        """End the start-up (a stop signal): terminate its local children, so that the
        thread that waits for them fails at once instead of waiting for the model to load."""
        for child in self.children():
            if child.process.is_alive():
                child.process.terminate()
