"""N-gram speculative decoding (issue 27, vLLM's `{"method": "ngram"}`): proposals that one
forward pass verifies.

Prompt lookup: the last n tokens of a request (n from `prompt_lookup_max` down to
`prompt_lookup_min`) are looked up in its earlier tokens (prompt and output), latest
occurrence first; the up to k tokens that followed it are the proposal. The scheduler gives
the request 1 + k positions in one step; the model runner verifies them greedily (the model's
own choice at each position, in order, until the first that differs: that choice is the bonus
token), so the output is exactly that of plain greedy decoding; the positions past the first
mismatch are given back (`Scheduler.update_from_output`).

Proposals stop paying when they are mostly rejected (a verifying step costs more than a plain
decoding one): a request whose recent acceptance rate (`ACCEPTANCE_DECAY`-weighted) falls
under `BACK_OFF_BELOW` proposes nothing for `PAUSE_STEPS` steps, then tries again.

Only greedy requests without anything that changes the logits first (penalties, biases,
banned or allowed tokens, `min_tokens`, a grammar) or that asks for logprobs speculate.
"""

from __future__ import annotations

from treadle.config import SpeculativeConfig
from treadle.sampling_params import SamplingParams

BACK_OFF_BELOW = 0.5
ACCEPTANCE_DECAY = 0.5
PAUSE_STEPS = 128


def can_speculate(p: SamplingParams) -> bool:
    return (
        p.temperature == 0.0
        and p.logprobs is None
        and p.structured_outputs is None
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and not p.logit_bias
        and p.allowed_token_ids is None
        and not p.bad_words_token_ids
        and p.min_tokens == 0
        and p.pooling is None
        and not p.infill
    )


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
