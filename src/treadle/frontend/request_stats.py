"""What the front end learns about each request from the engine outputs, for the metrics
(vLLM's `RequestStateStats`, `IterationStats` and `FinishedRequestStats`).

One `RequestStats` per engine request (a request with `n > 1` has n of them and one
`ParentStats`). Each batch of outputs from an engine becomes one `IterationStats`: the tokens
it brought, the first-token and inter-token latencies, and the requests that finished in it.

Two clocks, as in vLLM: front-end `time.monotonic()` for arrival, TTFT and end-to-end latency;
the engine's own clock for the phases of a request inside it. The engine measures the queue
time (waiting until first scheduled) and the prefill time (first scheduled to first token) and
sends them with the first token (`EngineCoreOutput.queue_time`, `prefill_time`); the decode
time runs from the engine timestamp of the outputs that carried the first token to that of
the last one (`EngineCoreOutputs.timestamp`), so preemptions fall inside the phase in which
they happened. Inference time = prefill + decode.

`LatencyWindow` keeps each engine's TTFT and TPOT of about the last minute from the same
`IterationStats`, for the dashboard's live numbers. With several API servers each one sees
only the requests it serves.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from treadle.wire.engine import EngineCoreOutput, FinishReason


@dataclass
class ParentStats:
    """A request with `n > 1`: `n` and the longest output are observed once all its
    samples have finished."""

    n: int
    unfinished: int
    max_num_generation_tokens: int = 0


@dataclass
class RequestStats:
    arrival: float  # front-end monotonic clock
    num_prompt_tokens: int
    max_tokens: int | None
    parent: ParentStats | None = None
    num_generation_tokens: int = 0
    queue_time: float = 0.0
    prefill_time: float = 0.0
    first_token_ts: float = 0.0  # engine clock
    last_token_ts: float = 0.0
    num_images: int = 0  # the prompt's (a vision-language model's)
    lora: str | None = None  # the adapter's name
    prefilled: bool = False  # its prompt is read (a first token, or a pooling result)
    num_cached_tokens: int = 0  # of its prompt, from the prefix cache


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None
    num_images: int = 0
    num_cached_tokens: int = 0
    # The phases (engine clock); None when the request ended before its first token.
    queued_time: float | None = None
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None
    mean_time_per_output_token: float | None = None


def finished_request_stats(stats: RequestStats, reason: str, now: float) -> FinishedRequestStats:
    """The whole-request figures of a request that ended at `now` (front-end clock)."""
    done = FinishedRequestStats(
        finish_reason=reason,
        e2e_latency=now - stats.arrival,
        num_prompt_tokens=stats.num_prompt_tokens,
        num_generation_tokens=stats.num_generation_tokens,
        max_tokens_param=stats.max_tokens,
        num_images=stats.num_images,
        num_cached_tokens=stats.num_cached_tokens,
    )
    if stats.num_generation_tokens == 0:
        return done
    decode = max(0.0, stats.last_token_ts - stats.first_token_ts)
    done.queued_time = stats.queue_time
    done.prefill_time = stats.prefill_time
    done.decode_time = decode
    done.inference_time = stats.prefill_time + decode
    # The first token is the prefill's, not the decode's.
    done.mean_time_per_output_token = (
        decode / (stats.num_generation_tokens - 1) if stats.num_generation_tokens > 1 else 0.0
    )
    return done


@dataclass
class IterationStats:
    """The observations from one batch of outputs of one engine."""

    now: float  # front-end monotonic clock when the batch arrived
    engine_ts: float  # the engine's timestamp of the batch
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)
    # The prompts read in this batch by source (vLLM's `PromptTokenStats`): computed, from the
    # prefix cache (with the last token the model reads again when all of it was cached),
    # skipped, and recomputed (that last token).
    prompt_computed: int = 0
    prompt_local_cache_hit: int = 0
    prompt_cached: int = 0
    prompt_recomputed: int = 0
    # With adapters: those of this front end's requests that run (their prompt read) and that
    # wait (not yet); None when no request ever named one.
    lora_running: list[str] | None = None
    lora_waiting: list[str] | None = None

    @property
    def num_tokens(self) -> int:
        """vLLM's tokens of an iteration: the prompts that got their first token, and every
        generated token."""
        return self.num_prompt_tokens + self.num_generation_tokens

    def add_prompt(self, prompt_len: int, num_cached: int) -> None:
        """A prompt is read: vLLM's accounting (`PromptTokenStats.update_from_output`; all of
        a prompt cached but its last token reads as `prompt_len - 1` cached)."""
        recomputed = 1 if num_cached + 1 == prompt_len else 0
        self.num_prompt_tokens += prompt_len
        self.prompt_computed += prompt_len - num_cached
        self.prompt_local_cache_hit += num_cached + recomputed
        self.prompt_cached += num_cached
        self.prompt_recomputed += recomputed

    def update_from_output(self, stats: RequestStats, out: EngineCoreOutput) -> None:
        new = len(out.new_token_ids)
        if not stats.prefilled and (new or out.pooled is not None):
            # The prompt is done: with the first token, or a pooling request's result (an
            # embedding counts its prompt as vLLM's does, and has no first token).
            stats.prefilled = True
            stats.num_cached_tokens = out.num_cached_tokens
            self.add_prompt(stats.num_prompt_tokens, out.num_cached_tokens)
        if new == 0:
            return
        if stats.num_generation_tokens == 0:  # the first token
            self.time_to_first_tokens.append(self.now - stats.arrival)
            stats.queue_time, stats.prefill_time = out.queue_time, out.prefill_time
            stats.first_token_ts = self.engine_ts
        else:
            self.inter_token_latencies.append(max(0.0, self.engine_ts - stats.last_token_ts))
        stats.last_token_ts = self.engine_ts
        stats.num_generation_tokens += new
        self.num_generation_tokens += new

    def update_from_finished(self, stats: RequestStats, reason: str) -> None:
        self.finished_requests.append(finished_request_stats(stats, reason, self.now))
        parent = stats.parent
        if parent is None:
            self.n_params.append(1)
            self.max_num_generation_tokens.append(stats.num_generation_tokens)
            return
        parent.unfinished -= 1
        parent.max_num_generation_tokens = max(
            parent.max_num_generation_tokens, stats.num_generation_tokens
        )
        if parent.unfinished == 0:
            self.n_params.append(parent.n)
            self.max_num_generation_tokens.append(parent.max_num_generation_tokens)


class RequestStatsTable:
    """The `RequestStats` of this front end's requests, by engine request id."""

    def __init__(self) -> None:
        self._by_child: dict[str, RequestStats] = {}
        self._children: dict[str, list[str]] = {}
        self._loras = False  # a request named an adapter

    def add(
        self,
        request_id: str,
        child_ids: list[str],
        arrival: float,
        num_prompt_tokens: int,
        max_tokens: int | None,
        num_images: int = 0,
        lora_name: str | None = None,
    ) -> None:
        n = len(child_ids)
        parent = ParentStats(n, n) if n > 1 else None
        self._loras = self._loras or lora_name is not None
        for child_id in child_ids:
            self._by_child[child_id] = RequestStats(
                arrival,
                num_prompt_tokens,
                max_tokens,
                parent,
                num_images=num_images,
                lora=lora_name,
            )
        self._children[request_id] = child_ids

    def forget(self, request_id: str) -> None:
        """The request is over for its caller (finished, aborted or failed)."""
        for child_id in self._children.pop(request_id, ()):
            self._by_child.pop(child_id, None)

    def iteration(
        self,
        outputs: list[EngineCoreOutput],
        stopped: list[str],
        now: float,
        engine_ts: float,
    ) -> IterationStats:
        """The stats of one batch of engine outputs; `stopped`: the engine requests that
        the front end ended (a stop string) while processing them."""
        it = IterationStats(now, engine_ts)
        ended = set(stopped)
        for out in outputs:
            stats = self._by_child.get(out.request_id)
            if stats is None:
                continue  # not this front end's, aborted, or already finished
            it.update_from_output(stats, out)
            if out.finish_reason is not None or out.request_id in ended:
                reason = out.finish_reason if out.finish_reason is not None else FinishReason.STOP
                it.update_from_finished(stats, str(reason))
                del self._by_child[out.request_id]
        if self._loras:
            running = {
                s.lora for s in self._by_child.values() if s.lora is not None and s.prefilled
            }
            waiting = {
                s.lora for s in self._by_child.values() if s.lora is not None and not s.prefilled
            }
            it.lora_running, it.lora_waiting = sorted(running), sorted(waiting)
        return it


