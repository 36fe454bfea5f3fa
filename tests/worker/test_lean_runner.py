"""The lean runner (`worker/lean_worker.py`, `lean_runner.py`, `model/lean_model.py`): the
default model without PyTorch in the engine core, the same tokens as the torch runner, and the
start-time choice between the two."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from treadle import LLM, SamplingParams
from treadle.config import EngineConfig, LoRAConfig, SpeculativeConfig
from treadle.engine_args import EngineArgs
from treadle.model import kernel_lib
from treadle.sampling_params import StructuredOutputsParams
from treadle.worker.lean_worker import lean_refusal

pytestmark = pytest.mark.skipif(
    kernel_lib.select_isa() == "portable",
    reason="the lean runner needs a kernel level with GGUF-block products (not portable); "
    "runs wherever the CPU has AVX2 or better",
)

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea. The sea",
    # long enough to be prefilled in several chunks at max_num_batched_tokens=64
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker "
    "who repaired every clock in the valley. One winter morning a stranger arrived with a "
    "broken pocket watch, and the clockmaker, turning it over in his hands, noticed that",
]


def _engine(lean: bool, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> LLM:
    monkeypatch.setenv("TREADLE_ENABLE_MULTIPROCESSING", "0")
    monkeypatch.setenv("TREADLE_LEAN_RUNNER", "1" if lean else "0")
    kwargs.setdefault("max_num_batched_tokens", 64)
    kwargs.setdefault("kv_cache_memory_bytes", 64 << 20)
    kwargs.setdefault("max_model_len", 1024)
    llm = LLM(None, **kwargs)
    worker = llm.engine.engine_core.executor.worker  # type: ignore[union-attr]
    assert type(worker).__name__ == ("LeanWorker" if lean else "Worker")
    return llm


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, Any]]:
    """Each runner's outputs for the same requests (two engines, one after the other)."""
    results: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as mp:
        for name, lean in (("lean", True), ("torch", False)):
            llm = _engine(lean, mp)
            greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
            seeded = [
                SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=16)
                for i in range(len(PROMPTS))
            ]
            scored = SamplingParams(max_tokens=1, prompt_logprobs=2)
            results[name] = {
                "greedy": llm.generate(PROMPTS, greedy, use_tqdm=False),
                "seeded": llm.generate(PROMPTS, seeded, use_tqdm=False),
                "scored": llm.generate(PROMPTS[1], scored, use_tqdm=False)[0],
                "embed": llm.embed(PROMPTS[:2], use_tqdm=False),
            }
            llm.shutdown()
    yield results


def test_greedy_tokens_are_the_torch_runners(runs: dict[str, Any]) -> None:
    """Mixed steps (prompts chunked at 64 tokens beside decodes), 24 tokens each: the same
    tokens, and logprobs within float rounding of the torch runner's."""
    for lean, torch_out in zip(runs["lean"]["greedy"], runs["torch"]["greedy"], strict=True):
        a, b = lean.outputs[0], torch_out.outputs[0]
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            chosen = a.token_ids[a.logprobs.index(x)]
            assert x[chosen].logprob == pytest.approx(y[chosen].logprob, abs=2e-3)


def test_seeded_sampling_is_the_torch_runners(runs: dict[str, Any]) -> None:
    """The same draws (MT19937 seeded as PyTorch's generator) over the same distributions."""
    lean = [o.outputs[0].token_ids for o in runs["lean"]["seeded"]]
    torch_ = [o.outputs[0].token_ids for o in runs["torch"]["seeded"]]
    assert lean == torch_


def test_prompt_logprobs_and_embeddings_match(runs: dict[str, Any]) -> None:
    a, b = runs["lean"]["scored"].prompt_logprobs, runs["torch"]["scored"].prompt_logprobs
    assert len(a) == len(b) > 5
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x.keys() == y.keys()
        for token in x:
            assert x[token].logprob == pytest.approx(y[token].logprob, abs=2e-3)
            assert x[token].rank == y[token].rank
    for x, y in zip(runs["lean"]["embed"], runs["torch"]["embed"], strict=True):
        u, v = np.array(x.outputs.embedding), np.array(y.outputs.embedding)
        assert float(u @ v) > 0.9999


