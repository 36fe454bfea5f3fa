"""`ModelRunner`: keeps the running requests' state on this device, turns one step's schedule
into model inputs, runs the model and samples.

A prompt given as embeddings (`prompt_embeds`) keeps its rows here, in the model's dtype; the
positions of such a prompt take those rows instead of the lookup of their (placeholder) ids,
row by row inside a batch that mixes them with prompts of token ids."""

from __future__ import annotations

import math
import mmap

import torch

from treadle.config import LoRAConfig
from treadle.model.attention import (
    AttentionMetadata,
    PrefillChunk,
    kv_row_bytes,
    kv_row_shape,
    resolve_kv_cache_dtype,
)
from treadle.model.llama import LlamaForCausalLM
from treadle.model.llava import LlavaForConditionalGeneration
from treadle.sampling_params import SamplingParams
from treadle.wire.engine import MultiModalInput
from treadle.wire.worker import ModelRunnerOutput, SchedulerOutput
from treadle.worker.encoder_cache import EncoderCache
from treadle.worker.lora_manager import LoRAManager
from treadle.worker.pp_transfer import StageLink
from treadle.worker.sampler import Sampler
from treadle.worker.sampling_rows import SamplingRow, TokenPieces, sampling_row
from treadle.worker.step_results import RequestState, StepResults


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on the CPU in fresh anonymous memory, which the OS commits page by page as it is
    written: a 1 GiB KV cache costs resident memory only for the blocks used so far."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    memory = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=dtype, count=numel).view(shape)  # keeps `memory`