# -- the dashboard's recent latencies --------------------------------------------------------

WINDOW_S = 60.0
"""Percentiles cover the requests of about the last minute."""
MAX_SAMPLES = 4096
"""... and at most this many of them per engine."""


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks, as numpy's
    default; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class RollingWindow:
    """Samples of the last `window_s` seconds (at most `max_samples`)."""

    def __init__(self, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=max_samples
        )

    def add(self, value: float, now: float) -> None:
        self._samples.append((now, value))

    def values(self, now: float) -> list[float]:
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        return [v for _, v in self._samples]


class LatencyWindow:
    """Per engine: time to first token (at the first token) and time per output token after
    the first (at the end of a request) of recent requests."""

    def __init__(self, num_engines: int, window_s: float = WINDOW_S) -> None:
        self.ttft = [RollingWindow(window_s) for _ in range(num_engines)]
        self.tpot = [RollingWindow(window_s) for _ in range(num_engines)]

    def resize(self, n: int) -> None:
        """Engines added (empty windows) or the highest removed (`POST /scale`)."""
        window = self.ttft[0].window_s if self.ttft else WINDOW_S
        for windows in (self.ttft, self.tpot):
            del windows[n:]
            windows.extend(RollingWindow(window) for _ in range(len(windows), n))

    def observe(self, engine: int, it: IterationStats) -> None:
        """One batch of the engine's outputs, as `RequestStatsTable.iteration` saw it."""
        for ttft in it.time_to_first_tokens:
            self.ttft[engine].add(ttft, it.now)
        for done in it.finished_requests:
            if done.num_generation_tokens > 1 and done.mean_time_per_output_token is not None:
                self.tpot[engine].add(done.mean_time_per_output_token, it.now)

    def summary(self, engine: int, now: float) -> dict[str, float | int | None]:
        ttft = self.ttft[engine].values(now)
        tpot = self.tpot[engine].values(now)
        out: dict[str, float | int | None] = {"ttft_count": len(ttft), "tpot_count": len(tpot)}
        for name, values in (("ttft", ttft), ("tpot", tpot)):
            for q in (50, 99):
                value = percentile(values, q)
                out[f"{name}_p{q}"] = None if math.isnan(value) else value
        return out
