"""`LLM(**kwargs)` takes vLLM's engine arguments: vLLM's names and aliases work, those without
meaning here log one warning each, an unknown one raises `TypeError` naming the closest."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import psutil
import pytest

from treadle import LLM, SamplingParams


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    handler = _Lines()
    log = logging.getLogger("treadle.entrypoints.llm")
    log.addHandler(handler)
    yield handler.lines
    log.removeHandler(handler)


def test_vllm_kwargs_work_with_a_warning_each(tiny_model_factory, warnings: list[str]) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(
        model=str(tiny_model_factory("llama")),
        gpu_memory_utilization=0.5,
        enforce_eager=True,
        max_num_seqs=8,
        kv_cache_memory_bytes=1 << 22,
        dtype="half",  # vLLM's name of float16: runs on the PyTorch paths on the CPU
        max_model_len=64,
    )
    try:
        assert llm.config.scheduler.max_num_seqs == 8
        assert llm.config.cache.kv_cache_memory == 1 << 22
        assert [w.split(" has no effect")[0] for w in warnings] == [
            "LLM: gpu_memory_utilization",
            "LLM: enforce_eager",
        ]
        out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_unknown_or_refused_kwargs_fail_before_anything_starts(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(TypeError, match="'max_num_seq'; did you mean 'max_num_seqs'"):
        LLM(str(tiny_model_factory("llama")), max_num_seq=8)
    with pytest.raises(ValueError, match='"draft_model" needs "model"'):
        LLM(str(tiny_model_factory("llama")), speculative_config={"method": "draft_model"})
    assert set(psutil.Process().children(recursive=True)) <= before


def test_request_output_metrics(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", max_model_len=64, max_num_seqs=1)
    try:
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        first, second = llm.generate(["Hello", "Hi there"], params, use_tqdm=False)
    finally:
        llm.shutdown()
    for out in (first, second):
        m = out.metrics
        assert m is not None and m.num_generation_tokens == 5
        assert m.first_token_time is not None and m.last_token_time is not None
        assert m.finished_time is not None
        assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
        assert m.first_token_latency is not None and m.first_token_latency > 0
        assert m.time_in_queue is not None and m.time_in_queue >= 0
        assert m.prefill_time is not None and m.prefill_time > 0
    # max_num_seqs 1: the second request waited for the whole first one.
    assert second.metrics is not None and first.metrics is not None
    assert second.metrics.time_in_queue is not None and first.metrics.time_in_queue is not None
    assert second.metrics.time_in_queue > first.metrics.time_in_queue
