"""Prometheus metrics of the front end: vLLM v1's names, types, buckets and labels
(`vllm/v1/metrics/loggers.py`, `PrometheusStatLogger`) under the `treadle:` prefix, plus
treadle's own engine-restart counters.

With several API servers (`--api-server-count`), each writes its values to
`PROMETHEUS_MULTIPROC_DIR` (set by the supervisor) and `/metrics` in any of them reports the
sum over all (gauges: the most recent value). Each API server counts its own requests (token
counters and the per-request histograms, from `request_stats.IterationStats`), so their sum is
the server's. Scheduler gauges and the engine-wide counters (preemptions, prefix cache) come
from the `SchedulerStats` the engine core sends with its outputs; they are cumulative there,
so they are added here as differences, by API server 0 alone (every API server receives them).
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from treadle.config import CacheConfig
from treadle.frontend.request_stats import IterationStats
from treadle.wire.engine import FinishReason, SchedulerStats

PREFIX = "treadle:"
LABELS = ["model_name", "engine"]
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N_BUCKETS = [1, 2, 5, 10, 20]
# vLLM's `cache_config_info` labels that treadle has (`num_gpu_blocks`: the KV blocks, on any
# device), and the engine.
CACHE_INFO_LABELS = [
    "block_size",
    "enable_prefix_caching",
    "kv_cache_memory_bytes",
    "num_gpu_blocks",
    "engine",
]


IMAGE_BUCKETS = [1, 2, 4, 8, 16, 32]
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
"""vLLM's `prompt_tokens_by_source` labels."""


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def _definitions(max_model_len: int) -> dict[str, Any]:
    tokens = build_1_2_5_buckets(max_model_len)

    def gauge(name: str, doc: str, labels: list[str] = LABELS) -> Gauge:
        return Gauge(PREFIX + name, doc, labels, multiprocess_mode="mostrecent")

    def counter(name: str, doc: str, labels: list[str] = LABELS) -> Counter:
        return Counter(PREFIX + name, doc, labels)

    def histogram(name: str, doc: str, buckets: list[Any]) -> Histogram:
        return Histogram(PREFIX + name, doc, LABELS, buckets=buckets)

    return dict(
        running=gauge("num_requests_running", "Number of requests in model execution batches."),
        waiting=gauge("num_requests_waiting", "Number of requests waiting to be processed."),
        kv_usage=gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
        cache_info=gauge(
            "cache_config_info", "Information of the LLMEngine CacheConfig", CACHE_INFO_LABELS
        ),
        prefix_queries=counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        ),
        prefix_hits=counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ),
        preemptions=counter("num_preemptions", "Cumulative number of preemption from the engine."),
        spec_drafts=counter("spec_decode_num_drafts", "Number of spec decoding drafts."),
        mm_images_encoded=counter(
            "mm_encoder_images", "Images the vision encoder ran on (a vision-language model)."
        ),
        mm_encoder_cache_hits=counter(
            "mm_encoder_cache_hits", "Images whose features came from the encoder cache instead."
        ),
        mm_encoder_seconds=counter("mm_encoder_seconds", "Seconds the vision encoder ran."),
        spec_draft_tokens=counter("spec_decode_num_draft_tokens", "Number of draft tokens."),
        spec_accepted=counter("spec_decode_num_accepted_tokens", "Number of accepted tokens."),
        spec_accepted_per_pos=counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*LABELS, "position"],
        ),
        prompt_tokens=counter("prompt_tokens", "Number of prefill tokens processed."),
        prompt_tokens_by_source=counter(
            "prompt_tokens_by_source", "Number of prompt tokens by source.", [*LABELS, "source"]
        ),
        prompt_tokens_cached=counter(
            "prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        ),
        prompt_tokens_recomputed=counter(
            "prompt_tokens_recomputed", "Number of cached tokens recomputed for forward pass."
        ),
        mm_cache_queries=counter(
            "mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."
        ),
        mm_cache_hits=counter(
            "mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."
        ),
        generation_tokens=counter("generation_tokens", "Number of generation tokens processed."),
        success=counter(
            "request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
        ),
        prompt_tokens_request=histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", tokens
        ),
        generation_tokens_request=histogram(
            "request_generation_tokens", "Number of generation tokens processed.", tokens
        ),
        iteration_tokens=histogram(
            "iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        ),
        max_num_generation_tokens=histogram(
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        ),
        n_request=histogram("request_params_n", "Histogram of the n request parameter.", N_BUCKETS),
        images_request=histogram(
            "request_images", "Images in a finished request's prompt.", IMAGE_BUCKETS
        ),
        max_tokens_request=histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        ),
        prefill_kv_computed=histogram(
            "request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens,
        ),
        ttft=histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        ),
        itl=histogram(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        ),
        tpot_request=histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        ),
        e2e=histogram(
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        ),
        queue_time=histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ),
        inference_time=histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ),
        prefill_time=histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ),
        decode_time=histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ),
        lora_info=Gauge(
            PREFIX + "lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            multiprocess_mode="mostrecent",
        ),
        # treadle's own: engine cores restarted after a death (issue 14).
        restarts=counter("engine_restarts", "Engine core restarts after a death or a stall"),
        resumed=counter("requests_resumed", "Requests resumed on a restarted engine core"),
        poisoned=counter(
            "requests_failed_poison",
            "Requests failed because the engine core died twice while running them",
        ),
    )


