"""An in-process `LLM` (TREADLE_ENABLE_MULTIPROCESSING=0) runs its model on the threads it was
given (`cpu_threads`), as an engine core process does."""

from __future__ import annotations

import os
from typing import Any

import torch

from treadle import LLM, SamplingParams


def test_in_process_llm_runs_on_the_threads_it_was_given(tiny_model_factory: Any) -> None:
    before = torch.get_num_threads()
    os.environ["TREADLE_ENABLE_MULTIPROCESSING"] = "0"
    try:
        llm = LLM(str(tiny_model_factory("llama")), max_model_len=128, cpu_threads=1)
        assert torch.get_num_threads() == 1
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 4
        llm.shutdown()
    finally:
        del os.environ["TREADLE_ENABLE_MULTIPROCESSING"]
        torch.set_num_threads(before)
