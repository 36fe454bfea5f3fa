"""The vLLM metric names added for issue 42 (`prompt_tokens_by_source`, `prompt_tokens_cached`,
`prompt_tokens_recomputed`, `request_prefill_kv_computed_tokens`, `mm_cache_queries`,
`mm_cache_hits`, `lora_requests_info`) are served with vLLM's types and labels and move as
vLLM's do; an embedding request counts its prompt as vLLM's pooling requests do."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_helpers import RemoteServer
from treadle.frontend.metrics import StatLogger
from treadle.frontend.request_stats import IterationStats, RequestStats
from treadle.wire.engine import EngineCoreOutput, SchedulerStats

MODEL = "tiny"
ENGINE = {"model_name", "engine"}
ADDED: dict[str, tuple[str, set[str]]] = {
    "prompt_tokens_by_source": ("counter", ENGINE | {"source"}),
    "prompt_tokens_cached": ("counter", ENGINE),
    "prompt_tokens_recomputed": ("counter", ENGINE),
    "request_prefill_kv_computed_tokens": ("histogram", ENGINE),
    "mm_cache_queries": ("counter", ENGINE),
    "mm_cache_hits": ("counter", ENGINE),
}
PROMPT = list(range(1000, 1033))  # 33 token ids: two whole blocks of 16 and one token


@pytest.fixture(scope="module")
def server(lora_base: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    from lora_helpers import make_adapter

    adapter = make_adapter(lora_base, tmp_path_factory.mktemp("a") / "a1", 4, ["q_proj"], seed=1)
    srv = RemoteServer(
        [str(lora_base), "--served-model-name", MODEL, "--enable-lora", "--max-loras", "2"]
        + ["--lora-modules", f"a1={adapter}"],
        tmp_path_factory.mktemp("metrics-added"),
    )
    yield srv
    srv.stop()


def _values(
    server: RemoteServer,
) -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """family -> (sample name, labels) -> value, for treadle's families."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("treadle:"):
            name = family.name.removeprefix("treadle:")
            out[name] = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
            out[name][("type", ())] = {"counter": 0, "gauge": 1, "histogram": 2}[family.type]
    return out


def _sum(values: dict[str, dict], name: str, suffix: str, **labels: str) -> float:  # type: ignore[type-arg]
    return sum(
        v
        for (sample, key), v in values[name].items()
        if sample.endswith(suffix) and labels.items() <= dict(key).items()
    )


def _post(server: RemoteServer, path: str, body: dict[str, object]) -> dict[str, object]:
    resp = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def test_added_names_are_served_and_move_as_vllms(server: RemoteServer) -> None:
    before = _values(server)
    for name, (kind, labels) in ADDED.items():
        assert name in before, f"{name} is not served"
        assert before[name][("type", ())] == {"counter": 0, "histogram": 2}[kind], name
        for (sample, key), _ in before[name].items():
            if sample != "type":
                assert {k for k, _ in key} - {"le"} == labels, (name, key)
    sources = {dict(k).get("source") for s, k in before["prompt_tokens_by_source"] if s != "type"}
    assert sources == {"local_compute", "local_cache_hit", "external_kv_transfer"}

    body = {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
    _post(server, "/v1/completions", body)  # cold: all 33 computed
    _post(server, "/v1/completions", body)  # warm: 32 from the prefix cache, 1 computed
    after = _values(server)

    def moved(name: str, suffix: str = "_total", **labels: str) -> float:
        return _sum(after, name, suffix, **labels) - _sum(before, name, suffix, **labels)

    assert moved("prompt_tokens_by_source", source="local_compute") == 33 + 1
    # vLLM's accounting: a prompt cached but its last token counts that token as a cache
    # hit recomputed (33 = 32 cached + 1 recomputed).
    assert moved("prompt_tokens_by_source", source="local_cache_hit") == 33
    assert moved("prompt_tokens_by_source", source="external_kv_transfer") == 0
    assert moved("prompt_tokens_cached") == 32
    assert moved("prompt_tokens_recomputed") == 1
    assert moved("request_prefill_kv_computed_tokens", "_count") == 2
    assert moved("request_prefill_kv_computed_tokens", "_sum") == 33 + 1
    assert moved("prompt_tokens") == 66


def test_an_embedding_request_counts_its_prompt(server: RemoteServer) -> None:
    before = _values(server)
    out = _post(server, "/v1/embeddings", {"input": "an embedding of a few words"})
    tokens = out["usage"]["prompt_tokens"]  # type: ignore[index]
    after = _values(server)

    def moved(name: str, suffix: str = "_total", **labels: str) -> float:
        return _sum(after, name, suffix, **labels) - _sum(before, name, suffix, **labels)

    assert tokens > 0
    assert moved("prompt_tokens") == tokens
    assert moved("prompt_tokens_by_source", source="local_compute") == tokens
    assert moved("request_success", finished_reason="stop") == 1
    assert moved("request_prompt_tokens", "_sum") == tokens
    assert moved("request_prefill_kv_computed_tokens", "_sum") == tokens
    assert moved("e2e_request_latency_seconds", "_count") == 1
    assert moved("time_to_first_token_seconds", "_count") == 0  # no token: no first token
    assert moved("generation_tokens") == 0


def test_lora_requests_info_names_the_adapters_in_flight(server: RemoteServer) -> None:
    info = "lora_requests_info"
    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    resp = httpx.post(server.url + "/v1/completions", json={**body, "model": "a1"}, timeout=60)
    assert resp.status_code == 200, resp.text
    values = _values(server)
    assert values[info][("type", ())] == 1  # a gauge
    series = [dict(key) for sample, key in values[info] if sample != "type"]
    assert all(
        set(s) == {"max_lora", "waiting_lora_adapters", "running_lora_adapters"} for s in series
    )
    assert all(s["max_lora"] == "2" for s in series)
    assert any(s["running_lora_adapters"] == "a1" for s in series), series  # while it ran
    stamps = [v for (sample, _), v in values[info].items() if sample != "type"]
    assert max(stamps) > 1.7e9  # vLLM's value: the time the combination was last seen


def test_the_multimodal_cache_counters_follow_the_vision_encoder() -> None:
    logger = StatLogger("mm-test", 64)

    def value(key: str) -> float:
        return float(logger.m[key]._value.get())

    logger.record_scheduler_stats(SchedulerStats(mm_images_encoded=3, mm_encoder_cache_hits=1))
    assert (value("mm_cache_queries"), value("mm_cache_hits")) == (4, 1)
    logger.record_scheduler_stats(SchedulerStats(mm_images_encoded=3, mm_encoder_cache_hits=4))
    assert (value("mm_cache_queries"), value("mm_cache_hits")) == (7, 4)


def test_a_pooling_output_reads_the_prompt_once() -> None:
    it = IterationStats(now=1.0, engine_ts=1.0)
    stats = RequestStats(arrival=0.0, num_prompt_tokens=20, max_tokens=1)
    out = EngineCoreOutput("r", [], num_cached_tokens=16)
    it.update_from_output(stats, out)
    assert it.num_prompt_tokens == 0  # no token and no result yet: the prompt is not read
    out.pooled = __import__("torch").zeros(4)
    it.update_from_output(stats, out)
    it.update_from_output(stats, out)
    assert (it.num_prompt_tokens, it.prompt_computed, it.prompt_cached) == (20, 4, 16)
    assert it.time_to_first_tokens == []
