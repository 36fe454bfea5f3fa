"""The offline API's prompt caches on disk (issue 26 item 2): `LLM.save_prompt_cache` and
`restore_prompt_cache`, in one process; a file from other weights of the same shapes is
refused."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from treadle import LLM, SamplingParams

PROMPT = " ".join(f"word{i}" for i in range(60))
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("saved")


def offline(model: Path, save_dir: Path) -> LLM:
    os.environ["TREADLE_ENABLE_MULTIPROCESSING"] = "0"
    try:
        return LLM(str(model), kv_cache_save_path=str(save_dir), max_model_len=512)
    finally:
        del os.environ["TREADLE_ENABLE_MULTIPROCESSING"]


@pytest.fixture(scope="module")
def llm(tiny_model_factory: Any, save_dir: Path) -> Iterator[LLM]:
    engine = offline(tiny_model_factory("llama"), save_dir)
    yield engine
    engine.shutdown()


def test_a_restored_prompt_is_a_prefix_hit_with_the_same_output(llm: LLM) -> None:
    first = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    saved = llm.save_prompt_cache(PROMPT, "p.bin")
    assert saved["n_saved"] == len(first.prompt_token_ids) // 16 * 16
    llm.engine_core.reset_prefix_cache()
    restored = llm.restore_prompt_cache("p.bin")
    assert restored["n_restored"] == saved["n_saved"]
    hits = llm.get_stats().prefix_cache_hits
    again = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert llm.get_stats().prefix_cache_hits - hits == saved["n_saved"]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_nothing_to_save_and_bad_names_are_value_errors(llm: LLM) -> None:
    llm.engine_core.reset_prefix_cache()
    with pytest.raises(ValueError, match="run it first"):
        llm.save_prompt_cache("never run " * 20, "never.bin")
    for bad in ("../p.bin", "missing.bin"):
        with pytest.raises(ValueError):
            llm.restore_prompt_cache(bad)


def test_a_file_from_other_weights_is_refused(
    llm: LLM, save_dir: Path, tiny_model_builder: Any, tmp_path: Path
) -> None:
    llm.generate([PROMPT], GREEDY, use_tqdm=False)
    llm.save_prompt_cache(PROMPT, "mine.bin")
    other = offline(tiny_model_builder(tmp_path / "other", "llama", seed=1), save_dir)
    try:
        with pytest.raises(ValueError, match="fingerprint"):
            other.restore_prompt_cache("mine.bin")
        assert other.get_stats().kv_cache_usage == 0.0
    finally:
        other.shutdown()
