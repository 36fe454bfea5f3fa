"""What a step's logits and hidden states become besides sampled tokens, for `ModelRunner`
(its base class): speculative proposals checked, the grammar's rows, pooled results and
prompt logprobs; and `RequestState`, a running request's state on this device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treadle.model.llama import LlamaForCausalLM
from treadle.model.llava import LlavaForConditionalGeneration
from treadle.sampling_params import SamplingParams
from treadle.wire.engine import Logprobs, LoRARequest, MultiModalInput
from treadle.wire.worker import ModelRunnerOutput, SchedulerOutput
from treadle.worker.sampler import Sampler
from treadle.worker.sampling_rows import (
    SamplingRow,
    TokenPieces,
    grammar_rows,
    verify_grammar_rows,
    verify_rows,
)

_PROMPT_LOGPROBS_ROWS = 256
"""Prompt positions scored per batch of logits (256 x a 49k vocabulary: 50 MB of float32)."""


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None
    generator: torch.Generator | None
    # logit_bias as (token ids, biases) and allowed_token_ids, as tensors once
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None
    allowed_token_ids: torch.Tensor | None = None
    prompt_embeds: torch.Tensor | None = None  # [num_prompt_tokens, hidden], model dtype
    mm_inputs: list[MultiModalInput] | None = None  # the prompt's images, in order
    lora: LoRARequest | None = None  # its adapter (None: the base model)
    # A mean-pooling request: the sum of its positions' final hidden states so far.
    pool_sum: torch.Tensor | None = None


class StepResults:
    """`ModelRunner`'s part that reads a step's results; it uses the runner's `model`,
    `sampler`, `device` and `pieces`."""

    model: LlamaForCausalLM | LlavaForConditionalGeneration
    sampler: Sampler
    device: torch.device
    pieces: TokenPieces | None

    def _verify(
        self,
        verifying: list[tuple[RequestState, int, int]],
        spec: dict[str, list[int]],
        logits: torch.Tensor,
        out: ModelRunnerOutput,
        grammar: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """The speculating requests' proposals checked against their 1 + k rows of logits
        (`Sampler.verify`: greedy, or rejection sampling at temperature > 0; `grammar`: the
        constrained rows and their bitmask rows); each request's tokens end with the accepted
        proposals and the token chosen after them."""
        rows: list[SamplingRow] = []
        proposals: list[list[int]] = []
        for state, _, _ in verifying:
            proposal = spec[state.request_id]
            del state.token_ids[len(state.token_ids) - len(proposal) :]
            proposals.append(proposal)
            rows.extend(
                verify_rows(state, proposal, self.pieces, prompt_ids=state.prompt_embeds is None)
            )
        verdicts = self.sampler.verify(logits, rows, proposals, grammar)
        for (state, _, _), (accepted, token, lp) in zip(verifying, verdicts, strict=True):
            state.token_ids.extend([*accepted, token])
            out.accepted[state.request_id] = accepted
            out.sampled[state.request_id] = token
            if lp is not None:
                out.logprobs[state.request_id] = lp

    @staticmethod
    def _pool(
        state: RequestState, hidden: torch.Tensor, ends: bool, out: ModelRunnerOutput
    ) -> None:
        """A pooling request's chunk: summed for "mean"; at the prompt's end, its result."""
        if state.sampling_params.pooling == "mean":
            chunk = hidden.float().sum(dim=0)
            state.pool_sum = chunk if state.pool_sum is None else state.pool_sum + chunk
            if ends:
                out.pooled[state.request_id] = (state.pool_sum / state.num_prompt_tokens).cpu()
        elif ends:
            out.pooled[state.request_id] = hidden[-1].float().cpu()

    def _grammar(
        self, sched: SchedulerOutput, sampled_ids: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the sampled logits, their bitmask rows as an int32 tensor) of the
        structured-output requests (the engine core fills the bitmask once, for all ranks, as
        a numpy array)."""
        return self._bitmask_rows(sched, *grammar_rows(sched, sampled_ids))

    def _verify_grammar(
        self, sched: SchedulerOutput, verifying: list[tuple[RequestState, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the verifying logits, their bitmask rows) of the speculating requests
        under a grammar (`sampling_rows.verify_grammar_rows`)."""
        ids = [(state.request_id, n) for state, _, n in verifying]
        return self._bitmask_rows(sched, *verify_grammar_rows(sched, ids))

    def _bitmask_rows(
        self, sched: SchedulerOutput, rows: list[int], mask_rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not rows or sched.grammar_bitmask is None:
            return None
        bitmask = torch.from_numpy(sched.grammar_bitmask[mask_rows])  # (rows copied)
        return torch.tensor(rows, device=self.device), bitmask

    def _prompt_logprobs(
        self, state: RequestState, hidden: torch.Tensor
    ) -> tuple[int, Logprobs] | None:
        """Logprobs of the prompt tokens that this chunk's positions predict: position p
        scores prompt token p + 1 (`prompt_logprobs` top-k beside it). None when the chunk
        holds no such position (a decode step, or only the prompt's last token)."""
        start = state.num_computed_tokens
        end = min(start + hidden.shape[0], state.num_prompt_tokens - 1)
        if end <= start:
            return None
        k = state.sampling_params.prompt_logprobs or 0
        targets = torch.tensor(state.token_ids[start + 1 : end + 1], device=self.device)
        token_ids: list[list[int]] = []
        values: list[list[float]] = []
        ranks: list[int] = []
        for a in range(0, end - start, _PROMPT_LOGPROBS_ROWS):  # bounds the logits' memory
            b = min(a + _PROMPT_LOGPROBS_ROWS, end - start)
            lp = torch.log_softmax(self.model.compute_logits(hidden[a:b]).float(), dim=-1)
            target = targets[a:b]
            chosen = lp.gather(1, target[:, None])
            ranks += ((lp > chosen).sum(dim=-1) + 1).tolist()
            if k:
                top = lp.topk(min(k, lp.shape[-1]), dim=-1)
                ids = torch.cat([target[:, None], top.indices], dim=1)
                vals = torch.cat([chosen, top.values], dim=1)
            else:
                ids, vals = target[:, None], chosen
            token_ids += ids.tolist()
            values += vals.tolist()
        return start + 1, Logprobs(token_ids, values, ranks)
