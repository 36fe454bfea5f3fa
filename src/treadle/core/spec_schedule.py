"""The scheduler's speculative decoding (`--speculative-config`): which decoding requests
verify proposals in a step and how many (`spec_decode.plan`), n-gram or the draft model's, cut
where the grammar rejects; what a verified step appends and gives back; the timing of decode
steps the plan reads; the counters behind vLLM's spec_decode_* metrics.

Mixed into `core/scheduler.Scheduler`: it reads the scheduler's requests, KV cache and
context length and ends requests through its stop rules (the names declared on the class).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from treadle.config import SpeculativeConfig
from treadle.core.kv_cache_manager import KVCacheManager
from treadle.core.request import Request
from treadle.core.spec_decode import (
    ENGINE_DECAY,
    PROBE_EVERY,
    StepTimes,
    acceptance,
    can_speculate,
    plan,
    propose,
    tally,
)
from treadle.wire.engine import EngineCoreOutput, FinishReason, Logprobs
from treadle.wire.worker import SchedulerOutput

if TYPE_CHECKING:
    from treadle.core.spec_draft import DraftProposer


class SpecScheduling:
    """The speculative half of `Scheduler`; `_init_speculation` sets its state."""

    # The scheduler's, which this reads (and `generation_tokens_total`, which it adds to).
    running: list[Request]
    requests: dict[str, Request]
    kv: KVCacheManager
    max_model_len: int
    generation_tokens_total: int
    _check_stop: Callable[[Request, int], FinishReason | None]
    _finish: Callable[[Request, FinishReason], None]

    def _init_speculation(
        self, speculative: SpeculativeConfig | None, draft: DraftProposer | None
    ) -> None:
        self.speculative = speculative
        self.draft = draft
        # Speculative decoding's counters (vLLM's spec_decode_* metrics).
        self.spec_drafts = 0
        # (hits, trials) over every request's verifying steps: a new request's prior
        self.spec_engine_rate = (0.0, 0.0)
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        k = 0 if speculative is None else speculative.num_speculative_tokens
        self.spec_accepted_per_pos = [0] * k
        self.step_times = StepTimes()  # of steps of decode rows, by rows (`spec_decode.plan`)
        self._step_started: float | None = None

    def _start_step_clock(self) -> None:
        self._step_started = time.monotonic() if self.speculative is not None else None

    def _record_step_time(self, sched: SchedulerOutput) -> None:
        if self._step_started is not None:
            seconds = time.monotonic() - self._step_started
            spec = sched.spec_tokens
            if sched.num_scheduled_tokens and all(  # decode rows only: the fused path's steps
                n == 1 or rid in spec for rid, n in sched.num_scheduled_tokens.items()
            ):
                self.step_times.record(sched.total_num_scheduled_tokens, seconds)

    def _proposals(self, budget: int) -> dict[str, list[int]]:
        """The decoding requests' proposals for this step (none without
        --speculative-config), n-gram or the draft model's, as many of each as
        `spec_decode.plan` finds worth verifying. Only the requests the plan gives rows look
        their proposals up (or run the draft)."""
        config = self.speculative
        if config is None:
            return {}
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        draft = self.draft
        prior = acceptance(*self.spec_engine_rate)
        candidates = {
            r.request_id: (self._room(r, budget), acceptance(r.spec_hits, r.spec_trials, prior))
            for r in decoding
            if can_speculate(r.sampling_params)
            and (draft is None or r.prompt_embeds is None)  # the draft reads token ids
        }
        if not candidates:
            return {}
        draft_times = None if draft is None else draft.times
        counts, probe = plan(candidates, len(decoding), self.step_times, draft_times)
        wanted: list[tuple[Request, int]] = []
        for rid in candidates:
            req = self.requests[rid]
            n = counts.get(rid, 0)
            if n == 0 and probe and candidates[rid][0] > 0:
                req.spec_idle += 1
                if req.spec_idle >= PROBE_EVERY:
                    n = 1
            if n:
                req.spec_idle = 0
                wanted.append((req, n))
        if draft is not None:
            proposed = draft.propose(wanted) if wanted else {}
        else:
            proposed = {req.request_id: propose(req.all_token_ids, n, config) for req, n in wanted}
        chosen: dict[str, list[int]] = {}
        for rid, proposal in proposed.items():
            grammar = self.requests[rid].grammar
            if grammar is not None and proposal:  # cut before what the grammar rejects
                proposal = proposal[: grammar.validate_tokens(proposal)]
            if proposal:
                chosen[rid] = proposal
        return chosen

    def _room(self, req: Request, budget: int) -> int:
        """How many proposals a decoding request may verify: no more than its remaining
        tokens, the context or the step's budget leave room for."""
        assert self.speculative is not None
        p = req.sampling_params
        room = min(
            self.speculative.num_speculative_tokens,
            budget - 1,
            self.max_model_len - req.num_tokens - 1,
        )
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - req.num_output_tokens - 1)
        return max(room, 0)

    def _speculated(
        self,
        req: Request,
        proposal: list[int],
        accepted: list[int],
        token: int,
        logprobs: Logprobs | None,
    ) -> EngineCoreOutput:
        """A speculating request's step: the accepted proposals and the model's own next
        token, appended one by one under the usual stop rules; the rejected positions are
        given back (they are computed again, with the right tokens, later). `logprobs`: one
        row per token, cut with them."""
        self.spec_drafts += 1
        self.spec_draft_tokens += len(proposal)
        self.spec_accepted_tokens += len(accepted)
        for pos in range(len(accepted)):
            self.spec_accepted_per_pos[pos] += 1
        req.spec_hits, req.spec_trials = tally(
            req.spec_hits, req.spec_trials, len(proposal), len(accepted)
        )
        self.spec_engine_rate = tally(
            *self.spec_engine_rate, len(proposal), len(accepted), decay=ENGINE_DECAY
        )
        req.num_computed_tokens -= len(proposal) - len(accepted)
        new: list[int] = []
        reason = None
        for t in [*accepted, token]:
            req.all_token_ids.append(t)
            new.append(t)
            self.generation_tokens_total += 1
            reason = self._check_stop(req, t)
            if reason is not None:
                break
        # past a stop, the rest of the accepted tokens were never generated
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        self.kv.cache_full_blocks(req)
        if reason is not None:
            self._finish(req, reason)
        if logprobs is not None and len(logprobs.ranks) > len(new):
            n = len(new)
            logprobs = Logprobs(logprobs.token_ids[:n], logprobs.logprobs[:n], logprobs.ranks[:n])
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=new,
            new_logprobs=logprobs,
            finish_reason=reason,
            stop_reason=req.stop_reason,
            num_cached_tokens=req.num_cached_tokens,
        )
