"""`/metrics` has vLLM v1's metrics (names under `treadle:`, types, labels, bucket edges) and
they fill as requests run; the engine core logs vLLM's periodic stats line within 6 s of load,
and its start-up facts; the Grafana dashboard asks for what is there. One server on the tiny
model for all of it."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_helpers import RemoteServer

MODEL = "tiny"
MAX_MODEL_LEN = 512  # the tiny model's limit
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # full blocks: prefix cache hits
ENGINE = {"model_name", "engine"}

# vLLM v1's PrometheusStatLogger (vllm/v1/metrics/loggers.py): name -> (type, label names).
# Counters are listed without `_total` (prometheus_client's family names).
VLLM_METRICS: dict[str, tuple[str, set[str]]] = {
    "num_requests_running": ("gauge", ENGINE),
    "num_requests_waiting": ("gauge", ENGINE),
    "kv_cache_usage_perc": ("gauge", ENGINE),
    "prefix_cache_queries": ("counter", ENGINE),
    "prefix_cache_hits": ("counter", ENGINE),
    "num_preemptions": ("counter", ENGINE),
    "prompt_tokens": ("counter", ENGINE),
    "generation_tokens": ("counter", ENGINE),
    "request_success": ("counter", ENGINE | {"finished_reason"}),
    "request_prompt_tokens": ("histogram", ENGINE),
    "request_generation_tokens": ("histogram", ENGINE),
    "iteration_tokens_total": ("histogram", ENGINE),
    "request_max_num_generation_tokens": ("histogram", ENGINE),
    "request_params_n": ("histogram", ENGINE),
    "request_params_max_tokens": ("histogram", ENGINE),
    "time_to_first_token_seconds": ("histogram", ENGINE),
    "inter_token_latency_seconds": ("histogram", ENGINE),
    "request_time_per_output_token_seconds": ("histogram", ENGINE),
    "e2e_request_latency_seconds": ("histogram", ENGINE),
    "request_queue_time_seconds": ("histogram", ENGINE),
    "request_inference_time_seconds": ("histogram", ENGINE),
    "request_prefill_time_seconds": ("histogram", ENGINE),
    "request_decode_time_seconds": ("histogram", ENGINE),
}
# vLLM's bucket edges (the token counts: 1-2-5 up to max_model_len).
TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
LATENCY += [120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
ITL += [20.0, 40.0, 80.0]
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5]
TTFT += [10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
BUCKETS = {
    "request_prompt_tokens": TOKENS,
    "request_generation_tokens": TOKENS,
    "request_max_num_generation_tokens": TOKENS,
    "request_params_max_tokens": TOKENS,
    "request_params_n": [1, 2, 5, 10, 20],
    "iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "time_to_first_token_seconds": TTFT,
    "inter_token_latency_seconds": ITL,
    "request_time_per_output_token_seconds": ITL,
    **{
        f"request_{phase}_time_seconds": LATENCY
        for phase in ("queue", "inference", "prefill", "decode")
    },
    "e2e_request_latency_seconds": LATENCY,
}
# vLLM's cache_config_info labels that treadle has.
CACHE_INFO = {"block_size", "enable_prefix_caching", "kv_cache_memory_bytes", "num_gpu_blocks"}


@pytest.fixture(scope="module")
def loaded(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Iterator:  # type: ignore[no-untyped-def,type-arg]
    """The server, and how many seconds after its load began the first stats line came."""
    server = RemoteServer(
        [str(tiny_model_factory("llama")), "--served-model-name", MODEL],
        tmp_path_factory.mktemp("metrics"),
        env={"TREADLE_LOGGING_LEVEL": "INFO"},
    )
    try:
        yield server, _load_until_stats_line(server)
    finally:
        server.stop()


def _complete(server: RemoteServer, **extra: object) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
    resp = httpx.post(server.url + "/v1/completions", json={**body, **extra}, timeout=60)
    assert resp.status_code == 200, resp.text


def _load_until_stats_line(server: RemoteServer, limit: float = 8.0) -> float:
    """Send requests one after another (one with n=2) until the periodic line is logged."""
    done = threading.Event()

    def load() -> None:
        _complete(server, n=2)
        while not done.is_set():
            _complete(server)

    start = time.monotonic()
    sender = threading.Thread(target=load)
    sender.start()
    try:
        while time.monotonic() - start < limit:
            if "Avg prompt throughput" in server.output():
                return time.monotonic() - start
            time.sleep(0.1)
        return float("inf")
    finally:
        done.set()
        sender.join()


def _families(server: RemoteServer) -> dict[str, object]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        f.name.removeprefix("treadle:"): f
        for f in text_string_to_metric_families(text)
        if f.name.startswith("treadle:")
    }


def test_the_periodic_stats_line_comes_within_6_s_of_load(loaded) -> None:  # type: ignore[no-untyped-def]
    server, seconds = loaded
    assert seconds <= 6.0, server.output()[-3000:]
    line = re.search(r"\(EngineCore_DP0 pid=\d+\).*(Engine 000: Avg prompt .*)", server.output())
    assert line, server.output()[-3000:]
    assert re.fullmatch(
        r"Engine 000: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: "
        r"[\d.]+ tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, (Preemptions: \d+, )?"
        r"KV cache usage: [\d.]+%, Prefix cache hit rate: [\d.]+%",
        line.group(1),
    )


def test_start_up_facts_are_logged(loaded) -> None:  # type: ignore[no-untyped-def]
    log = loaded[0].output()
    assert re.search(rf"\(APIServer_0 pid=\d+\).* as '{MODEL}'", log)
    assert re.search(r"\(EngineCore_DP0 pid=\d+\).*KV cache size: [\d,]+ tokens \([\d.]+ GiB", log)
    assert re.search(
        rf"\(EngineCore_DP0 pid=\d+\).*Maximum concurrency for {MAX_MODEL_LEN} tokens per "
        r"request: [\d.]+x",
        log,
    )
    assert re.search(
        r"Model runs on .*(avx512vnni|avx512|avx2vnni|avx2|portable|PyTorch).* with \d+ threads",
        log,
    )


def test_vllm_metrics_have_vllms_types_labels_and_buckets(loaded) -> None:  # type: ignore[no-untyped-def]
    families = _families(loaded[0])
    missing = sorted(set(VLLM_METRICS) - set(families))
    assert not missing, f"missing: {missing}"
    for name, (kind, labels) in VLLM_METRICS.items():
        family = families[name]
        assert family.type == kind, name  # type: ignore[attr-defined]
        samples = family.samples  # type: ignore[attr-defined]
        assert samples, name
        for sample in samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample)
            assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0"
        if kind == "histogram":
            count = sum(s.value for s in samples if s.name.endswith("_count"))
            assert count > 0, f"{name} has no observations"
            edges = [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")]
            assert edges == [*map(float, BUCKETS[name]), float("inf")], name
    info = families["cache_config_info"]
    assert info.type == "gauge"  # type: ignore[attr-defined]
    (sample,) = info.samples  # type: ignore[attr-defined]
    assert CACHE_INFO | {"engine"} <= set(sample.labels) and sample.value == 1
    assert sample.labels["block_size"] == "16" and int(sample.labels["num_gpu_blocks"]) > 0


def test_the_metrics_agree_with_each_other(loaded) -> None:  # type: ignore[no-untyped-def]
    families = _families(loaded[0])

    def value(name: str, suffix: str = "", **labels: str) -> float:
        return sum(
            s.value
            for s in families[name].samples  # type: ignore[attr-defined]
            if s.name.endswith(suffix) and labels.items() <= s.labels.items()
        )

    finished = value("request_success", "_total", finished_reason="length")
    assert finished >= 3 and value("request_success", "_total") == finished
    assert value("e2e_request_latency_seconds", "_count") == finished
    assert value("request_params_n", "_count") == finished - 1  # the n=2 request counts once
    assert value("request_params_n", "_sum") == finished  # n: 2 + 1 + 1 + ...
    assert value("request_generation_tokens", "_sum") == 8 * finished
    assert value("generation_tokens", "_total") == 8 * finished
    assert value("request_prompt_tokens", "_sum") == value("prompt_tokens", "_total")
    assert value("inter_token_latency_seconds", "_count") == 7 * finished
    inference = value("request_inference_time_seconds", "_sum")
    phases = value("request_prefill_time_seconds", "_sum") + value(
        "request_decode_time_seconds", "_sum"
    )
    assert inference == pytest.approx(phases, rel=1e-6)
    assert value("prefix_cache_queries", "_total") >= value("prefix_cache_hits", "_total") > 0


def test_the_grafana_dashboard_queries_what_treadle_serves(loaded) -> None:  # type: ignore[no-untyped-def]
    path = Path(__file__).parents[2] / "docs" / "grafana" / "treadle-dashboard.json"
    dashboard = json.loads(path.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    targets = [t for p in panels for t in p["targets"]]
    for item in [*panels, *targets]:
        assert item["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    exprs = " ".join(t["expr"] for t in targets)
    for name in [*VLLM_METRICS, "cache_config_info"]:
        assert f"treadle:{name}" in exprs, f"no panel for {name}"
    text = httpx.get(loaded[0].url + "/metrics", timeout=10).text
    served = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert set(re.findall(r"treadle:\w+", exprs)) <= served
