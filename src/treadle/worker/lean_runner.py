"""`LeanRunner`: `ModelRunner`'s work for a model on `model/lean_model.py`, with numpy only
(no torch in the process): the running requests' state, one step's rows as flat arrays, the
model call, sampling (`np_sampler.NumpySampler`), speculative verification, prompt logprobs
and pooling.

Every scheduled row is a row of one `LeanModel.forward` call: a decode token, a speculating
request's 1 + k positions and a prefill chunk's positions alike, each with its request's block
table and its own context length, so the step needs no split into decode and prefill parts.
What it does not do (images, prompt embeddings, LoRA, pipeline stages) is chosen away at
start (`worker/lean_worker.py`: the torch runner takes those configurations)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from treadle.model.lean_model import LeanModel
from treadle.sampling_params import SamplingParams
from treadle.wire.engine import Logprobs
from treadle.wire.worker import ModelRunnerOutput, SchedulerOutput
from treadle.worker.np_sampler import Draws, NumpySampler, log_softmax
from treadle.worker.sampling_rows import (
    SamplingRow,
    TokenPieces,
    grammar_rows,
    sampling_row,
    verify_grammar_rows,
    verify_rows,
)

PROMPT_LOGPROBS_ROWS = 256
"""Prompt positions scored per batch of logits (256 x a 49k vocabulary: 50 MB of float32)."""


@dataclass(slots=True, eq=False)
class LeanRequest:
    """A running request's state in the lean runner (`step_results.RequestState`'s fields,
    numpy where that one holds tensors)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None
    generator: Draws | None
    logit_bias: tuple[np.ndarray, np.ndarray] | None = None  # (token ids, biases)
    allowed_token_ids: np.ndarray | None = None
    pool_sum: np.ndarray | None = None  # a mean-pooling request's sum of hidden states