def test_speculation_and_grammar_on_the_lean_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    """n-gram speculation gives the tokens plain decoding gives, under a JSON schema too
    (each verified position masked by its own bitmask row), and the schema holds."""
    prompt = "one two three four, one two three four, one two three four, one two"
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    constrained = SamplingParams(
        temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=schema)
    )
    asked = "Describe a person as JSON: {name: Bob, age: 7}, {name: Bob, age: 7}, again:"
    got = {}
    for name, spec in (
        ("plain", None),
        ("ngram", {"method": "ngram", "num_speculative_tokens": 4}),
    ):
        llm = _engine(True, monkeypatch, speculative_config=spec)
        outs = llm.generate([prompt, asked], [greedy, constrained], use_tqdm=False)
        got[name] = [o.outputs[0] for o in outs]
        if spec:
            assert llm.engine.engine_core.scheduler.spec_accepted_tokens > 0  # type: ignore[union-attr]
        llm.shutdown()
    assert [o.token_ids for o in got["ngram"]] == [o.token_ids for o in got["plain"]]
    value = json.loads(got["ngram"][1].text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


@pytest.mark.parametrize("kv", ["int8", "float16"])
def test_a_smaller_kv_cache_gives_the_torch_runners_tokens(
    kv: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--kv-cache-dtype int8|float16` on the lean runner: the C kernels' rows (int8: values
    and a float32 scale), a quarter or half the bytes a token, the torch runner's tokens. With
    int8 the runners' prefills differ in the last bits (the torch runner's goes through its
    modules) and a row's rounding to int8 can turn that into a step of 1/127 of its largest
    value: the 64-token-chunked prompt's tokens part after 20 (measured 2026-12-05), so int8
    is held to its first 16 tokens; float16 to all of them."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = {}
    for lean in (True, False):
        llm = _engine(lean, monkeypatch, kv_cache_dtype=kv)
        worker = llm.engine.engine_core.executor.worker  # type: ignore[union-attr]
        per_token = worker.kv_bytes_per_block() // 16
        assert per_token == 30 * 2 * 3 * (64 + 4 if kv == "int8" else 128)
        got[lean] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        llm.shutdown()
    if kv == "int8":
        assert [t[:16] for t in got[True]] == [t[:16] for t in got[False]]
    else:
        assert got[True] == got[False]


def _config(**kwargs: Any) -> EngineConfig:
    kwargs.setdefault("model", None)
    args, _ = EngineArgs.from_kwargs(**kwargs)
    return args.create_engine_config()


def test_the_start_time_choice_names_its_reason(
    monkeypatch: pytest.MonkeyPatch, tiny_model_factory: Any
) -> None:
    monkeypatch.delenv("TREADLE_LEAN_RUNNER", raising=False)
    assert lean_refusal(_config()) is None
    assert lean_refusal(_config(kv_cache_dtype="int8")) is None
    assert lean_refusal(_config(kv_cache_dtype="bfloat16")) == "--kv-cache-dtype bfloat16"
    assert lean_refusal(_config(enable_prompt_embeds=True)) == "--enable-prompt-embeds"
    assert lean_refusal(_config(dtype="bfloat16")) == "--dtype bfloat16"
    config = _config()
    from dataclasses import replace

    assert lean_refusal(replace(config, lora=LoRAConfig())) == "--enable-lora"
    draft = SpeculativeConfig(method="draft_model", model=str(tiny_model_factory("llama")))
    assert lean_refusal(replace(config, speculative=draft)) == "a draft model"
    tiny = _config(model=str(tiny_model_factory("llama")))
    assert lean_refusal(tiny) == "weights that are not GGUF"
    monkeypatch.setenv("TREADLE_LEAN_RUNNER", "0")
    assert lean_refusal(_config()) == "TREADLE_LEAN_RUNNER=0"


def test_the_default_engine_core_never_imports_torch() -> None:
    """An engine serving the default model, offline in one process: prefill, decode, and no
    torch module loaded at the end (the memory it saves: docs/design/torch-free-engine-core.md)."""
    code = (
        "import sys\n"
        "from treadle import LLM, SamplingParams\n"
        "llm = LLM(None, kv_cache_memory_bytes=32 << 20, max_model_len=512)\n"
        "out = llm.generate('Hello', SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)\n"
        "assert len(out[0].outputs[0].token_ids) == 4\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    env = dict(os.environ, TREADLE_ENABLE_MULTIPROCESSING="0")
    env.pop("TREADLE_LEAN_RUNNER", None)
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "TORCH False" in run.stdout, run.stderr[-3000:]
