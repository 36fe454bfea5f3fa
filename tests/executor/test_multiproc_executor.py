"""Tensor parallelism: worker processes fed through the shared-memory MessageQueue."""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest

from treadle import LLM, SamplingParams
from treadle.frontend.core_client import EngineDeadError
from treadle.sampling_params import StructuredOutputsParams

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": list(range(100, 140))}]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
# Seeded sampling under a grammar, a logit bias and prompt logprobs: the bitmask goes to the
# workers in the broadcast, and each rank must sample the same token.
CONSTRAINED = SamplingParams(
    temperature=0.8,
    seed=7,
    max_tokens=24,
    logit_bias={5: 5.0, 9: -100.0},
    prompt_logprobs=1,
    structured_outputs=StructuredOutputsParams(regex="[a-z ]{4,20}"),
)


def _titles() -> list[str]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        if cmd and cmd[0].startswith("treadle::"):
            out.append(cmd[0].strip())
    return sorted(out)


def _pid(title: str) -> int:
    for p in psutil.Process().children(recursive=True):
        if p.cmdline() and p.cmdline()[0].strip() == title:
            return p.pid
    raise LookupError(title)


@pytest.fixture(scope="module")
def reference(tiny_model_factory) -> list:  # type: ignore[no-untyped-def, type-arg]
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32")
    try:
        return llm.generate(PROMPTS, PARAMS, use_tqdm=False) + llm.generate(
            PROMPTS, CONSTRAINED, use_tqdm=False
        )
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_a_single_rank(tiny_model_factory, reference, tp: int) -> None:  # type: ignore[no-untyped-def]
    """TP 4 > 2 KV heads also exercises replicated KV heads."""
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", tensor_parallel_size=tp)
    try:
        assert _titles() == sorted(
            ["treadle::EngineCore_DP0"] + [f"treadle::Worker_TP{r}" for r in range(tp)]
        )
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        outs += llm.generate(PROMPTS, CONSTRAINED, use_tqdm=False)
        for ours, ref in zip(outs, reference, strict=True):
            assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
            for a, b in zip(ours.prompt_logprobs or [], ref.prompt_logprobs or [], strict=True):
                assert (a is None) == (b is None)
                if a is not None and b is not None:
                    assert a.keys() == b.keys()
                    assert max(abs(a[k].logprob - b[k].logprob) for k in a) < 1e-4
            for a, b in zip(
                ours.outputs[0].logprobs or [], ref.outputs[0].logprobs or [], strict=True
            ):
                assert a.keys() == b.keys()
                assert max(abs(a[k].logprob - b[k].logprob) for k in a) < 1e-4
        for out in outs[len(PROMPTS) :]:
            assert re.fullmatch("[a-z ]{4,20}", out.outputs[0].text), out.outputs[0].text
            assert out.prompt_logprobs is not None
            assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        with pytest.raises(RuntimeError, match="Worker failed with error"):
            llm.collective_rpc("no_such_method")
        assert (
            llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
            == reference[0].outputs[0].token_ids
        )
    finally:
        llm.shutdown()
    assert _titles() == []


def test_a_layout_the_model_cannot_take_is_rejected_before_any_process(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="4 attention heads.*tensor_parallel_size 3"):
        LLM(str(tiny_model_factory("llama")), tensor_parallel_size=3)
    assert _titles() == []


def _segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("treadle")}


@pytest.mark.serial
def test_a_killed_worker_takes_the_engine_down_and_leaves_nothing(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    shm_before = _segments()
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", tensor_parallel_size=2)
    worker = _pid("treadle::Worker_TP1")
    os.kill(worker, signal.SIGKILL)
    said = rf"RuntimeError: .*Worker_TP1 \(pid {worker}\) died: killed by signal 9 \(SIGKILL\)"
    with pytest.raises(EngineDeadError, match=said):
        llm.generate(PROMPTS, SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
    deadline = time.monotonic() + 10
    while _titles() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _titles() == []
    llm.shutdown()
    assert _segments() <= shm_before


@pytest.mark.serial
def test_killing_the_engine_core_makes_every_worker_exit(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    shm_before = _segments()
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", tensor_parallel_size=2)
    workers = [psutil.Process(_pid(f"treadle::Worker_TP{r}")) for r in range(2)]
    os.kill(_pid("treadle::EngineCore_DP0"), signal.SIGKILL)
    gone, alive = psutil.wait_procs(workers, timeout=5)
    assert alive == []
    llm.shutdown()
    assert _segments() <= shm_before


def test_a_broadcast_larger_than_a_chunk_takes_the_overflow_path(
    tiny_model_factory,
    reference,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    """10 KiB chunks: a step with 8 new 400-token prompts no longer fits in one."""
    monkeypatch.setenv("TREADLE_MQ_MAX_CHUNK_BYTES_MB", "0.01")
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", tensor_parallel_size=2)
    try:
        long_prompts = [
            {"prompt_token_ids": [(7 * i + j) % 30000 + 10 for j in range(400)]} for i in range(8)
        ]
        outs = llm.generate(long_prompts + PROMPTS, PARAMS, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
        assert [o.outputs[0].token_ids for o in outs[-2:]] == [
            r.outputs[0].token_ids for r in reference[: len(PROMPTS)]
        ]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_default_model_tp3_gives_the_tokens_of_tp1(default_model_path: str) -> None:
    """SmolLM2-135M has 9 heads and 3 KV heads: TP 3 splits both evenly."""
    prompts = [{"prompt_token_ids": list(range(100 + 37 * i, 120 + 41 * i))} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    one = LLM(dtype="float32")
    try:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    finally:
        one.shutdown()
    three = LLM(dtype="float32", tensor_parallel_size=3)
    try:
        assert _titles() == ["treadle::EngineCore_DP0"] + [
            f"treadle::Worker_TP{r}" for r in range(3)
        ]
        got = [o.outputs[0].token_ids for o in three.generate(prompts, params, use_tqdm=False)]
    finally:
        three.shutdown()
    assert got == expected
