"""Logging that says which process speaks: `INFO (EngineCore_DP0 pid=123) message`."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys

from treadle import envs

_process_name = "treadle"
_configured = False


class _ProcessFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.treadle_process = f"({_process_name} pid={os.getpid()})"
        return True


def set_process_name(name: str) -> None:
    """Name this process in every later log line (e.g. `EngineCore_DP0`)."""
    global _process_name
    _process_name = name


def _configure() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(envs.logging_level())  # (a `LogTail` may take more)
    handler.addFilter(_ProcessFilter())
    handler.setFormatter(
        logging.Formatter(
            "%(levelname)s %(asctime)s %(treadle_process)s [%(filename)s:%(lineno)d] %(message)s",
            datefmt="%m-%d %H:%M:%S",
        )
    )
    root = logging.getLogger("treadle")
    root.addHandler(handler)
    root.setLevel(envs.logging_level())
    root.propagate = False


def init_logger(name: str) -> logging.Logger:
    _configure()
    return logging.getLogger(name if name.startswith("treadle") else f"treadle.{name}")


class LogTail(logging.Handler):
    """The last `size` lines this process logged at INFO or above, whatever the level that
    stderr shows (an engine core's death report carries them); `attach` adds one to
    treadle's logger."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.lines: collections.deque[str] = collections.deque(maxlen=size)
        self.setFormatter(logging.Formatter("%(levelname)s [%(filename)s:%(lineno)d] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):  # (a line that cannot be formatted: skipped)
            self.lines.append(self.format(record).splitlines()[0])

    @classmethod
    def attach(cls, size: int) -> LogTail:
        tail = cls(size)
        tail.setLevel(logging.INFO)
        _configure()
        root = logging.getLogger("treadle")
        root.addHandler(tail)
        root.setLevel(min(root.level, logging.INFO))
        return tail
