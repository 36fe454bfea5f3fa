"""Which engine core gets each request (data parallelism, ARCHITECTURE §8).

Each ADD goes to the explicit `data_parallel_rank`, or to the engine with the lowest score
`4 * waiting + running` from the DP coordinator's last snapshot plus what this front end sent
since (ties: fewest prompt tokens in flight from here, so that long prompts spread out; then in
turn). The router remembers the owner of each request, so that an ABORT goes only to it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import msgspec

from treadle.frontend.engine_state import EngineSlot
from treadle.wire.engine import DPStats, EngineCoreOutputs, EngineCoreRequest


class EngineRouter:
    def __init__(self, num_engines: int) -> None:
        self.num_engines = num_engines
        # Per engine [waiting, running]: the coordinator's snapshot plus this client's sends.
        self.lb_counts = [[0, 0] for _ in range(num_engines)]
        # Prompt tokens of the requests this client has in flight on each engine.
        self.in_flight = [0] * num_engines
        self.request_engine: dict[str, tuple[int, int]] = {}  # request id -> (engine, tokens)
        self.current_wave = 0
        self._tie_break = itertools.cycle(range(num_engines))
        # Each engine's record (`EngineRestarts.slots`, the same list; none: every engine
        # is up): one `down` is chosen only when every engine is, one `gone` never.
        self.slots: Sequence[EngineSlot] = ()

    def resize(self, n: int) -> None:
        """Engines were added (scale out: they start with nothing) or the highest removed
        (scale in: drained, or their requests moved; `POST /scale`)."""
        old = self.num_engines
        self.num_engines = n
        self.lb_counts = self.lb_counts[:n] + [[0, 0] for _ in range(old, n)]
        self.in_flight = self.in_flight[:n] + [0] * (n - old)
        self._tie_break = itertools.cycle(range(n))

    def route(self, request: EngineCoreRequest, rank: int | None) -> int:
        """Pick the engine for a new request (stamping the current wave) and remember it.
        `ValueError` for a rank that does not exist."""
        n = self.num_engines
        if rank is not None and not 0 <= rank < n:
            there = "there is 1 engine" if n == 1 else f"there are {n} engines"
            raise ValueError(f"data_parallel_rank {rank} out of range: {there}")
        if n == 1:
            return 0
        if rank is None:
            counts, in_flight = self.lb_counts, self.in_flight
            first = next(self._tie_break)
            slots = self.slots if len(self.slots) == n else ()
            up = (
                [e for e in range(n) if not (slots and slots[e].down)]
                or [e for e in range(n) if not (slots and slots[e].gone)]
                or range(n)
            )
            rank = min(
                up,
                key=lambda e: (4 * counts[e][0] + counts[e][1], in_flight[e], (e - first) % n),
            )
        self.lb_counts[rank][0] += 1
        tokens = len(request.prompt_token_ids)
        self.in_flight[rank] += tokens
        self.request_engine[request.request_id] = (rank, tokens)
        request.current_wave = self.current_wave
        return rank

    def owners(self, request_ids: list[str]) -> dict[int, list[str]]:
        """The engine of each request to abort (requests that finished already are left out)."""
        if self.num_engines == 1:
            return {0: request_ids}
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            owner = self.request_engine.pop(rid, None)
            if owner is not None:
                rank, tokens = owner
                self.in_flight[rank] -= tokens
                by_engine.setdefault(rank, []).append(rid)
        return by_engine

    def note_finished(self, outputs: EngineCoreOutputs) -> None:
        if self.num_engines == 1:
            return
        for out in outputs.outputs:
            if out.finish_reason is not None:
                owner = self.request_engine.pop(out.request_id, None)
                if owner is not None:
                    self.in_flight[owner[0]] -= owner[1]

    def on_stats(self, payload: bytes) -> None:
        """A coordinator snapshot; raises on a malformed one (the caller drops it)."""
        stats = msgspec.msgpack.decode(payload, type=DPStats)
        counts = [[int(w), int(r)] for w, r, _ in stats.engines]
        if len(counts) == self.num_engines:
            self.lb_counts = counts
        self.current_wave = stats.wave
