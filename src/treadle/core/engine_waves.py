"""One engine core's side of the data-parallel waves (ARCHITECTURE §8): the wave it knows of
(the highest of its requests' `current_wave` and the coordinator's START_DP_WAVE), and what
the DP coordinator hears from it: its idle <-> busy transitions at once (`start_wave` when an
idle engine gets work, `wave_complete` when it goes idle), its stats at most every
`STATS_INTERVAL_S` while busy.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from treadle.wire.engine import EngineCoreOutputs

if TYPE_CHECKING:
    from treadle.core.engine_core import EngineCore

STATS_INTERVAL_S = 0.05


class EngineWaves:
    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.current_wave = 0
        self._busy = False
        self._sent = 0.0  # when the coordinator last heard from this engine

    def joined(self, wave: int) -> None:
        """A request of `wave`, or the coordinator's START_DP_WAVE of it, reached this engine."""
        self.current_wave = max(self.current_wave, wave)

    def report(self, engine: EngineCore) -> EngineCoreOutputs | None:
        """What to push to the coordinator now (None: nothing)."""
        busy = engine.has_unfinished_requests()
        now = time.monotonic()
        if busy == self._busy and (not busy or now - self._sent < STATS_INTERVAL_S):
            return None
        out = EngineCoreOutputs(self.dp_rank, scheduler_stats=engine.get_stats())
        if busy != self._busy:
            self._busy = busy
            if busy:
                out.start_wave = self.current_wave
            else:
                out.wave_complete = self.current_wave
        self._sent = now
        return out