class LeanRunner:
    def __init__(
        self,
        model: LeanModel,
        block_size: int,
        seed: int,
        threads: Callable[[], int],
        pieces: TokenPieces | None = None,
    ) -> None:
        """`threads`: the kernels' thread count for the next step (`cpu_share`'s choice);
        `pieces`: token texts for the infill sampler."""
        self.model = model
        self.block_size = block_size
        self.threads = threads
        self.pieces = pieces
        self.sampler = NumpySampler(seed, model.lib)
        self.requests: dict[str, LeanRequest] = {}

    # -- per step --------------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_request_ids:
            self.requests.pop(rid, None)
        for new in sched.new_requests:
            if new.prompt_embeds is not None or new.mm_inputs or new.lora_request is not None:
                raise ValueError(
                    f"request {new.request_id!r}: prompt embeddings, images and LoRA adapters "
                    "run on the torch runner (this engine started without them)"
                )
            p = new.sampling_params
            num_outputs = len(new.token_ids) - new.num_prompt_tokens
            self.requests[new.request_id] = LeanRequest(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=p,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                eos_token_id=new.eos_token_id,
                # past the draws of the outputs it has (one per sampled token), so that a
                # request recomputed after a preemption continues its stream exactly
                generator=None
                if p.seed is None
                else Draws(p.seed, num_outputs if p.temperature > 0.0 else 0),
                logit_bias=None
                if not p.logit_bias
                else (
                    np.array(list(p.logit_bias), dtype=np.int64),
                    np.array(list(p.logit_bias.values()), dtype=np.float32),
                ),
                allowed_token_ids=None
                if p.allowed_token_ids is None
                else np.array(p.allowed_token_ids, dtype=np.int64),
            )
        for cached in sched.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        result = ModelRunnerOutput()
        if not sched.num_scheduled_tokens:
            return result
        spec = sched.spec_tokens
        for rid, proposal in spec.items():  # read after the last token, verified
            self.requests[rid].token_ids.extend(proposal)
        states = [self.requests[rid] for rid in sched.num_scheduled_tokens]
        counts = list(sched.num_scheduled_tokens.values())
        threads = self.threads()
        hidden, logits_rows = self._forward(states, counts, threads)
        first = 0
        verifying: list[tuple[LeanRequest, int, int]] = []  # (state, first row, rows)
        for state, n, row in zip(states, counts, logits_rows, strict=True):
            p = state.sampling_params
            if state.request_id in spec:
                verifying.append((state, first, n))
            if p.pooling is not None:
                self._pool(state, hidden[first : first + n], row is not None, result)
            if p.prompt_logprobs is not None:
                scored = self._prompt_logprobs(state, hidden[first : first + n], threads)
                if scored is not None:
                    result.prompt_logprobs[state.request_id] = scored
            first += n
        sampling = [
            (s, row)
            for s, row in zip(states, logits_rows, strict=True)
            if row is not None and s.sampling_params.pooling is None and s.request_id not in spec
        ]
        if sampling or verifying:
            # One LM head product for every row that needs logits: the sampled rows, then
            # each verifying request's 1 + k rows.
            rows = [row for _, row in sampling]
            for _, start, n in verifying:
                rows.extend(range(start, start + n))
            logits = self.model.logits(hidden[rows], threads)
        if sampling:
            tokens, logprobs = self.sampler(
                logits[: len(sampling)],
                [sampling_row(s, self.pieces) for s, _ in sampling],
                self._grammar(sched, [s.request_id for s, _ in sampling]),
            )
            for (state, _), token, lp in zip(sampling, tokens, logprobs, strict=True):
                state.token_ids.append(token)
                result.sampled[state.request_id] = token
                if lp is not None:
                    result.logprobs[state.request_id] = lp
        if verifying:
            grammar = self._verify_grammar(sched, verifying)
            self._verify(verifying, spec, logits[len(sampling) :], result, grammar)
        for state, n in zip(states, counts, strict=True):
            state.num_computed_tokens += n
        return result

    def _forward(
        self, states: list[LeanRequest], counts: list[int], threads: int
    ) -> tuple[np.ndarray, list[int | None]]:
        """The final norm's rows of the step (one per scheduled position, in `states`' order)
        and, per request, its row whose logits it samples from (None: its prompt goes on)."""
        bs = self.block_size
        total = sum(counts)
        ids = np.empty(total, np.int64)
        positions = np.empty(total, np.int64)
        lens = np.empty(total, np.int32)
        max_blocks = max(
            -(-(s.num_computed_tokens + n) // bs) for s, n in zip(states, counts, strict=True)
        )
        tables = np.zeros((len(states), max_blocks), np.int64)
        owner = np.empty(total, np.int64)  # each row's request (its block-table row)
        logits_rows: list[int | None] = []
        first = 0
        for i, (state, n) in enumerate(zip(states, counts, strict=True)):
            start = state.num_computed_tokens
            ids[first : first + n] = state.token_ids[start : start + n]
            positions[first : first + n] = np.arange(start, start + n)
            owner[first : first + n] = i
            table = state.block_ids[:max_blocks]
            tables[i, : len(table)] = table
            logits_rows.append(first + n - 1 if start + n == len(state.token_ids) else None)
            first += n
        lens[:] = positions + 1
        slots = tables[owner, positions // bs] * bs + positions % bs
        row_tables = tables if len(states) == 1 else np.ascontiguousarray(tables[owner])
        hidden = self.model.forward(ids, positions, slots, row_tables, lens, threads)
        return hidden, logits_rows

    # -- sampling --------------------------------------------------------------------------

    def _verify(
        self,
        verifying: list[tuple[LeanRequest, int, int]],
        spec: dict[str, list[int]],
        logits: np.ndarray,
        out: ModelRunnerOutput,
        grammar: tuple[np.ndarray, np.ndarray] | None,
    ) -> None:
        """The speculating requests' proposals checked against their 1 + k rows of logits
        (`NumpySampler.verify`); each request's tokens end with the accepted proposals and
        the token chosen after them."""
        rows: list[SamplingRow] = []
        proposals: list[list[int]] = []
        for state, _, _ in verifying:
            proposal = spec[state.request_id]
            del state.token_ids[len(state.token_ids) - len(proposal) :]
            proposals.append(proposal)
            rows.extend(verify_rows(state, proposal, self.pieces))
        verdicts = self.sampler.verify(logits, rows, proposals, grammar)
        for (state, _, _), (accepted, token, lp) in zip(verifying, verdicts, strict=True):
            state.token_ids.extend([*accepted, token])
            out.accepted[state.request_id] = accepted
            out.sampled[state.request_id] = token
            if lp is not None:
                out.logprobs[state.request_id] = lp

    @staticmethod
    def _grammar(
        sched: SchedulerOutput, sampled_ids: list[str]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows of the sampled logits, their bitmask rows) of the structured-output requests
        (`sampling_rows.grammar_rows`)."""
        return _bitmask_rows(sched, *grammar_rows(sched, sampled_ids))

    @staticmethod
    def _verify_grammar(
        sched: SchedulerOutput, verifying: list[tuple[LeanRequest, int, int]]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows of the verifying logits, their bitmask rows) of the speculating requests
        under a grammar (`sampling_rows.verify_grammar_rows`)."""
        ids = [(state.request_id, n) for state, _, n in verifying]
        return _bitmask_rows(sched, *verify_grammar_rows(sched, ids))

    # -- pooling and prompt logprobs -------------------------------------------------------

    @staticmethod
    def _pool(state: LeanRequest, hidden: np.ndarray, ends: bool, out: ModelRunnerOutput) -> None:
        """A pooling request's chunk: summed for "mean"; at the prompt's end, its result."""
        if state.sampling_params.pooling == "mean":
            chunk = hidden.sum(axis=0, dtype=np.float32)
            state.pool_sum = chunk if state.pool_sum is None else state.pool_sum + chunk
            if ends:
                out.pooled[state.request_id] = state.pool_sum / np.float32(state.num_prompt_tokens)
        elif ends:
            out.pooled[state.request_id] = hidden[-1].copy()

    def _prompt_logprobs(
        self, state: LeanRequest, hidden: np.ndarray, threads: int
    ) -> tuple[int, Logprobs] | None:
        """Logprobs of the prompt tokens this chunk's positions predict: position p scores
        prompt token p + 1 (`prompt_logprobs` top-k beside it). None when the chunk holds no
        such position."""
        start = state.num_computed_tokens
        end = min(start + hidden.shape[0], state.num_prompt_tokens - 1)
        if end <= start:
            return None
        k = state.sampling_params.prompt_logprobs or 0
        targets = np.array(state.token_ids[start + 1 : end + 1], dtype=np.int64)
        token_ids: list[list[int]] = []
        values: list[list[float]] = []
        ranks: list[int] = []
        for a in range(0, end - start, PROMPT_LOGPROBS_ROWS):  # bounds the logits' memory
            b = min(a + PROMPT_LOGPROBS_ROWS, end - start)
            lp = log_softmax(self.model.logits(hidden[a:b], threads))
            target = targets[a:b]
            chosen = np.take_along_axis(lp, target[:, None], axis=1)
            ranks += ((lp > chosen).sum(axis=1) + 1).tolist()
            ids, vals = target[:, None], chosen
            if k:
                top = top_k(lp, k)
                ids = np.concatenate([ids, top], axis=1)
                vals = np.concatenate([vals, np.take_along_axis(lp, top, axis=1)], axis=1)
            token_ids += ids.tolist()
            values += vals.tolist()
        return start + 1, Logprobs(token_ids, values, ranks)


def _bitmask_rows(
    sched: SchedulerOutput, rows: list[int], mask_rows: list[int]
) -> tuple[np.ndarray, np.ndarray] | None:
    if not rows or sched.grammar_bitmask is None:
        return None
    return np.array(rows, dtype=np.int64), np.asarray(sched.grammar_bitmask)[mask_rows]


def top_k(x: np.ndarray, k: int) -> np.ndarray:
    """Each row's indices of its k largest values, largest first."""
    k = min(k, x.shape[-1])
    part = np.argpartition(-x, k - 1, axis=-1)[:, :k]
    order = np.argsort(-np.take_along_axis(x, part, axis=-1), axis=-1, kind="stable")
    return np.take_along_axis(part, order, axis=-1)