class ModelRunner(StepResults):
    def __init__(
        self,
        model: LlamaForCausalLM,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        seed: int,
        pieces: TokenPieces | None = None,
        kv_dtype: str | None = None,
        lora: LoRAConfig | None = None,
    ) -> None:
        """`pieces`: token texts for the infill sampler (none: requests asking for it fail);
        `kv_dtype`: the KV cache's element type (`attention.resolve_kv_cache_dtype`; default
        the model's dtype)."""
        self.model = model
        self.pieces = pieces
        # Dense -inf masks only for a backend that reads them (the C kernels read lengths).
        self.needs_mask = model.attention_backend.needs_mask
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.kv_dtype = kv_dtype or resolve_kv_cache_dtype("auto", dtype)
        self.sampler = Sampler(seed, device, model.kernels)
        self.requests: dict[str, RequestState] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Pipeline parallelism: this stage's link to its neighbours (`_run_stage`).
        self.link: StageLink | None = None
        # LoRA adapters (None: not enabled).
        self.lora = None if lora is None else LoRAManager(model, lora.max_loras, lora.max_lora_rank)
        # A vision-language model's image features by image hash (None: text only).
        self.encoder_cache = (
            EncoderCache(model.encode_images, device)
            if isinstance(model, LlavaForConditionalGeneration) and model.stage.first
            else None
        )

    def kv_bytes_per_block(self) -> int:
        m = self.model
        per_token = 2 * m.num_kv_heads * kv_row_bytes(self.kv_dtype, m.head_dim)
        return per_token * self.block_size * m.num_layers

    def initialize_cache(self, num_blocks: int) -> None:
        """Per layer a K and a V cache `[kv heads, num_blocks, block_size, row]` of
        `self.kv_dtype` (an int8 row is head_dim values and a 4-byte scale: `attention.py`)."""
        m = self.model
        dtype, width = kv_row_shape(self.kv_dtype, m.head_dim)
        shape = (m.num_kv_heads, num_blocks, self.block_size, width)
        self.kv_caches = [
            (zeros(shape, dtype, self.device), zeros(shape, dtype, self.device))
            for _ in range(m.num_layers)
        ]

    # -- per step --------------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_request_ids:
            self.requests.pop(rid, None)
        for new in sched.new_requests:
            p = new.sampling_params
            seed = p.seed
            self.requests[new.request_id] = RequestState(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                eos_token_id=new.eos_token_id,
                generator=None
                if seed is None
                else self._generator(seed, p, len(new.token_ids) - new.num_prompt_tokens),
                logit_bias=None
                if not p.logit_bias
                else (
                    torch.tensor(list(p.logit_bias), device=self.device),
                    torch.tensor(list(p.logit_bias.values()), device=self.device),
                ),
                allowed_token_ids=None
                if p.allowed_token_ids is None
                else torch.tensor(p.allowed_token_ids, device=self.device),
                prompt_embeds=None
                if new.prompt_embeds is None
                else new.prompt_embeds.to(self.device, self.dtype),
                mm_inputs=new.mm_inputs or None,
                lora=new.lora_request,
            )
        for cached in sched.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _generator(self, seed: int, params: SamplingParams, num_outputs: int) -> torch.Generator:
        """A seeded request's generator, past the draws of the outputs it has already (one
        uniform per sampled token: `Sampler._sample`), so that a request recomputed after a
        preemption or resumed on a new engine core continues its stream exactly."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        if params.temperature > 0.0:
            for _ in range(num_outputs):
                torch.rand(1, generator=generator, device=self.device)
        return generator

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        if not self.model.stage.last:
            self._learn_sampled(sched)
        if not sched.num_scheduled_tokens:
            return ModelRunnerOutput()
        spec = sched.spec_tokens
        # Decode rows first (one token, or a speculating request's 1 + k positions), then
        # prefill chunks: the layout attention expects.
        order = sorted(
            sched.num_scheduled_tokens.items(), key=lambda kv: kv[1] > 1 and kv[0] not in spec
        )
        for rid, proposal in spec.items():  # read after the last token, verified
            self.requests[rid].token_ids.extend(proposal)
        states = [self.requests[rid] for rid, _ in order]
        counts = [n for _, n in order]
        input_ids, positions, meta, logits_rows = self._prepare(states, counts, spec)
        embeds = self._embeds(states, counts)
        if self.encoder_cache is not None:
            encoded, hits, seconds = self.encoder_cache.take_counts()
        if self.lora is not None:  # which rows are whose adapter's
            self.lora.begin_step([(s.lora, n) for s, n in zip(states, counts, strict=True)])
        try:
            hidden = self._forward(input_ids, positions, meta, embeds)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        if hidden is None:  # a stage before the last: its output went on to the next
            for state, n in zip(states, counts, strict=True):
                state.num_computed_tokens += n
            return ModelRunnerOutput()
        result = ModelRunnerOutput()
        if self.encoder_cache is not None:
            result.images_encoded, result.encoder_cache_hits = encoded, hits
            result.encoder_seconds = seconds
        first = 0
        verifying: list[tuple[RequestState, int, int]] = []  # (state, first row, rows)
        for state, n, row in zip(states, counts, logits_rows, strict=True):
            if state.request_id in spec:
                verifying.append((state, first, n))
            if state.sampling_params.pooling is not None:
                self._pool(state, hidden[first : first + n], row is not None, result)
            if state.sampling_params.prompt_logprobs is not None:
                scored = self._prompt_logprobs(state, hidden[first : first + n])
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
            if rows == list(range(rows[0], rows[0] + len(rows))):  # e.g. a decode step's
                picked = hidden[rows[0] : rows[0] + len(rows)]  # (a view: no index tensor)
            else:
                picked = hidden[torch.tensor(rows, device=self.device)]
            logits = self.model.compute_logits(picked)
        if sampling:
            tokens, logprobs = self.sampler(
                logits[: len(sampling)],
                [self._sampling_row(s) for s, _ in sampling],
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
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        embeds: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor | None:
        """The final norm's output, or None on a pipeline stage before the last."""
        if not self.model.stage.whole:
            return self._run_stage(input_ids, positions, meta, embeds)
        return self.model(input_ids, positions, self.kv_caches, meta, embeds)

    def _learn_sampled(self, sched: SchedulerOutput) -> None:
        """A stage that does not sample appends the tokens the last stage sampled."""
        for cached in sched.cached_requests:
            if cached.new_token_ids:
                self.requests[cached.request_id].token_ids.extend(cached.new_token_ids)

    def _run_stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        embeds: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor | None:
        """A pipeline stage's part of the step: the previous stage's (hidden, residual) in
        (none on the first), this stage's layers, then on to the next stage (None), or on the
        last stage the final norm's output."""
        assert self.link is not None
        stage = self.model.stage
        intermediate = None if stage.first else self.link.recv()
        if stage.last:
            return self.model(input_ids, positions, self.kv_caches, meta, embeds, intermediate)
        out = self.model.forward_layers(
            input_ids, positions, self.kv_caches, meta, embeds, intermediate
        )
        assert isinstance(out, tuple)
        self.link.send(*out)
        return None

    def _prepare(
        self, states: list[RequestState], counts: list[int], spec: dict[str, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int | None]]:
        """The step's flat inputs. A speculating request's 1 + k positions are 1 + k decode
        rows (its block table repeated, each row's length its position + 1: causal, since
        every row's K/V is written before attention), so that a step of decodes and
        verifications takes the fused decode path."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logits_rows: list[int | None] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for state, n in zip(states, counts, strict=True):
            start = state.num_computed_tokens
            first = len(ids)
            ids.extend(state.token_ids[start : start + n])
            table = state.block_ids
            new_pos = range(start, start + n)
            pos.extend(new_pos)
            slots.extend(table[p // bs] * bs + p % bs for p in new_pos)
            reaches_end = start + n == len(state.token_ids)
            logits_rows.append(first + n - 1 if reaches_end else None)
            if n == 1 or state.request_id in spec:
                for p in new_pos:
                    decode_tables.append(table)
                    decode_lens.append(p + 1)
            else:
                prefills.append(self._prefill_chunk(first, start, n, table))
        device = self.device
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=device), prefills=prefills)
        if decode_tables:
            meta.num_decodes = len(decode_tables)
            meta.decode_block_table = self._decode_block_table(decode_tables, decode_lens)
            meta.decode_lens = torch.tensor(decode_lens, dtype=torch.int32, device=device)
            if self.needs_mask:
                meta.decode_bias = self._decode_mask(decode_lens, meta.decode_block_table.shape[1])
            meta.decode_max_len = max(decode_lens)
        return (
            torch.tensor(ids, device=device),
            torch.tensor(pos, device=device),
            meta,
            logits_rows,
        )

    def _embeds(
        self, states: list[RequestState], counts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the batch, their embeddings) for the scheduled positions that lie in a
        prompt given as embeddings or on an image's placeholders (its features, from the
        encoder cache: the images this step reaches that it lacks are encoded together);
        None when there are none."""
        rows: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        first = 0
        spans: list[tuple[int, MultiModalInput, int, int]] = []  # (batch row, image, a, b)
        for state, n in zip(states, counts, strict=True):
            start = state.num_computed_tokens
            end = min(start + n, state.num_prompt_tokens)
            if state.prompt_embeds is not None and start < end:
                rows.append(torch.arange(first, first + end - start, device=self.device))
                values.append(state.prompt_embeds[start:end])
            for mm in state.mm_inputs if state.mm_inputs and self.model.stage.first else ():
                a, b = max(start, mm.offset), min(end, mm.offset + mm.length)
                if a < b:
                    spans.append((first + a - start, mm, a - mm.offset, b - mm.offset))
            first += n
        if spans:
            assert self.encoder_cache is not None, "images reach only a vision-language model"
            features = self.encoder_cache.features(mm for _, mm, _, _ in spans)
            for row, mm, a, b in spans:
                rows.append(torch.arange(row, row + b - a, device=self.device))
                values.append(features[mm.hash][a:b].to(self.dtype))
        if not rows:
            return None
        return torch.cat(rows), torch.cat(values)

    def _prefill_chunk(self, first: int, start: int, n: int, table: list[int]) -> PrefillChunk:
        bs, device = self.block_size, self.device
        num_blocks = -(-(start + n) // bs)
        q_pos = torch.arange(start, start + n, device=device)
        blocks = torch.tensor(table[:num_blocks], device=device)
        chunk = PrefillChunk(first, first + n, blocks, (q_pos + 1).to(torch.int32))
        if self.needs_mask:
            ctx = torch.arange(num_blocks * bs, device=device)
            chunk.bias = torch.zeros(n, num_blocks * bs, device=device)
            chunk.bias.masked_fill_(ctx[None, :] > q_pos[:, None], float("-inf"))
        return chunk

    def _decode_block_table(self, tables: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """The decoding requests' block tables, padded with block 0 to the longest context."""
        max_blocks = -(-max(lengths) // self.block_size)
        padded = [t[:max_blocks] + [0] * (max_blocks - min(len(t), max_blocks)) for t in tables]
        return torch.tensor(padded, device=self.device)

    def _decode_mask(self, lengths: list[int], max_blocks: int) -> torch.Tensor:
        """[D, max_blocks * block_size]: 0 inside each request's context, -inf past it."""
        ctx = torch.arange(max_blocks * self.block_size, device=self.device)
        lens = torch.tensor(lengths, device=self.device)
        mask = torch.zeros(len(lengths), max_blocks * self.block_size, device=self.device)
        return mask.masked_fill_(ctx[None, :] >= lens[:, None], float("-inf"))

    def _sampling_row(self, state: RequestState) -> SamplingRow:
        # an embeddings prompt has no tokens to penalize (its ids are placeholders)
        return sampling_row(state, self.pieces, prompt_ids=state.prompt_embeds is None)
