"""treadle: a readable Python LLM serving engine built the way `vllm serve` is built."""

from treadle.entrypoints.llm import LLM
from treadle.outputs import CompletionOutput, RequestOutput
from treadle.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
