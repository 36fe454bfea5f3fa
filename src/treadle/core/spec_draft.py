"""Draft-model speculative decoding (issue 27, vLLM's `{"method": "draft_model"}`): a smaller
model with the target's vocabulary, run in the engine core process (world size 1, whatever
the target's -tp), proposes each speculating request's next tokens greedily.

The draft is a `ModelRunner` of its own, with its own paged KV cache (a block pool here, as
many blocks as the target's cache, the draft's row size), driven with `SchedulerOutput`s that
this module builds. A proposal of n tokens for a request of L tokens costs n draft forwards
batched over the requests: the first computes the positions the draft has not computed yet
(its catch-up: usually the last step's accepted tokens and bonus token; the whole context the
first time) and picks proposal 1 from the last one; each later forward reads the previous
proposal (a decode row) and picks the next. Proposals are the draft's argmax: deterministic,
so the target's verification (`Sampler.verify`) stays exact, greedy and sampled alike.

The draft's KV follows the accepted tokens: it holds positions 0 .. L + n - 2, with the
proposals at L ..; after verification the positions that still agree with the request's
tokens are kept and the rest are recomputed next time (overwritten in place). A request that
finishes or is preempted gives its draft blocks back (`drop`). A request whose blocks the pool
cannot give proposes nothing in that step.

Each draft forward of the steady state (at most 2 tokens a request: the last proposal and
the bonus token) is timed (`times`, by its number of requests), so that `spec_decode.plan`
weighs the draft's own cost against what its proposals are worth. A forward that catches up
a long context (a request's first proposal, or its first after steps without) is not timed:
the plan may stop proposing on what it knows, and must not learn it from a one-off prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from treadle.config import EngineConfig, resolve_model
from treadle.core.request import Request
from treadle.core.spec_decode import StepTimes
from treadle.logger import init_logger
from treadle.model.arch import ModelArch
from treadle.model.attention import resolve_kv_cache_dtype
from treadle.model.loader import load_model, read_arch
from treadle.sampling_params import SamplingParams
from treadle.wire.worker import CachedRequestData, NewRequestData, SchedulerOutput
from treadle.worker.model_runner import ModelRunner
from treadle.worker.worker import pick_device, resolve_dtype

logger = init_logger(__name__)

GREEDY = SamplingParams(temperature=0.0)
GPU_FREE_FRACTION = 0.9  # of what the target's KV cache left, at most
WARM_UP_ROUNDS = 3


@dataclass(slots=True, eq=False)
class _Draft:
    """What the draft's cache holds for one request: `tokens[:computed]` at positions
    0 .. computed - 1, in `block_ids`."""

    block_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    computed: int = 0


class DraftProposer:
    def __init__(self, config: EngineConfig, target: ModelArch) -> None:
        """Loads the draft model (`config.speculative.model`); `ValueError` when its
        vocabulary is not the target's. The KV cache comes with `initialize_cache`."""
        spec = config.speculative
        assert spec is not None and spec.model is not None
        self.k = spec.num_speculative_tokens
        source = resolve_model(spec.model)
        self.arch = read_arch(source)
        if self.arch.vocab_size != target.vocab_size:
            raise ValueError(
                f"--speculative-config: the draft model {source.path} has a vocabulary of "
                f"{self.arch.vocab_size} tokens, the model {target.vocab_size}: a draft must "
                "share the model's tokenizer"
            )
        self.config = config
        self.device = pick_device()
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.source = source
        self.max_positions = self.arch.max_position_embeddings
        started = time.monotonic()
        model = load_model(
            source,
            self.arch,
            self.dtype,
            self.device,
            self.max_positions,
            config.model.cpu_activation_dtype,
        )
        self.block_size = config.cache.block_size
        kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.runner = ModelRunner(
            model, self.device, self.dtype, self.block_size, 0, kv_dtype=kv_dtype
        )
        logger.info(
            "Draft model %s loaded in %.1f s (%d layers, hidden %d)",
            source.path,
            time.monotonic() - started,
            self.arch.num_layers,
            self.arch.hidden_size,
        )
        self.times = StepTimes()  # seconds of a draft forward, by its number of requests
        self._free: list[int] = []
        self._drafts: dict[str, _Draft] = {}

    def initialize_cache(self, max_model_len: int, num_blocks: int) -> None:
        """A cache of `num_blocks` blocks (the target's count; on CUDA at most what fits in
        `GPU_FREE_FRACTION` of the free memory). `ValueError` when the draft's context is
        shorter than `max_model_len`, or when one request of that length would not fit."""
        if self.max_positions < max_model_len:
            raise ValueError(
                f"--speculative-config: the draft model {self.source.path} takes at most "
                f"{self.max_positions} tokens (max_position_embeddings), the model "
                f"{max_model_len}: pass --max-model-len {self.max_positions} or less"
            )
        per_block = self.runner.kv_bytes_per_block()
        needed = -(-max_model_len // self.block_size)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            num_blocks = min(num_blocks, int(free * GPU_FREE_FRACTION) // per_block)
        if num_blocks < needed:
            raise ValueError(
                f"--speculative-config: the draft model's KV cache holds {num_blocks} blocks, "
                f"one request of max_model_len {max_model_len} needs {needed}: lower "
                "--max-model-len or --kv-cache-memory (the model's cache leaves too little)"
            )
        self.runner.initialize_cache(num_blocks)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._warm_up(max_model_len)
        logger.info(
            "Draft KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks,
            self.block_size,
            num_blocks * per_block / (1 << 20),
        )

    def _warm_up(self, max_model_len: int) -> None:
        """A few proposals for a made-up request, untimed: a first forward pays one-off
        costs, and a draft timed too slow is never tried again (`spec_decode.plan`)."""
        length = max(1, min(32, max_model_len - WARM_UP_ROUNDS * (self.k + 1) - 1))
        req = Request("treadle-draft-warm-up", [0] * length, GREEDY, None, 0.0)
        for _ in range(WARM_UP_ROUNDS):
            proposal = self.propose([(req, self.k)])[req.request_id]
            req.all_token_ids += [*proposal, 0]
        self.drop(req.request_id)
        self.times = StepTimes()

    def drop(self, request_id: str) -> None:
        """The request finished or was preempted: its blocks go back to the pool."""
        draft = self._drafts.pop(request_id, None)
        if draft is not None:
            self._free.extend(reversed(draft.block_ids))
            self.runner.execute_model(SchedulerOutput(finished_request_ids={request_id}))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Up to n greedy proposals for each (request, n)."""
        batch: list[tuple[Request, int, int]] = []  # (request, n, first position to compute)
        for req, n in wanted:
            start = self._sync(req, n)
            if start is not None:
                batch.append((req, n, start))
        if not batch:
            return {}
        proposals: dict[str, list[int]] = {}
        first = SchedulerOutput()
        for req, _, start in batch:
            rid = req.request_id
            first.new_requests.append(  # the whole request again: its tokens are the truth
                NewRequestData(
                    rid,
                    list(req.all_token_ids),
                    req.num_prompt_tokens,
                    GREEDY,
                    list(self._drafts[rid].block_ids),
                    start,
                )
            )
            first.num_scheduled_tokens[rid] = req.num_tokens - start
        active = batch
        sched = first
        depth = 1
        while True:
            sched.total_num_scheduled_tokens = sum(sched.num_scheduled_tokens.values())
            started = time.monotonic()
            sampled = self.runner.execute_model(sched).sampled
            if sched.total_num_scheduled_tokens <= 2 * len(active):  # no long catch-up
                self.times.record(len(active), time.monotonic() - started)
            for req, _, _ in active:
                proposals.setdefault(req.request_id, []).append(sampled[req.request_id])
            active = [(req, n, start) for req, n, start in active if n > depth]
            if not active:
                break
            sched = SchedulerOutput()
            for req, _, _ in active:
                rid = req.request_id
                position = req.num_tokens + depth - 1  # of the proposal just made
                sched.cached_requests.append(CachedRequestData(rid, [], position))
                sched.num_scheduled_tokens[rid] = 1
            depth += 1
        for req, n, _ in batch:
            draft = self._drafts[req.request_id]
            proposal = proposals[req.request_id]
            draft.tokens = [*req.all_token_ids, *proposal[: n - 1]]
            draft.computed = req.num_tokens + n - 1
        return proposals

    def _sync(self, req: Request, n: int) -> int | None:
        """The first position the draft must compute for `req` (what its cache holds that
        still agrees with the request's tokens), with blocks for n proposals; None when the
        pool has too few blocks."""
        rid = req.request_id
        draft = self._drafts.get(rid)
        if draft is None:
            draft = self._drafts[rid] = _Draft()
        tokens = req.all_token_ids
        agree = min(draft.computed, len(tokens) - 1)
        for i in range(max(0, agree - self.k - 2), agree):  # only the last proposals differ
            if draft.tokens[i] != tokens[i]:
                agree = i
                break
        draft.computed = agree
        del draft.tokens[agree:]
        blocks = -(-(req.num_tokens + n - 1) // self.block_size) - len(draft.block_ids)
        if blocks > len(self._free):
            return None
        for _ in range(blocks):
            draft.block_ids.append(self._free.pop())
        return agree
