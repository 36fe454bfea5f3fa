"""`StatLogger`: what one batch of outputs and the scheduler stats add to the Prometheus
metrics (the served names, types and labels: tests/entrypoints/test_metrics_served.py)."""

from prometheus_client import REGISTRY

from treadle.config import CacheConfig
from treadle.frontend.metrics import StatLogger, build_1_2_5_buckets
from treadle.frontend.request_stats import RequestStatsTable
from treadle.wire.engine import EngineCoreOutput, FinishReason, SchedulerStats


def sample(name: str, engine: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(
        f"treadle:{name}", {"model_name": "m", "engine": engine, **labels}
    )


def test_1_2_5_buckets() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(2047) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert build_1_2_5_buckets(1) == [1]


def test_a_finished_request_fills_the_histograms_and_counters() -> None:
    logger = StatLogger("m", 300, engine=7)
    table = RequestStatsTable()
    table.add("r", ["r"], 0.0, num_prompt_tokens=20, max_tokens=2)
    first = EngineCoreOutput("r", [5], queue_time=0.5, prefill_time=0.25)
    logger.record_iteration(table.iteration([first], [], 1.0, 10.0))
    last = EngineCoreOutput("r", [6], finish_reason=FinishReason.LENGTH)
    logger.record_iteration(table.iteration([last], [], 1.5, 10.5))
    assert sample("prompt_tokens_total", "7") == 20
    assert sample("generation_tokens_total", "7") == 2
    assert sample("iteration_tokens_total_sum", "7") == 22
    assert sample("request_success_total", "7", finished_reason="length") == 1
    assert sample("request_success_total", "7", finished_reason="stop") == 0  # there at 0
    assert sample("time_to_first_token_seconds_sum", "7") == 1.0
    assert sample("inter_token_latency_seconds_sum", "7") == 0.5
    assert sample("e2e_request_latency_seconds_sum", "7") == 1.5
    assert sample("request_queue_time_seconds_sum", "7") == 0.5
    assert sample("request_prefill_time_seconds_sum", "7") == 0.25
    assert sample("request_decode_time_seconds_sum", "7") == 0.5
    assert sample("request_inference_time_seconds_sum", "7") == 0.75
    assert sample("request_time_per_output_token_seconds_sum", "7") == 0.5
    assert sample("request_params_n_sum", "7") == 1
    assert sample("request_params_max_tokens_sum", "7") == 2
    assert sample("request_max_num_generation_tokens_sum", "7") == 2
    assert sample("request_prompt_tokens_bucket", "7", le="20.0") == 1
    assert sample("request_prompt_tokens_bucket", "7", le="10.0") == 0
    assert sample("request_prompt_tokens_bucket", "7", le="+Inf") == 1


def test_engine_totals_are_counted_by_one_api_server_only() -> None:
    stats = SchedulerStats(3, 1, 0.5, prefix_cache_queries=10, prefix_cache_hits=4)
    counting = StatLogger("m", 300, engine=8)
    other = StatLogger("m", 300, engine=9, count_engine_totals=False)
    for logger in (counting, other):
        logger.record_scheduler_stats(stats)
        logger.record_cache_config(CacheConfig(), 100)
    assert sample("prefix_cache_queries_total", "8") == 10
    assert sample("prefix_cache_queries_total", "9") == 0
    for engine in ("8", "9"):  # the gauges: both
        assert sample("num_requests_running", engine) == 3
        assert sample("kv_cache_usage_perc", engine) == 0.5
    info = REGISTRY.get_sample_value(
        "treadle:cache_config_info",
        {
            "block_size": "16",
            "enable_prefix_caching": "True",
            "kv_cache_memory_bytes": "None",
            "num_gpu_blocks": "100",
            "engine": "9",
        },
    )
    assert info == 1


def test_accepted_tokens_per_position_are_counted_by_position() -> None:
    """vLLM's `spec_decode_num_accepted_tokens_per_pos`: a counter per proposal position,
    fed from the engine's cumulative list as differences (a restarted engine's smaller
    totals add nothing)."""
    logger = StatLogger("m", 300, engine=11)
    name = "spec_decode_num_accepted_tokens_per_pos_total"
    logger.record_scheduler_stats(SchedulerStats(spec_decode_num_accepted_tokens_per_pos=[3, 1]))
    logger.record_scheduler_stats(SchedulerStats(spec_decode_num_accepted_tokens_per_pos=[5, 2, 0]))
    assert sample(name, "11", position="0") == 5
    assert sample(name, "11", position="1") == 2
    assert sample(name, "11", position="2") is None  # never accepted there yet
    logger.record_scheduler_stats(SchedulerStats(spec_decode_num_accepted_tokens_per_pos=[1]))
    assert sample(name, "11", position="0") == 5