_metrics: dict[str, Any] = {}
_made_for: list[int] = []  # the max_model_len of the token-count buckets


def _registry(max_model_len: int) -> dict[str, Any]:
    """The metric objects of this process (prometheus_client registers them globally): made
    once, or again (as vLLM does) for a model of another length."""
    if _made_for != [max_model_len]:
        for metric in _metrics.values():
            REGISTRY.unregister(metric)
        _metrics.clear()
        _metrics.update(_definitions(max_model_len))
        _made_for[:] = [max_model_len]
    return _metrics


class StatLogger:
    """One engine's metrics as this front end sees them. `count_engine_totals=False` skips
    the engine's cumulative counters (preemptions, prefix cache) and restarts: with several
    API servers they reach every one of them, and only one may add them up."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        engine: int = 0,
        count_engine_totals: bool = True,
        max_loras: int | None = None,
    ) -> None:
        """`max_loras`: --max-loras with --enable-lora (vLLM's `lora_requests_info` then)."""
        m = _registry(max_model_len)
        self.engine = str(engine)
        self.count_engine_totals = count_engine_totals
        labels = {"model_name": model_name, "engine": self.engine}
        self.m = {
            key: metric.labels(**labels)
            for key, metric in m.items()
            if key
            not in (
                "success",
                "cache_info",
                "spec_accepted_per_pos",
                "prompt_tokens_by_source",
                "lora_info",
            )
        }
        # vLLM's sources; nothing arrives over a KV connector here, so the last stays at 0.
        self.by_source = {
            source: m["prompt_tokens_by_source"].labels(**labels, source=source)
            for source in PROMPT_SOURCES
        }
        self.labels = labels
        self.spec_per_pos = m["spec_accepted_per_pos"]
        # Every finish reason is there from the start, at 0 (as vLLM's).
        self.success = {
            str(r): m["success"].labels(**labels, finished_reason=str(r)) for r in FinishReason
        }
        self.cache_info = m["cache_info"]
        self.lora_info = m["lora_info"]
        self.max_loras = max_loras
        self._last = SchedulerStats()

    def record_cache_config(self, cache: CacheConfig, num_blocks: int) -> None:
        """vLLM's `cache_config_info`: a gauge at 1 whose labels are the config."""
        self.cache_info.labels(
            block_size=str(cache.block_size),
            enable_prefix_caching=str(cache.enable_prefix_caching),
            kv_cache_memory_bytes=str(cache.kv_cache_memory),
            num_gpu_blocks=str(num_blocks),
            engine=self.engine,
        ).set(1)

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.m["running"].set(stats.num_running_reqs)
        self.m["waiting"].set(stats.num_waiting_reqs)
        self.m["kv_usage"].set(stats.kv_cache_usage)
        if not self.count_engine_totals:
            return
        for name, attr in (
            ("preemptions", "num_preemptions"),
            ("prefix_queries", "prefix_cache_queries"),
            ("prefix_hits", "prefix_cache_hits"),
            ("spec_drafts", "spec_decode_num_drafts"),
            ("spec_draft_tokens", "spec_decode_num_draft_tokens"),
            ("spec_accepted", "spec_decode_num_accepted_tokens"),
            ("mm_images_encoded", "mm_images_encoded"),
            ("mm_encoder_cache_hits", "mm_encoder_cache_hits"),
            ("mm_encoder_seconds", "mm_encoder_seconds"),
        ):
            delta = getattr(stats, attr) - getattr(self._last, attr)
            if delta > 0:
                self.m[name].inc(delta)
        # vLLM's multimodal cache, here the vision encoder's: each image asks it once.
        hits = stats.mm_encoder_cache_hits - self._last.mm_encoder_cache_hits
        queries = hits + stats.mm_images_encoded - self._last.mm_images_encoded
        if queries > 0:
            self.m["mm_cache_queries"].inc(queries)
        if hits > 0:
            self.m["mm_cache_hits"].inc(hits)
        last = self._last.spec_decode_num_accepted_tokens_per_pos
        for pos, total in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            delta = total - (last[pos] if pos < len(last) else 0)
            if delta > 0:
                self.spec_per_pos.labels(**self.labels, position=str(pos)).inc(delta)
        self._last = stats

    def retire(self) -> None:
        """The engine was removed (`POST /scale`): it runs nothing and holds no KV cache. Its
        counters keep their totals (a sum over engines must not drop)."""
        for gauge in ("running", "waiting", "kv_usage"):
            self.m[gauge].set(0)

    def record_event(self, kind: str, count: int) -> None:
        """An engine restart event: "restarted", "resumed" or "poisoned" (requests)."""
        if kind == "restarted" and not self.count_engine_totals:
            return  # every API server sees a restart; only one counts it
        name = {"restarted": "restarts", "resumed": "resumed", "poisoned": "poisoned"}[kind]
        self.m[name].inc(count)

    def record_iteration(self, it: IterationStats) -> None:
        m = self.m
        if self.max_loras is not None and it.lora_running is not None:
            # vLLM's: a series per combination of adapters, its value the time last seen.
            self.lora_info.labels(
                max_lora=str(self.max_loras),
                waiting_lora_adapters=",".join(it.lora_waiting or ()),
                running_lora_adapters=",".join(it.lora_running),
            ).set_to_current_time()
        if it.num_tokens == 0 and not it.finished_requests:
            return
        if it.num_prompt_tokens:
            m["prompt_tokens"].inc(it.num_prompt_tokens)
            self.by_source["local_compute"].inc(it.prompt_computed)
            self.by_source["local_cache_hit"].inc(it.prompt_local_cache_hit)
            m["prompt_tokens_cached"].inc(it.prompt_cached)
            m["prompt_tokens_recomputed"].inc(it.prompt_recomputed)
        if it.num_generation_tokens:
            m["generation_tokens"].inc(it.num_generation_tokens)
        if it.num_tokens:
            m["iteration_tokens"].observe(it.num_tokens)
        for value in it.time_to_first_tokens:
            m["ttft"].observe(value)
        for value in it.inter_token_latencies:
            m["itl"].observe(value)
        for n in it.n_params:
            m["n_request"].observe(n)
        for tokens in it.max_num_generation_tokens:
            m["max_num_generation_tokens"].observe(tokens)
        for done in it.finished_requests:
            self.success[done.finish_reason].inc()
            m["e2e"].observe(done.e2e_latency)
            m["prompt_tokens_request"].observe(done.num_prompt_tokens)
            m["generation_tokens_request"].observe(done.num_generation_tokens)
            m["prefill_kv_computed"].observe(done.num_prompt_tokens - done.num_cached_tokens)
            if done.num_images:
                m["images_request"].observe(done.num_images)
            if done.max_tokens_param:
                m["max_tokens_request"].observe(done.max_tokens_param)
            if done.queued_time is None:
                continue  # ended before its first token: its phases are unknown
            m["queue_time"].observe(done.queued_time)
            m["prefill_time"].observe(done.prefill_time)
            m["decode_time"].observe(done.decode_time)
            m["inference_time"].observe(done.inference_time)
            m["tpot_request"].observe(done.mean_time_per_output_token)


def render_metrics() -> bytes:
    """The Prometheus text of this process, or of all API servers in multiprocess mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest()
