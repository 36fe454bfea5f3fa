"""Batched sampling: penalties, min_tokens, temperature, top-k/top-p/min-p, seeds, logprobs.

All rows are processed as one tensor; per-request settings become per-row tensors. A request
with a `seed` draws its noise from its own generator, one draw per step, so its tokens do
not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treadle.wire.engine import Logprobs


@dataclass
class SamplingRow:
    """What the sampler needs about one request (one row of logits)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int]  # eos/stop ids while min_tokens is not reached
    generator: torch.Generator | None


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[int], list[Logprobs | None]]:
        logits = logits.float()
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if any(r.logprobs is not None for r in rows) else None
        )
        logits = self._apply_penalties(logits, rows)
        for i, row in enumerate(rows):
            if row.banned_token_ids:
                logits[i, row.banned_token_ids] = float("-inf")
        tokens = self._sample(logits, rows).tolist()
        if raw_logprobs is None:
            return tokens, [None] * len(rows)
        return tokens, [
            None if row.logprobs is None else _logprobs(raw_logprobs[i], tokens[i], row.logprobs)
            for i, row in enumerate(rows)
        ]

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            if row.repetition_penalty != 1.0:
                seen = torch.tensor(
                    sorted(set(row.prompt_token_ids + row.output_token_ids)),
                    dtype=torch.long,
                    device=logits.device,
                )
                values = logits[i, seen]
                logits[i, seen] = torch.where(
                    values > 0, values / row.repetition_penalty, values * row.repetition_penalty
                )
            if (row.presence_penalty or row.frequency_penalty) and row.output_token_ids:
                counts = torch.bincount(
                    torch.tensor(row.output_token_ids, device=logits.device),
                    minlength=logits.shape[1],
                ).to(logits.dtype)
                logits[i] -= row.frequency_penalty * counts + row.presence_penalty * (counts > 0)
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy = logits.max(dim=-1).indices  # on the CPU, 1.7x faster than argmax
        random_rows = [i for i, r in enumerate(rows) if r.temperature > 0.0]
        if not random_rows:
            return greedy
        device = logits.device
        idx = torch.tensor(random_rows, device=device)
        sub = [rows[i] for i in random_rows]
        x = logits[idx] / torch.tensor([r.temperature for r in sub], device=device)[:, None]
        if any(r.top_k > 0 or r.top_p < 1.0 for r in sub):
            x = _top_k_top_p(x, sub)
        probs = torch.softmax(x, dim=-1)
        if any(r.min_p > 0.0 for r in sub):
            min_p = torch.tensor([r.min_p for r in sub], device=device)[:, None]
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        noise = torch.empty_like(probs)
        for j, row in enumerate(sub):
            noise[j].exponential_(generator=row.generator or self.generator)
        # Exponential race: argmax(p / E) is a draw from p (the Gumbel-max trick in disguise).
        sampled = (probs / noise).max(dim=-1).indices
        greedy[idx] = sampled
        return greedy


def _top_k_top_p(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    sorted_x, order = x.sort(dim=-1, descending=True)
    vocab = x.shape[-1]
    top_k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows], device=x.device)
    ranks = torch.arange(vocab, device=x.device)[None, :]
    drop = ranks >= top_k[:, None]
    top_p = torch.tensor([r.top_p for r in rows], device=x.device)[:, None]
    probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop |= before >= top_p
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def _logprobs(logprobs: torch.Tensor, token: int, num_top: int) -> Logprobs:
    chosen = logprobs[token]
    rank = int((logprobs > chosen).sum().item()) + 1
    ids = [token]
    values = [float(chosen)]
    if num_top:  # the engine core refuses more than the vocabulary; never index past it
        top = logprobs.topk(min(num_top, logprobs.shape[-1]))
        ids += top.indices.tolist()
        values += top.values.tolist()
    return Logprobs(token_ids=[ids], logprobs=[values], ranks=[rank])
