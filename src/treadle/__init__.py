"""treadle: a readable Python LLM serving engine built the way `vllm serve` is built.

The names below load on first use (PEP 562): every `treadle.*` module runs this file first,
so an eager `from treadle.entrypoints.llm import LLM` here would pull the whole front end
(and torch) into the engine core, the workers and every ground-floor module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from treadle import envs

envs.apply_cpu_isa_caps()  # before anything imports torch

if TYPE_CHECKING:
    from treadle.entrypoints.llm import LLM
    from treadle.outputs import CompletionOutput, RequestOutput
    from treadle.sampling_params import SamplingParams
    from treadle.wire.engine import LoRARequest

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest"]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "treadle.entrypoints.llm",
    "SamplingParams": "treadle.sampling_params",
    "RequestOutput": "treadle.outputs",
    "CompletionOutput": "treadle.outputs",
    "LoRARequest": "treadle.wire.engine",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'treadle' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
