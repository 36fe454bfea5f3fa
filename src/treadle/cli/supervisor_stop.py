"""What ends the `treadle serve` supervisor's wait (`cli/supervise.py`): a signal, or a
child's death that is not restarted (one that is queues its restart instead)."""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Callable
from typing import Any

from treadle.frontend.startup import StartupProgress
from treadle.ipc.process import ChildProcess, describe_exit
from treadle.logger import init_logger

logger = init_logger(__name__)


class Stop:
    """Set by a signal or a child's death; the main thread waits on it. With `restartable`
    children (when restarts are on) a death queues a restart instead."""

    def __init__(self, restartable: Callable[[ChildProcess], bool] = lambda child: False) -> None:
        self.announce: Callable[[ChildProcess], None] = lambda child: None  # said at once
        self.event = threading.Event()
        self.failure: str | None = None
        self.restartable = restartable
        self.restarts: queue.SimpleQueue[ChildProcess] = queue.SimpleQueue()
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()  # `POST /scale`
        self.retired: list[ChildProcess] = []  # stopped on purpose (`POST /scale`): expected
        # The engines' start-up, while it runs: a stop then ends their processes, so that the
        # handshake fails at once instead of waiting for the model to load.
        self.progress: StartupProgress | None = None
        self.signalled = False

    def on_signal(self, signum: int, frame: Any) -> None:
        # Said once: the API servers pass the stop they get from here back (`AsyncMPClient.
        # _chain_stop_signals`), which would say it again for each of them.
        if not self.signalled:
            logger.info("Received %s; shutting down", signal.Signals(signum).name)
        self.signalled = True
        self.event.set()
        if self.progress is not None and not self.progress.done:
            self.progress.stop()

    def on_death(self, child: ChildProcess) -> None:
        """A child that exited 0 was stopped on purpose (e.g. a signal sent to it alone):
        everything stops cleanly. Any other end is a failure."""
        if self.event.is_set() or any(child is c for c in self.retired):
            return
        if child.exitcode != 0 and self.restartable(child):
            self.announce(child)
            self.restarts.put(child)
            return
        if child.exitcode == 0:
            logger.info("%s stopped; shutting down", child.describe())
        else:
            self.failure = f"{child.describe()} died: {describe_exit(child.exitcode)}"
        self.event.set()

    def wait(self, on_restart: Callable[[ChildProcess], None] = lambda child: None) -> None:
        """Until stopped; meanwhile run `on_restart` (in this thread) for each queued death,
        and each queued job (a scale), one at a time."""
        while not self.event.wait(0.2):
            while not self.restarts.empty() and not self.event.is_set():
                on_restart(self.restarts.get())
            if not self.jobs.empty() and not self.event.is_set():
                self.jobs.get()()
