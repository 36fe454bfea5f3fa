"""The engine core's numbers about itself: the KV cache lines at start-up, the periodic stats
line, which comes every interval while the engine has work, once just after, and never while
idle, and `StepMeter`'s rates."""

from collections.abc import Callable

import pytest

from treadle import LLM, SamplingParams
from treadle.core.engine_stats import RATE_WINDOW_S, PeriodicStats, StepMeter, kv_cache_lines
from treadle.wire.engine import SchedulerStats


class FakeScheduler:
    def __init__(self) -> None:
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_preemptions = 0
        self.stats = SchedulerStats()

    def make_stats(self) -> SchedulerStats:
        return self.stats


def test_kv_cache_lines() -> None:
    size, concurrency = kv_cache_lines(
        num_blocks=1024, block_size=16, bytes_per_block=1 << 20, max_model_len=2000
    )
    assert size == "KV cache size: 16,384 tokens (1.00 GiB, 1,024 blocks of 16 tokens)"
    # 2000 tokens take 125 blocks.
    assert concurrency == "Maximum concurrency for 2,000 tokens per request: 8.19x"


def test_periodic_line_while_busy_and_once_just_after() -> None:
    sched = FakeScheduler()
    stats = PeriodicStats(engine_index=1, interval=5.0, now=0.0)
    assert stats.tick(sched, busy=False, now=4.0) is None
    assert stats.tick(sched, busy=False, now=5.5) is None  # an idle interval: no line
    assert stats.tick(sched, busy=True, now=6.0) is None
    sched.prompt_tokens_total, sched.generation_tokens_total = 100, 50
    sched.stats = SchedulerStats(
        num_running_reqs=3,
        num_waiting_reqs=2,
        kv_cache_usage=0.25,
        prefix_cache_queries=200,
        prefix_cache_hits=50,
    )
    line = stats.tick(sched, busy=True, now=10.5)  # the interval 5.5 .. 10.5
    assert line == (
        "Engine 001: Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: "
        "10.0 tokens/s, Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, "
        "Prefix cache hit rate: 25.0%"
    )
    sched.generation_tokens_total, sched.num_preemptions = 75, 2
    assert stats.tick(sched, busy=False, now=12.0) is None
    line = stats.tick(sched, busy=False, now=15.5)  # the work ended in this interval
    assert line is not None and "generation throughput: 5.0 tokens/s" in line
    assert "Preemptions: 2" in line
    assert stats.tick(sched, busy=False, now=21.0) is None  # idle again: quiet


def test_work_after_a_long_idle_time_starts_a_fresh_interval() -> None:
    sched = FakeScheduler()
    stats = PeriodicStats(engine_index=0, interval=5.0, now=0.0)
    assert stats.tick(sched, busy=True, now=100.0) is None  # not 100 s of averages
    sched.generation_tokens_total = 10
    line = stats.tick(sched, busy=True, now=105.0)
    assert line is not None and "Avg generation throughput: 2.0 tokens/s" in line


def test_the_offline_llm_logs_no_stats_and_the_scheduler_counts_tokens(
    inprocess_llm: Callable[..., LLM],
) -> None:
    llm = inprocess_llm(max_model_len=64)
    core = llm.engine_core
    assert core.periodic_stats is None  # LLM's default, as vLLM's: disable_log_stats=True
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], params, use_tqdm=False)
    assert core.scheduler.prompt_tokens_total == 7
    assert core.scheduler.generation_tokens_total == 10


def test_step_meter_averages_over_the_window() -> None:
    meter = StepMeter()
    assert meter.rates(now=100.0) == (0.0, 0.0, 0.0)
    for i in range(40):  # 10 steps/s for 4 s, 8 scheduled and 2 generated tokens each
        meter.on_step(8, 2, now=100.0 + i / 10)
    steps, scheduled, generated = meter.rates(now=104.0)
    assert steps == pytest.approx(10.0)
    assert scheduled == pytest.approx(80.0)
    assert generated == pytest.approx(20.0)
    assert (meter.steps, meter.scheduled_tokens, meter.generated_tokens) == (40, 320, 80)


def test_step_meter_covers_the_burst_after_an_idle_spell() -> None:
    meter = StepMeter()
    meter.on_step(1, 1, now=0.0)
    for i in range(10):  # a minute later: 20 steps/s for half a second
        meter.on_step(1, 1, now=60.0 + i / 20)
    assert meter.rates(now=60.5)[0] == pytest.approx(20.0)
    assert meter.rates(now=60.5 + RATE_WINDOW_S + 1) == (0.0, 0.0, 0.0)  # idle again: none


def test_the_line_has_the_acceptance_rate_and_its_rate_per_position() -> None:
    sched = FakeScheduler()
    sched.stats = SchedulerStats(
        spec_decode_num_drafts=10,
        spec_decode_num_draft_tokens=30,
        spec_decode_num_accepted_tokens=15,
        spec_decode_num_accepted_tokens_per_pos=[8, 5, 2],
    )
    stats = PeriodicStats(engine_index=0, interval=5.0, now=0.0)
    assert stats.tick(sched, busy=True, now=1.0) is None
    line = stats.tick(sched, busy=True, now=5.0)
    assert line is not None
    assert line.endswith("Spec decoding acceptance rate: 50.0%, per position: 80%, 50%, 20%")
