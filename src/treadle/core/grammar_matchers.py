"""The engine core's grammar matchers (its side of structured outputs; the grammars themselves
are `treadle/structured_outputs.py`): compile each constrained request's matcher
in a thread (never on the busy loop), fill one bitmask per step for the constrained requests
that sample in it, and advance their matchers with the sampled tokens.

The tokenizer (for the grammar vocabulary) is loaded in the same thread on the first
constrained request, so an engine that never sees one never pays for it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from treadle.config import resolve_model
from treadle.logger import init_logger
from treadle.sampling_params import StructuredOutputsParams
from treadle.structured_outputs import GrammarCompiler, fill_bitmask

if TYPE_CHECKING:
    import numpy as np

logger = init_logger(__name__)


class GrammarMatchers:
    """Matchers compiled in the `treadle-grammar` thread, and each step's bitmask."""

    def __init__(self, model: str | None, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: GrammarCompiler | None = None

    def submit(self, so: StructuredOutputsParams) -> Future[Any]:
        """A future `LLMatcher` for the constraint; its exception is an `InvalidRequest` for
        one that does not compile."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="treadle-grammar")
        return self._pool.submit(self._matcher, so)

    def _matcher(self, so: StructuredOutputsParams) -> Any:
        if self._compiler is None:
            from treadle.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(resolve_model(self.model))
            self._compiler = GrammarCompiler(tokenizer, self.vocab_size, tokenizer.eos_token_id)
            logger.info(
                "Structured outputs: grammar vocabulary of %d tokens ready", self.vocab_size
            )
        return self._compiler.matcher(so)

    def bitmask(self, matchers: list[Any], ahead: list[list[int]] | None = None) -> np.ndarray:
        """int32 ndarray [rows, words]: the tokens each matcher allows next; with `ahead` (speculative
        decoding: tokens proposed after each matcher's state, all of which it accepts), a row
        per position: next, then after each proposed token in turn."""
        return fill_bitmask(matchers, self.vocab_size, ahead)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
