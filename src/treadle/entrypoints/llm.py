"""`LLM`: the offline Python API, as vLLM's (`generate`, `chat`), over an `EngineCore`."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from PIL import Image
from tqdm import tqdm

from treadle import envs
from treadle.config import model_source
from treadle.engine_args import EngineArgs
from treadle.entrypoints.openai.protocol import ImagePart, template_message
from treadle.frontend.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    eos_token_ids,
    step_logprobs,
)
from treadle.frontend.images import ImageInputs
from treadle.frontend.input_processor import InputProcessor, PreparedRequest, PromptType
from treadle.frontend.media import MediaPolicy, load_image, to_rgb
from treadle.frontend.output_processor import OutputProcessor
from treadle.frontend.sync_client import InprocClient, SyncMPClient
from treadle.logger import init_logger
from treadle.model.arch_files import read_arch
from treadle.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    unit_vector,
)
from treadle.sampling_params import BeamSearchParams, SamplingParams, generation_defaults
from treadle.tokenizer import load_model_tokenizer
from treadle.validation import InvalidRequest, ModelLimits
from treadle.wire.engine import LoRARequest, MultiModalInput, SchedulerStats
from treadle.worker.start_checks import check_parallel_layout

logger = init_logger(__name__)

Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`kwargs`: any `EngineArgs` field, with vLLM's names (`dtype`, `max_model_len`,
        `max_num_seqs`, `kv_cache_memory_bytes`, `tensor_parallel_size`, ...). vLLM's
        arguments that mean nothing here (`gpu_memory_utilization`, `enforce_eager`, ...) log a
        warning; an unknown name raises `TypeError` naming the closest known one."""
        kwargs.setdefault("disable_log_stats", True)  # as vLLM's LLM: no periodic stats line
        args, warnings = EngineArgs.from_kwargs(model=model, **kwargs)
        for warning in warnings:
            logger.warning("LLM: %s", warning)
        self.config = args.create_engine_config()
        source = model_source(self.config.model)  # fail fast on a bad path
        arch = read_arch(source)  # on a checkpoint corrupt or unsupported, on --hf-overrides
        tensor_parallel_size = args.tensor_parallel_size
        if tensor_parallel_size > 1:
            check_parallel_layout(arch, tensor_parallel_size)
        hidden_size = arch.hidden_size if args.enable_prompt_embeds else None
        self.engine: SyncMPClient | InprocClient = (
            SyncMPClient(self.config)
            if envs.enable_multiprocessing()
            else InprocClient(self.config)
        )
        self.tokenizer = load_model_tokenizer(self.config.model)
        info = self.engine.info
        limits = ModelLimits(info.vocab_size, info.max_model_len, args.max_logprobs)
        images = ImageInputs.for_model(
            source.path,
            arch.vision,
            self.tokenizer,
            self.config.model.dtype,
            self.config.model.limit_mm_per_prompt,
        )
        self.input_processor = InputProcessor(
            self.tokenizer, limits, hidden_size=hidden_size, images=images
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._loras: dict[int, str] = {}  # adapters the engine has read: id -> path
        self._sampling_defaults = generation_defaults(self.config.model)

    @property
    def engine_core(self) -> Any:
        """The in-process `EngineCore` (only with TREADLE_ENABLE_MULTIPROCESSING=0)."""
        if not isinstance(self.engine, InprocClient):
            raise AttributeError(
                "the engine core runs in another process; see TREADLE_ENABLE_MULTIPROCESSING"
            )
        return self.engine.engine_core

    def get_stats(self) -> SchedulerStats:
        """The scheduler's counters (running, waiting, KV usage, prefix hits, preemptions)."""
        stats = self.engine.call_utility("get_stats")
        return stats if isinstance(stats, SchedulerStats) else SchedulerStats(*stats)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Call `method(*args)` on every worker; a worker's error raises `RuntimeError`."""
        return list(self.engine.call_utility("collective_rpc", method, list(args)))

    def save_prompt_cache(self, prompt: PromptType, filename: str) -> dict[str, Any]:
        """Save the KV blocks of a prompt run before (its whole blocks still in the prefix
        cache) to `filename` in `kv_cache_save_path`: {"n_saved": tokens, "n_written": bytes,
        ...}. Raises `ValueError` saying why nothing could be saved."""
        _, ids = self.input_processor.tokenize(prompt)
        return _answer(self.engine.call_utility("save_prompt_cache", ids, filename))

    def restore_prompt_cache(self, filename: str) -> dict[str, Any]:
        """Read a saved prompt's KV blocks into the prefix cache: the next request with that
        prompt reads it from there. Raises `ValueError` for a file that does not fit."""
        return _answer(self.engine.call_utility("restore_prompt_cache", filename))

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a prompt given no `SamplingParams` is sampled with: vLLM's defaults, with the
        model's generation_config.json over them (`generation_config`, "auto" by default)."""
        return SamplingParams(**self._sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts.
        Every prompt and its parameters are checked first (`InvalidRequest`, a `ValueError`,
        naming the field); if the engine core still refuses one, its output finishes with
        `finish_reason` "error" and the reason in `stop_reason`. A prompt may be
        `{"prompt_embeds": tensor}` ([tokens, hidden_size], with `enable_prompt_embeds=True`).
        `lora_request`: the adapter every prompt runs with, or one per prompt (vLLM's;
        `enable_lora=True`)."""
        prompt_list = _as_list(prompts)
        params_list = self._params_for(prompt_list, sampling_params)
        priorities = priority or [0] * len(prompt_list)
        loras = (
            list(lora_request)
            if isinstance(lora_request, Sequence)
            else [lora_request] * len(prompt_list)
        )
        if len(loras) != len(prompt_list):
            raise ValueError(f"got {len(loras)} lora requests for {len(prompt_list)} prompts")
        # Prepare everything before queueing anything: a bad prompt leaves the engine as it was.
        requests = [
            self._prepare(prompt, params, prio, lora)
            for prompt, params, prio, lora in zip(
                prompt_list, params_list, priorities, loras, strict=True
            )
        ]
        for request in requests:
            self._add(request)
        ids = [request.request_id for request in requests]
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            for out in self._run():
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        return [finished[rid] for rid in ids]

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: each prompt's best `params.beam_width` sequences (prompt
        and output ids, `text` their decoded whole, `cum_logprob`, the `score` that ranked
        them), as transformers' `generate(num_beams=...)` finds them (`frontend/beam_search.py`:
        one engine request per beam and step, the prompts' steps batched together)."""
        max_logprobs = self.config.model.max_logprobs
        if params.num_logprobs > max_logprobs:
            raise ValueError(
                f"beam_width {params.beam_width} asks {params.num_logprobs} logprobs a step; "
                f"max_logprobs is {max_logprobs} (raise it, or narrow the beam)"
            )
        limit = self.engine.info.max_model_len
        searches = []
        for prompt in _as_list(prompts):
            _, ids = self.input_processor.tokenize(prompt)
            if len(ids) + params.max_tokens > limit:
                raise ValueError(
                    f"the prompt's {len(ids)} tokens and max_tokens {params.max_tokens} exceed "
                    f"max_model_len {limit}"
                )
            searches.append(BeamSearch(ids, params, eos_token_ids(self.tokenizer)))
        step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=params.num_logprobs)
        while True:
            batch = [(search, ids) for search in searches for ids in search.pending()]
            if not batch:
                break
            outs = self.generate(
                [{"prompt_token_ids": ids} for _, ids in batch],
                step,
                use_tqdm=False,
                lora_request=lora_request,
            )
            for search in searches:
                tops = [
                    step_logprobs(out)
                    for (s, _), out in zip(batch, outs, strict=True)
                    if s is search
                ]
                if tops:
                    search.advance(tops)
        results = []
        for search in searches:
            best = search.results()
            for seq in best:
                seq.text = self.tokenizer.decode(seq.tokens)
            results.append(BeamSearchOutput(best))
        return results

    def embed(
        self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (vLLM's `LLM.embed`): the final hidden state pooled as
        `pooling_type` says (last position, or mean), normalised to length 1. Pooling requests
        read their prompt only and share the engine's steps with generation."""
        params = SamplingParams(
            max_tokens=1, temperature=0.0, pooling=self.config.model.pooling_type
        )
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm)
        return [
            EmbeddingRequestOutput(
                out.request_id,
                out.prompt_token_ids,
                EmbeddingOutput(unit_vector(out.pooled).tolist()),
            )
            for out in outputs
        ]

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        images = self.input_processor.images
        placeholder = ""
        if images is not None and not images.template_reads_parts(
            (chat_template_kwargs or {}).get("chat_template") or self.tokenizer.chat_template
        ):
            placeholder = images.placeholder
        for conv in conversations:
            # Content given as a list of parts: text parts joined (vLLM's "string" format);
            # for a vision-language model `image_url` parts too (data: URIs; the template
            # writes their placeholders), others refused (`InvalidRequest`).
            parts: list[ImagePart] | None = None if images is None else []
            conv = [template_message(m, i, parts, placeholder) for i, m in enumerate(conv)]  # type: ignore[arg-type]
            text = self.input_processor.apply_chat_template(
                conv,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            # The template already holds the special tokens: do not add them twice.
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
            if parts:
                policy = MediaPolicy()  # data: URIs (no file or host is allowed offline)
                pictures = [load_image(p.url, policy, p.where) for p in parts]
                prompt["multi_modal_data"] = {"image": pictures}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the growing output of one prompt after every step (the CLI streams with it)."""
        params = sampling_params or self.get_default_sampling_params()
        self._add(self._prepare(prompt, params, 0))
        yield from self._run()

    def _prepare(
        self,
        prompt: PromptType,
        params: SamplingParams,
        priority: int,
        lora: LoRARequest | None = None,
    ) -> PreparedRequest:
        request_id = str(next(self._ids))
        if lora is not None:
            self._engine_has(lora)
        prepare = functools.partial(self.input_processor.prepare, lora_request=lora)
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:
            embeds = self.input_processor.check_embeds(prompt["prompt_embeds"])
            return prepare(request_id, None, [], params, priority, embeds)
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            rest = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
            text, tokens = self.input_processor.tokenize(rest)
            tokens, images = self._images(tokens, prompt["multi_modal_data"])
            return prepare(request_id, text, tokens, params, priority, mm_inputs=images)
        text, tokens = self.input_processor.tokenize(prompt)
        return prepare(request_id, text, tokens, params, priority)

    def _engine_has(self, lora: LoRARequest) -> None:
        """The engine reads the adapter now (once), so that a bad one fails this call."""
        if self.config.lora is None:
            raise InvalidRequest("lora_request", "LoRA adapters need LLM(enable_lora=True)")
        if not isinstance(lora, LoRARequest):
            raise InvalidRequest("lora_request", "must be a treadle.LoRARequest(name, id, path)")
        if self._loras.get(lora.lora_int_id) != lora.lora_path:
            try:
                self.engine.call_utility("add_lora", lora)
            except Exception as e:  # the engine's refusal, as the caller's error
                raise InvalidRequest("lora_request", str(e).split("InvalidRequest: ")[-1]) from None
            self._loras[lora.lora_int_id] = lora.lora_path

    def _images(self, tokens: list[int], data: Any) -> tuple[list[int], list[MultiModalInput]]:
        """vLLM's `multi_modal_data`: `{"image": PIL.Image or a list of them}`, one per
        placeholder of the prompt (the image token's text, e.g. `<image>`)."""
        images = self.input_processor.images
        if images is None:
            raise InvalidRequest("multi_modal_data", "this model takes no images (text only)")
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise InvalidRequest("multi_modal_data", 'takes {"image": a PIL image or a list}')
        given = data.get("image")
        pictures = [p for p in (given if isinstance(given, list) else [given])]
        rgb = [to_rgb(p) for p in pictures if isinstance(p, Image.Image)]
        if len(rgb) != len(pictures):
            raise InvalidRequest("multi_modal_data", "images must be PIL images")
        return images.prompt(tokens, rgb, "prompt")

    def _add(self, request: PreparedRequest) -> None:
        self.output_processor.add_request(
            request.request_id, request.prompt, request.shown_prompt_token_ids, request.params
        )
        for child in request.children:
            self.engine.add_request(child)

    def _run(self) -> Iterator[RequestOutput]:
        while self.output_processor.has_unfinished():
            outputs = self.engine.get_output()
            results, to_abort = self.output_processor.process_outputs(outputs.outputs)
            if to_abort:
                self.engine.abort_requests(to_abort)
            yield from results

    def _params_for(
        self, prompts: list[PromptType], params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * len(prompts)
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        return list(params)


def _answer(result: dict[str, Any]) -> dict[str, Any]:
    if "error" in result:
        raise ValueError(result["error"])
    return {k: v for k, v in result.items() if k != "token_ids"}


def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return list(prompts)  # type: ignore[arg-type]
