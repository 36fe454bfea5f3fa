"""Continuous batching: which requests run in the next step, and with how many tokens.

Every request has `num_computed_tokens` (in the KV cache) and `num_tokens` (prompt + output);
a step gives each running request up to the difference, under a token budget. A prompt is
thus prefilled in chunks beside the decodes of other requests. When blocks run out, the
lowest-priority running request is preempted (its blocks are freed and it is recomputed
later). Waiting requests are admitted FCFS, or by `priority` (lower first) then arrival.
Speculative decoding's share of a step (proposals, what a verified step appends) is
`core/spec_schedule.py`.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import TYPE_CHECKING

from treadle.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from treadle.core.kv_cache_manager import Block, KVCacheManager
from treadle.core.prompt_inputs import encoder_cut
from treadle.core.request import Request, RequestStatus
from treadle.core.spec_schedule import SpecScheduling
from treadle.ipc.serial import Array
from treadle.wire.engine import EngineCoreOutput, FinishReason, Logprobs, SchedulerStats
from treadle.wire.worker import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from treadle.core.spec_draft import DraftProposer


class Scheduler(SpecScheduling):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        speculative: SpeculativeConfig | None = None,
        draft: DraftProposer | None = None,
        max_loras: int | None = None,
    ) -> None:
        """`speculative`: proposals to verify (`core/spec_decode.py`): n-gram prompt lookup,
        or `draft`'s (`core/spec_draft.py`) for the method "draft_model"; `max_loras`: LoRA
        adapters the running requests may use at once (None: adapters are not enabled)."""
        self._init_speculation(speculative, draft)
        self.max_loras = max_loras
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}
        self._waiting: list[tuple[int, float, int, Request]] = []  # heap
        self._order = itertools.count()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()  # to tell the workers in the next step
        self.num_preemptions = 0
        # For the periodic stats line: prompts that got their first token, tokens sampled.
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # The vision encoder's totals (`ModelRunnerOutput.images_encoded`, ...).
        self.images_encoded = 0
        self.encoder_cache_hits = 0
        self.encoder_seconds = 0.0

    # -- requests in and out -------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self._push_waiting(req)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            self._finish(req, FinishReason.ABORT)
            aborted.append(req)
        if aborted:
            self._waiting = [e for e in self._waiting if not e[3].is_finished]
            heapq.heapify(self._waiting)
        return aborted

    def lora_ids(self) -> set[int]:
        """The adapters of the requests here (running or waiting)."""
        return {r.lora_request.lora_int_id for r in self.requests.values() if r.lora_request}

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self.running)

    # -- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.max_num_batched_tokens
        # Image tokens the vision encoder may start in this step (as vLLM's encoder budget).
        encoder_budget = self.max_num_batched_tokens
        preempted = False
        proposals = self._proposals(budget)

        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            n, encoding = encoder_cut(
                req.mm_inputs,
                req.num_computed_tokens,
                n,
                encoder_budget,
                encoder_budget == self.max_num_batched_tokens,
            )
            if n <= 0:
                continue
            proposal = proposals.get(req.request_id, [])[: budget - 1] if n == 1 else []
            n += len(proposal)
            while (new_blocks := self.kv.allocate_slots(req, n)) is None:
                victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                budget += self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
            if new_blocks is None:
                continue
            out.cached_requests.append(
                CachedRequestData(req.request_id, new_blocks, req.num_computed_tokens)
            )
            encoder_budget -= encoding
            out.num_scheduled_tokens[req.request_id] = n
            if proposal:
                out.spec_tokens[req.request_id] = proposal
            budget -= n

        while self._waiting and budget > 0 and not preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            req = self._waiting[0][3]
            lora = req.lora_request
            if lora is not None and self.max_loras is not None:
                active = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
                if lora.lora_int_id not in active and len(active) >= self.max_loras:
                    break  # its adapter waits for a slot (--max-loras)
            computed: list[Block] = []
            num_hit = 0
            # A request scoring its prompt (`prompt_logprobs`) or pooling the mean of its
            # positions must compute all of it.
            p = req.sampling_params
            if req.num_computed_tokens == 0 and p.prompt_logprobs is None and p.pooling != "mean":
                computed, num_hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - req.num_computed_tokens - num_hit, budget)
            cut, encoding = encoder_cut(
                req.mm_inputs,
                req.num_computed_tokens + num_hit,
                n,
                encoder_budget,
                encoder_budget == self.max_num_batched_tokens,
            )
            if cut <= 0 < n:
                break  # its next image waits for the next step's encoder budget
            n = cut
            block_ids = self.kv.allocate_slots(req, n, computed)
            if block_ids is None:
                break
            encoder_budget -= encoding
            heapq.heappop(self._waiting)
            if req.num_computed_tokens == 0:
                self.kv.record_prefix_lookup(req.num_tokens, num_hit)
            req.num_computed_tokens += num_hit
            req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            if req.scheduled_ts is None:
                req.scheduled_ts = time.monotonic()
            self.running.append(req)
            out.new_requests.append(
                NewRequestData(
                    req.request_id,
                    list(req.all_token_ids),
                    req.num_prompt_tokens,
                    req.sampling_params,
                    self.kv.block_ids(req.request_id),
                    req.num_computed_tokens,
                    req.eos_token_id,
                    req.prompt_embeds,
                    req.mm_inputs,
                    req.lora_request,
                )
            )
            out.num_scheduled_tokens[req.request_id] = n
            budget -= n

        out.total_num_scheduled_tokens = self.max_num_batched_tokens - budget
        for rid, n in out.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n
        self._start_step_clock()
        return out

    def update_from_output(
        self, sched: SchedulerOutput, result: ModelRunnerOutput
    ) -> dict[int, list[EngineCoreOutput]]:
        """Append the sampled tokens, finish what must stop; outputs grouped by client."""
        self._record_step_time(sched)
        self.images_encoded += result.images_encoded
        self.encoder_cache_hits += result.encoder_cache_hits
        self.encoder_seconds += result.encoder_seconds
        outputs: dict[int, list[EngineCoreOutput]] = {}
        for rid in sched.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            prompt_logprobs = self._new_prompt_logprobs(req, result.prompt_logprobs.get(rid))
            pooled = result.pooled.get(rid)
            if pooled is not None:  # a pooling request's prompt is read: it is done
                outputs.setdefault(req.client_index, []).append(self._pooled(req, pooled))
                continue
            token = result.sampled.get(rid)
            proposal = sched.spec_tokens.get(rid)
            if proposal is not None and token is not None:
                outputs.setdefault(req.client_index, []).append(
                    self._speculated(
                        req, proposal, result.accepted.get(rid, []), token, result.logprobs.get(rid)
                    )
                )
                continue
            if token is None:  # a prefill chunk that did not reach the end of the prompt
                self.kv.cache_full_blocks(req)
                if prompt_logprobs is not None:
                    outputs.setdefault(req.client_index, []).append(
                        EngineCoreOutput(rid, [], new_prompt_logprobs=prompt_logprobs)
                    )
                continue
            req.all_token_ids.append(token)
            self.generation_tokens_total += 1
            reason = self._check_stop(req, token)
            self.kv.cache_full_blocks(req)
            if reason is not None:
                self._finish(req, reason)
            out = EngineCoreOutput(
                request_id=rid,
                new_token_ids=[token],
                new_logprobs=result.logprobs.get(rid),
                finish_reason=reason,
                stop_reason=req.stop_reason,
                num_cached_tokens=req.num_cached_tokens,
                new_prompt_logprobs=prompt_logprobs,
            )
            if req.num_output_tokens == 1 and req.scheduled_ts is not None:
                self.prompt_tokens_total += req.num_prompt_tokens
                out.queue_time = req.scheduled_ts - req.queued_ts
                out.prefill_time = time.monotonic() - req.scheduled_ts
            outputs.setdefault(req.client_index, []).append(out)
        return outputs

    def _pooled(self, req: Request, pooled: Array) -> EngineCoreOutput:
        self.kv.cache_full_blocks(req)
        self._finish(req, FinishReason.STOP)
        self.prompt_tokens_total += req.num_prompt_tokens
        out = EngineCoreOutput(
            req.request_id,
            [],
            finish_reason=FinishReason.STOP,
            num_cached_tokens=req.num_cached_tokens,
            pooled=pooled,
        )
        if req.scheduled_ts is not None:
            out.queue_time = req.scheduled_ts - req.queued_ts
            out.prefill_time = time.monotonic() - req.scheduled_ts
        return out

    def grammar_rows(self, sched: SchedulerOutput) -> list[Request]:
        """The structured-output requests that sample in this step (their chunk reaches the
        end of their tokens, and past them by the proposals a speculating one verifies), in
        the order of `sched.num_scheduled_tokens`."""
        rows = []
        for rid in sched.num_scheduled_tokens:
            req = self.requests[rid]
            ahead = len(sched.spec_tokens.get(rid, ()))
            if req.grammar is not None and req.num_computed_tokens == req.num_tokens + ahead:
                rows.append(req)
        return rows

    @staticmethod
    def _new_prompt_logprobs(req: Request, scored: tuple[int, Logprobs] | None) -> Logprobs | None:
        """The rows of `scored` not sent before (a preempted request scores its prompt again
        when it is recomputed; the client gets each prompt token once)."""
        if scored is None:
            return None
        first, lp = scored
        skip = req.num_prompt_logprobs + 1 - first
        if skip < 0 or skip >= len(lp.ranks):
            return None
        req.num_prompt_logprobs += len(lp.ranks) - skip
        if skip == 0:
            return lp
        return Logprobs(lp.token_ids[skip:], lp.logprobs[skip:], lp.ranks[skip:])

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self._waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions,
            spec_decode_num_drafts=self.spec_drafts,
            spec_decode_num_draft_tokens=self.spec_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec_accepted_per_pos),
            mm_images_encoded=self.images_encoded,
            mm_encoder_cache_hits=self.encoder_cache_hits,
            mm_encoder_seconds=self.encoder_seconds,
        )

    # -- internals ---------------------------------------------------------------------------

    def _check_stop(self, req: Request, token: int) -> FinishReason | None:
        params = req.sampling_params
        num_out = req.num_output_tokens
        if req.grammar is not None:
            if not req.grammar.consume_token(token):  # the bitmask should make this impossible
                req.stop_reason = f"structured output: {req.grammar.get_error() or 'rejected'}"
                return FinishReason.ERROR
            if req.grammar.is_stopped():  # the constraint is complete: nothing may follow
                return FinishReason.STOP
        if num_out >= params.min_tokens:
            if token == req.eos_token_id and not params.ignore_eos:
                return FinishReason.STOP
            if token in params.stop_token_ids:
                req.stop_reason = token
                return FinishReason.STOP
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return FinishReason.LENGTH
        if req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        was_running = req.status is RequestStatus.RUNNING
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if was_running:
            self.running.remove(req)
            self._finished_ids.add(req.request_id)
        self.kv.free_request(req)
        if self.draft is not None:
            self.draft.drop(req.request_id)
        del self.requests[req.request_id]

    def _preempt(self, req: Request, out: SchedulerOutput) -> int:
        """Free `req` and send it back to the waiting queue; returns the tokens it had been
        given in this step (now unscheduled)."""
        self.running.remove(req)
        self.kv.free_request(req)
        if self.draft is not None:
            self.draft.drop(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.num_preemptions += 1
        out.finished_request_ids.add(req.request_id)
        out.cached_requests = [c for c in out.cached_requests if c.request_id != req.request_id]
        self._push_waiting(req)
        return out.num_scheduled_tokens.pop(req.request_id, 0)

    def _push_waiting(self, req: Request) -> None:
        heapq.heappush(self._waiting, (req.priority, req.arrival_time, next(self._order), req))
