"""The one restart sequence of a dead child, which an API server with its own engines
(`engine_restarts.py`) and the `treadle serve` supervisor (`cli/supervise.py`) share, and
the --max-engine-restarts budget it spends."""

from __future__ import annotations

import collections
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from treadle.logger import init_logger

logger = init_logger(__name__)

# --max-engine-restarts counts the restarts in this window.
ENGINE_RESTART_WINDOW_S = 600


class RestartBudget:
    """At most `limit` restarts in any ENGINE_RESTART_WINDOW_S."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._times: collections.deque[float] = collections.deque()

    def spend(self, cause: str) -> str | None:
        """Take one restart; returns why not (a message ending in the flag's name) when the
        window's budget is spent, else None (and logs nothing: the caller says what it does)."""
        now = time.monotonic()
        while self._times and now - self._times[0] > ENGINE_RESTART_WINDOW_S:
            self._times.popleft()
        if len(self._times) >= self.limit:
            return (
                f"{cause}; it was restarted {self.limit} time(s) in the last "
                f"{ENGINE_RESTART_WINDOW_S // 60} minutes already (--max-engine-restarts)"
            )
        self._times.append(now)
        return None

    def describe(self) -> str:
        """e.g. "restart 2 of at most 3 in 10 minutes", after `spend`."""
        return (
            f"restart {len(self._times)} of at most {self.limit} in "
            f"{ENGINE_RESTART_WINDOW_S // 60} minutes"
        )


def _say_down(message: str) -> None:
    logger.warning("%s", message)


def restart_child(
    name: str,
    cause: str,
    budget: RestartBudget,
    restart: Callable[[], Awaitable[None]],
    fail: Callable[[str], None],
    down: Callable[[str], None] = _say_down,
    back: Callable[[float], Awaitable[None]] | None = None,
) -> Coroutine[Any, Any, None] | None:
    """The one restart sequence of a dead child (`name`: its title, e.g. `EngineCore_DP1`).
    At once: spend one restart of `budget` (none left: `fail(why)`, and None is returned),
    and say that it is down and restarting (`down(message)`; by default a warning). Then
    the returned coroutine (the caller runs it: a task, or `asyncio.run`) does `restart()`
    and `back(seconds since)` (by default a warning "`name` is back ..."), or `fail(why)`
    when the restart raised."""
    refusal = budget.spend(cause)
    if refusal is not None:
        fail(refusal)
        return None
    down(f"{cause[:1].upper()}{cause[1:]}. Restarting it ({budget.describe()})")
    return _restart(name, cause, restart, fail, back)


async def _restart(
    name: str,
    cause: str,
    restart: Callable[[], Awaitable[None]],
    fail: Callable[[str], None],
    back: Callable[[float], Awaitable[None]] | None,
) -> None:
    since = time.monotonic()
    try:
        await restart()
    except Exception as e:
        fail(f"{cause}, and restarting it failed: {type(e).__name__}: {e}")
        return
    took = time.monotonic() - since
    if back is not None:
        await back(took)
    else:
        logger.warning("%s is back %.1f s after it died", name, took)
