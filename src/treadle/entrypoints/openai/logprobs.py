"""Logprobs in OpenAI's shapes (as vLLM writes them) from the engine's `Logprob` entries:
completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), chat (`content`, each
token with exactly its top k), and vLLM's `prompt_logprobs`.

Each entry is {token id: Logprob}, the chosen (or prompt) token first, then the top k by rank;
None where nothing was scored (the first prompt token, or a prompt the engine did not score).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from treadle.outputs import Logprob, LogprobsDict

MIN_LOGPROB = -9999.0
"""What -inf is written as (JSON has no infinity), as OpenAI and vLLM do."""

TokenText = Callable[[int], str]
"""A token id -> its text (decoded alone)."""


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class LogprobWriter:
    """Writes logprobs for one request. `as_token_ids`: each token as "token_id:{id}" (vLLM's
    `return_tokens_as_token_ids`, for tokens whose text is not valid UTF-8 alone)."""

    def __init__(self, token_text: TokenText, as_token_ids: bool = False) -> None:
        self.token_text = token_text
        self.as_token_ids = as_token_ids

    def token(self, token_id: int, lp: Logprob | None = None) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.token_text(token_id)

    def completion(
        self,
        token_ids: Sequence[int],
        entries: Sequence[LogprobsDict | None],
        k: int,
        text_offset: int,
    ) -> dict[str, Any]:
        """Completions' shape: per token its text, its logprob and the top k (k + 1 entries
        when the chosen token is not among them), None where nothing was scored."""
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        offset = text_offset
        for token_id, entry in zip(token_ids, entries, strict=False):
            lp = None if entry is None else entry.get(token_id)
            piece = self.token(token_id, lp)
            tokens.append(piece)
            offsets.append(offset)
            offset += len(piece)
            if entry is None or lp is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(_finite(lp.logprob))
            tops.append(
                {
                    self.token(t, top): _finite(top.logprob)
                    for t, top in itertools.islice(entry.items(), k + 1)
                }
            )
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chat(
        self, token_ids: Sequence[int], entries: Sequence[LogprobsDict], k: int
    ) -> dict[str, Any]:
        """Chat's shape: per token its text, logprob and bytes, and exactly the k most likely
        tokens in rank order (the chosen one among them when its rank is at most k)."""
        content = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            lp = entry.get(token_id)
            ranked = sorted(
                (
                    (t, top)
                    for t, top in entry.items()
                    if top.rank is not None and 1 <= top.rank <= k
                ),
                key=lambda item: item[1].rank or 0,
            )
            content.append(
                {
                    **self._chat_token(token_id, lp),
                    "top_logprobs": [self._chat_token(t, top) for t, top in ranked],
                }
            )
        return {"content": content}

    def _chat_token(self, token_id: int, lp: Logprob | None) -> dict[str, Any]:
        piece = self.token(token_id, lp)
        return {
            "token": piece,
            "logprob": MIN_LOGPROB if lp is None else _finite(lp.logprob),
            "bytes": list(piece.encode()),
        }


def prompt_logprobs_json(
    prompt_ids: Sequence[int], entries: Sequence[LogprobsDict | None] | None
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}}, as many as the prompt has tokens."""
    rows = padded(prompt_ids, entries)
    return [
        None
        if row is None
        else {
            str(t): {
                "logprob": _finite(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for t, lp in row.items()
        }
        for row in rows
    ]


def padded(
    prompt_ids: Sequence[int], entries: Sequence[LogprobsDict | None] | None
) -> list[LogprobsDict | None]:
    """One entry per prompt token: None where the engine gave none."""
    rows = list(entries or [])[: len(prompt_ids)]
    return rows + [None] * (len(prompt_ids) - len(rows))
