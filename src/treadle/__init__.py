"""treadle: a readable Python LLM serving engine built the way `vllm serve` is built."""

from treadle import envs

envs.apply_cpu_isa_caps()  # before anything below imports torch

from treadle.entrypoints.llm import LLM  # noqa: E402
from treadle.outputs import CompletionOutput, RequestOutput  # noqa: E402
from treadle.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
