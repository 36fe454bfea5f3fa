"""Fixtures of the engine-core tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from treadle import LLM


@pytest.fixture(scope="module")
def inprocess_llm(tiny_model_factory) -> Iterator[Callable[..., LLM]]:  # type: ignore[no-untyped-def]
    """`make(**kwargs)`: an offline `LLM` on the tiny Llama whose `EngineCore` runs in this
    process (`llm.engine_core`, for tests that add requests and step it themselves); every
    one made is shut down after the module."""
    made: list[LLM] = []

    def make(**kwargs: object) -> LLM:
        os.environ["TREADLE_ENABLE_MULTIPROCESSING"] = "0"
        try:
            made.append(LLM(str(tiny_model_factory("llama")), **kwargs))  # type: ignore[arg-type]
        finally:
            del os.environ["TREADLE_ENABLE_MULTIPROCESSING"]
        return made[-1]

    yield make
    for llm in made:
        llm.shutdown()
