"""The engine core's numbers about its own work (it sees every request, whichever API server
sent it): the KV cache lines at start-up; vLLM's periodic stats line, every
`LOG_STATS_INTERVAL_S` while the engine has work and once just after (`--disable-log-stats`
turns it off); and the step and token rates of `GET /topology` (`StepMeter`)."""

from __future__ import annotations

import collections
import time

from treadle.core.scheduler import Scheduler

LOG_STATS_INTERVAL_S = 5.0  # vLLM's logging interval


def kv_cache_lines(
    num_blocks: int, block_size: int, bytes_per_block: int, max_model_len: int
) -> list[str]:
    """vLLM's start-up lines about the KV cache: its size, and how many requests of
    max_model_len tokens fit in it at once."""
    tokens = num_blocks * block_size
    gib = num_blocks * bytes_per_block / (1 << 30)
    blocks_per_request = -(-max_model_len // block_size)
    return [
        f"KV cache size: {tokens:,} tokens ({gib:.2f} GiB, {num_blocks:,} blocks of "
        f"{block_size} tokens)",
        f"Maximum concurrency for {max_model_len:,} tokens per request: "
        f"{num_blocks / blocks_per_request:.2f}x",
    ]


class PeriodicStats:
    """`tick()` runs at every step of the engine (and every idle poll of its process). At the
    end of each interval in which the engine had work it returns vLLM's line for that
    interval: prompt and generation throughput (prompts count when their first token comes),
    running and waiting requests, preemptions (when there were some), KV cache usage and the
    prefix cache hit rate (since start-up). An idle interval has no line."""

    def __init__(
        self, engine_index: int, interval: float = LOG_STATS_INTERVAL_S, now: float | None = None
    ) -> None:
        self.engine_index = engine_index
        self.interval = interval
        self._start = time.monotonic() if now is None else now
        self._base = (0, 0, 0)  # the scheduler's totals when the interval started
        self._busy = False  # the engine had work in this interval

    def tick(self, scheduler: Scheduler, busy: bool, now: float) -> str | None:
        if busy and not self._busy:
            self._busy = True
            if now - self._start >= self.interval:  # an idle interval that is over
                self._restart(scheduler, now)
        elapsed = now - self._start
        if elapsed < self.interval:
            return None
        line = self._line(scheduler, elapsed) if self._busy else None
        self._restart(scheduler, now)
        self._busy = busy
        return line

    @staticmethod
    def _totals(scheduler: Scheduler) -> tuple[int, int, int]:
        return (
            scheduler.prompt_tokens_total,
            scheduler.generation_tokens_total,
            scheduler.num_preemptions,
        )

    def _restart(self, scheduler: Scheduler, now: float) -> None:
        self._start = now
        self._base = self._totals(scheduler)

    def _line(self, scheduler: Scheduler, elapsed: float) -> str:
        prompt, generation, preempted = (
            t - b for t, b in zip(self._totals(scheduler), self._base, strict=True)
        )
        stats = scheduler.make_stats()
        queries = stats.prefix_cache_queries
        hit_rate = 100.0 * stats.prefix_cache_hits / queries if queries else 0.0
        parts = [
            f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s",
            f"Avg generation throughput: {generation / elapsed:.1f} tokens/s",
            f"Running: {stats.num_running_reqs} reqs",
            f"Waiting: {stats.num_waiting_reqs} reqs",
        ]
        if preempted:
            parts.append(f"Preemptions: {preempted}")
        parts.append(f"KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%")
        parts.append(f"Prefix cache hit rate: {hit_rate:.1f}%")
        if stats.spec_decode_num_draft_tokens:  # since start, as vLLM's SpecDecoding line
            rate = stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
            parts.append(f"Spec decoding acceptance rate: {100.0 * rate:.1f}%")
            drafts = max(1, stats.spec_decode_num_drafts)  # vLLM's per-position rates
            per_pos = stats.spec_decode_num_accepted_tokens_per_pos
            parts.append(
                "per position: " + ", ".join(f"{100.0 * n / drafts:.0f}%" for n in per_pos)
            )
        return f"Engine {self.engine_index:03d}: " + ", ".join(parts)


RATE_WINDOW_S = 5.0
"""Step and token rates are averaged over about this long."""
_SAMPLE_EVERY_S = 0.25


class StepMeter:
    """Counts steps and tokens; `rates()` averages them over the last `RATE_WINDOW_S`.

    `on_step` costs two additions and a clock read; it stores a sample (the counts before
    the step) at most every `_SAMPLE_EVERY_S`. The rates run from the oldest sample inside
    the window to now, so after an idle spell they cover the burst since work resumed."""

    def __init__(self) -> None:
        self.steps = 0
        self.scheduled_tokens = 0
        self.generated_tokens = 0
        # (monotonic time, steps, scheduled tokens, generated tokens)
        self._samples: collections.deque[tuple[float, int, int, int]] = collections.deque()

    def on_step(
        self, scheduled_tokens: int, generated_tokens: int, now: float | None = None
    ) -> None:
        now = time.monotonic() if now is None else now
        if not self._samples or now - self._samples[-1][0] >= _SAMPLE_EVERY_S:
            self._samples.append((now, self.steps, self.scheduled_tokens, self.generated_tokens))
            while now - self._samples[0][0] > RATE_WINDOW_S:
                self._samples.popleft()
        self.steps += 1
        self.scheduled_tokens += scheduled_tokens
        self.generated_tokens += generated_tokens

    def rates(self, now: float | None = None) -> tuple[float, float, float]:
        """(steps/s, scheduled tokens/s, generated tokens/s)."""
        now = time.monotonic() if now is None else now
        for t, steps, scheduled, generated in self._samples:
            if now - t <= RATE_WINDOW_S:
                span = max(now - t, _SAMPLE_EVERY_S)
                return (
                    (self.steps - steps) / span,
                    (self.scheduled_tokens - scheduled) / span,
                    (self.generated_tokens - generated) / span,
                )
        return 0.0, 0.0, 0.0
