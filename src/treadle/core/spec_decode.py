"""N-gram speculative decoding (issue 27, vLLM's `{"method": "ngram"}`): proposals that one
forward pass verifies.

Prompt lookup: the last n tokens of a request (n from `prompt_lookup_max` down to
`prompt_lookup_min`) are looked up in its earlier tokens (prompt and output), latest
occurrence first; the up to k tokens that followed it are the proposal. The scheduler gives
the request 1 + k positions in one step, which the model runner reads as 1 + k decode rows
(the fused decode path takes them) and verifies (`Sampler.verify`): greedily (the model's own
choice at each position, in order, until the first that differs: that choice is the bonus
token), so the output is exactly that of plain greedy decoding; at temperature > 0 by vLLM's
rejection sampling, so the output has exactly the distribution of plain sampling. Position j
is processed as plain sampling would after the first j proposals (penalties, `min_tokens`,
bad words see them); logprobs are the target model's. The positions past the first rejection
are given back (`Scheduler.update_from_output`).

Proposals stop paying when they are mostly rejected (a verifying step costs more than a plain
decoding one): a request whose recent acceptance rate (`ACCEPTANCE_DECAY`-weighted) falls
under `BACK_OFF_BELOW` proposes nothing for `PAUSE_STEPS` steps, then tries again.

Requests under a grammar (structured outputs: their bitmask would be needed at every
proposed position), pooling and infill requests do not speculate.
"""

from __future__ import annotations

from treadle.config import SpeculativeConfig
from treadle.sampling_params import SamplingParams

BACK_OFF_BELOW = 0.5
ACCEPTANCE_DECAY = 0.5
PAUSE_STEPS = 128


def can_speculate(p: SamplingParams) -> bool:
    return p.structured_outputs is None and p.pooling is None and not p.infill


def propose(tokens: list[int], most: int, config: SpeculativeConfig) -> list[int]:
    """Up to `most` tokens that followed the latest earlier occurrence of the longest suffix
    of `tokens` (of `prompt_lookup_min`..`prompt_lookup_max` tokens) that occurred before."""
    if most <= 0:
        return []
    length = len(tokens)
    for n in range(min(config.prompt_lookup_max, length - 1), config.prompt_lookup_min - 1, -1):
        suffix = tokens[length - n :]
        first = suffix[0]
        for i in range(length - n - 1, -1, -1):
            if tokens[i] == first and tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + most]
    return []
