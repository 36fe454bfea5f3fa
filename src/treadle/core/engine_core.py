"""`EngineCore`: the scheduler and the executor, one `step()` at a time. No sockets: the engine
core process wraps it with IO threads; the offline `LLM` and the tests drive it directly."""

from __future__ import annotations

import faulthandler
import os
import queue
import signal
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from treadle import envs
from treadle.config import EngineConfig, model_source
from treadle.core.engine_report import engine_report
from treadle.core.engine_stats import PeriodicStats, StepMeter, kv_cache_lines
from treadle.core.grammar_matchers import GrammarMatchers
from treadle.core.loras import EngineLoRAs, as_lora_request
from treadle.core.pipeline import BatchQueue, TokenFeed
from treadle.core.prompt_cache import PromptCacheFiles
from treadle.core.prompt_inputs import check_embeds, check_mm_inputs, expand_images
from treadle.core.request import Request
from treadle.core.scheduler import Scheduler
from treadle.executor.base import Executor
from treadle.executor.uniproc import UniProcExecutor
from treadle.logger import init_logger
from treadle.model.arch_files import read_arch
from treadle.validation import (
    InvalidRequest,
    ModelLimits,
    check_request,
    check_resumed,
    is_finite,
)
from treadle.wire.control import StartupPhase
from treadle.wire.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from treadle.wire.topology import EngineChannels, EngineReport
from treadle.wire.worker import ModelRunnerOutput, SchedulerOutput
from treadle.worker.start_checks import check_parallel_layout, resolve_max_model_len

logger = init_logger(__name__)

# How old a `get_topology` answer may be (the dashboard asks every second, per viewer).
TOPOLOGY_CACHE_S = 0.5


class EngineCore:
    """The step and what it needs. The engine core process passes its collaborators here
    (the offline `LLM` and the tests pass none): `aborts_queue`, aborts that arrive during a
    forward pass, applied before its tokens are added so an aborted request gets no more
    outputs; `on_executor_failure(reason, stopped)`, called from the executor's monitor thread
    at once when a worker dies, even while idle; `channels`, the endpoints the handshake gave
    this engine (for `get_topology`)."""

    def __init__(
        self,
        config: EngineConfig,
        engine_index: int = 0,
        *,
        aborts_queue: queue.Queue[list[str]] | None = None,
        on_executor_failure: Callable[[str, bool], None] | None = None,
        channels: EngineChannels | None = None,
        on_phase: Callable[[StartupPhase], None] | None = None,
    ) -> None:
        """`on_phase` is told each phase of the start-up as it begins (the engine core
        process says it on the handshake socket)."""
        start = time.monotonic()
        self.engine_index = engine_index
        self.aborts_queue = aborts_queue
        self.channels = channels
        say = on_phase or (lambda phase: None)
        say(StartupPhase.LOADING_WEIGHTS)
        time.sleep(envs.test_slow_start_s())
        self.executor = make_executor(config, on_executor_failure)
        spec = config.speculative  # a draft model loads before the KV cache takes the rest
        draft = None
        if spec and spec.model:
            from treadle.core.spec_draft import DraftProposer  # (torch: a draft model's runner)

            draft = DraftProposer(config, self.executor.arch)
        say(StartupPhase.PROFILING_KV_CACHE)
        self.num_blocks = self.executor.determine_num_blocks()
        say(StartupPhase.ALLOCATING_KV_CACHE)
        self.executor.initialize_cache(self.num_blocks)
        self.max_model_len = _fit_max_model_len(
            self.executor.max_model_len,
            self.num_blocks * config.cache.block_size,
            explicit=config.model.max_model_len is not None,
        )
        self.vocab_size = self.executor.arch.vocab_size
        self.limits = ModelLimits(self.vocab_size, self.max_model_len, config.model.max_logprobs)
        # The width of accepted `prompt_embeds` (None: refused, no --enable-prompt-embeds).
        self.embeds_width = (
            self.executor.arch.hidden_size if config.model.enable_prompt_embeds else None
        )
        self.loras = EngineLoRAs(config.lora, self.executor)
        # A vision-language model's tower (None: text only) and images per prompt.
        self.vision = self.executor.arch.vision
        self.mm_limit = config.model.limit_mm_per_prompt
        # Outputs of refused requests, by client index, returned by the next step().
        self._refused: dict[int, list[EngineCoreOutput]] = {}
        if draft is not None:
            draft.initialize_cache(self.max_model_len, self.num_blocks)
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            self.num_blocks,
            self.max_model_len,
            config.speculative,
            draft,
            None if config.lora is None else config.lora.max_loras,
        )
        self.prompt_files = PromptCacheFiles(
            config, self.scheduler.kv, self.executor, self.vocab_size
        )
        # Structured-output requests wait here while their grammar compiles (in a thread).
        self.grammars = GrammarMatchers(config.model.model, self.vocab_size)
        self._compiling: list[tuple[Request, Future[Any]]] = []
        self._crash_token = envs.test_crash_on_token()
        self._raise_token = envs.test_raise_on_token()
        self.periodic_stats = (
            None if config.frontend.disable_log_stats else PeriodicStats(engine_index)
        )
        bytes_per_block = sum(self.executor.collective_rpc("kv_bytes_per_block"))
        size, concurrency = kv_cache_lines(
            self.num_blocks, config.cache.block_size, bytes_per_block, self.max_model_len
        )
        self.meter = StepMeter()  # step rates, for `get_topology`
        # Pipeline parallelism: up to pp steps in flight (`core/pipeline.py`).
        pp = config.parallel.pipeline_parallel_size
        self.batch_queue = BatchQueue(pp) if pp > 1 else None
        self.token_feed = TokenFeed()
        self._topology: tuple[float, EngineReport] | None = None
        logger.info(
            "Engine ready in %.1f s: %s, max_model_len %d",
            time.monotonic() - start,
            size,
            self.max_model_len,
        )
        logger.info("%s", concurrency)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. Never raises for what a client sent: a request that fails
        `validation.check_request` (or whose id is already running) is not queued; it finishes
        at once with `FinishReason.ERROR` and the reason as `stop_reason`, in the outputs of
        the next `step()`, for its client alone."""
        try:
            request = expand_images(request, self.vision, self.mm_limit)
            self._check(request)
            req = Request.from_engine_core_request(request)
            so = request.sampling_params.structured_outputs
            if so is None:
                self.scheduler.add_request(req)
            else:
                self._compiling.append((req, self.grammars.submit(so)))
        except InvalidRequest as e:
            self.refuse(request.request_id, request.client_index, str(e))
        except Exception as e:  # a bug, not the client's fault; still only this request's
            logger.exception("Could not add request %r", getattr(request, "request_id", None))
            self.refuse(request.request_id, request.client_index, f"internal error: {e!r}")

    def _check(self, request: EngineCoreRequest) -> None:
        check_request(
            request.prompt_token_ids,
            request.sampling_params,
            self.limits,
            request.eos_token_id,
            request.priority,
        )
        if not is_finite(request.arrival_time):
            raise InvalidRequest("arrival_time", f"must be finite, got {request.arrival_time}")
        if request.prompt_embeds is not None:
            check_embeds(request, self.embeds_width, self.max_model_len)
        if request.mm_inputs or self.vision is not None:
            check_mm_inputs(request, self.vision, self.mm_limit)
        if request.lora_request is not None:
            self.loras.ensure(request.lora_request, self.scheduler.lora_ids())
        if request.resumed_output_token_ids:
            check_resumed(request, self.limits)
        if request.request_id in self.scheduler.requests or any(
            r.request_id == request.request_id for r, _ in self._compiling
        ):
            raise InvalidRequest("request_id", f"{request.request_id!r} is already running")

    def refuse(self, request_id: str, client_index: int, reason: str) -> None:
        """Answer a request that will not run (also one that could not even be decoded) with
        `FinishReason.ERROR` in the next `step()`."""
        logger.warning("Refused request %r: %s", request_id, reason)
        out = EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR, stop_reason=reason)
        self._refused.setdefault(client_index, []).append(out)

    def abort_requests(self, request_ids: list[str]) -> None:
        if self._compiling:
            gone = set(request_ids)
            for req, future in self._compiling:
                if req.request_id in gone:
                    future.cancel()
            self._compiling = [(r, f) for r, f in self._compiling if r.request_id not in gone]
        self.scheduler.abort_requests(request_ids)

    def requests_of(self, client_index: int) -> list[str]:
        """The ids of the requests here (running, waiting or compiling) from that front end."""
        ids = [r.request_id for r, _ in self._compiling if r.client_index == client_index]
        ids += [rid for rid, r in self.scheduler.requests.items() if r.client_index == client_index]
        return ids

    def has_unfinished_requests(self) -> bool:
        """Requests to run (or compiling their grammar), or refusals not yet returned by
        `step()`."""
        return (
            bool(self._refused)
            or bool(self._compiling)
            or self.scheduler.has_unfinished_requests()
            or bool(self.batch_queue)
        )

    def _admit_compiled(self) -> None:
        """Schedule the structured-output requests whose grammar is ready; refuse those whose
        grammar did not compile. With nothing else to run, wait a little for one (instead of
        spinning the busy loop)."""
        if not self.scheduler.has_unfinished_requests():
            wait([f for _, f in self._compiling], timeout=0.01, return_when=FIRST_COMPLETED)
        still = []
        for req, future in self._compiling:
            if not future.done():
                still.append((req, future))
                continue
            try:
                req.grammar = future.result()
                for token in req.output_token_ids:  # a resumed request's outputs so far
                    if not req.grammar.consume_token(token):
                        raise InvalidRequest(
                            "resumed_output_token_ids", "do not follow the request's grammar"
                        )
            except InvalidRequest as e:
                self.refuse(req.request_id, req.client_index, str(e))
                continue
            except Exception as e:  # a bug in a grammar library: this request's alone
                logger.exception("Could not compile the grammar of %r", req.request_id)
                self.refuse(req.request_id, req.client_index, f"internal error: {e!r}")
                continue
            self.scheduler.add_request(req)
        self._compiling = still

    def step(self) -> dict[int, EngineCoreOutputs]:
        """schedule -> execute -> update; returns the outputs for each client index (with the
        refusals of `add_request` since the last step)."""
        if self.periodic_stats is not None:
            self._log_stats()
        if self._compiling:
            self._admit_compiled()
        per_client, self._refused = self._refused, {}
        if self.batch_queue is not None:
            self._step_pipelined(self.batch_queue, per_client)
        elif self.scheduler.has_unfinished_requests():
            sched = self._schedule()
            self._update(sched, self.executor.execute_model(sched), per_client)
        if self.loras.leaving:
            self.loras.sweep(self.scheduler.lora_ids())
        if not per_client:
            return {}
        stats = self.scheduler.make_stats()
        now = time.time()
        return {
            client: EngineCoreOutputs(
                engine_index=self.engine_index, outputs=outs, scheduler_stats=stats, timestamp=now
            )
            for client, outs in per_client.items()
        }

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        if self._crash_token is not None or self._raise_token is not None:
            self._crash_if_poisoned(sched)
        grammar_rows = self.scheduler.grammar_rows(sched)
        if grammar_rows:
            # A speculating request has a row per position it verifies: its id repeats.
            ahead = [sched.spec_tokens.get(r.request_id, []) for r in grammar_rows]
            sched.grammar_request_ids = [
                r.request_id for r, p in zip(grammar_rows, ahead, strict=True) for _ in [0, *p]
            ]
            sched.grammar_bitmask = self.grammars.bitmask([r.grammar for r in grammar_rows], ahead)
        return sched

    def _update(
        self,
        sched: SchedulerOutput,
        result: ModelRunnerOutput,
        per_client: dict[int, list[EngineCoreOutput]],
    ) -> None:
        self.meter.on_step(sched.total_num_scheduled_tokens, len(result.sampled))
        self._apply_eager_aborts()
        for client, outs in self.scheduler.update_from_output(sched, result).items():
            per_client.setdefault(client, []).extend(outs)

    def _step_pipelined(
        self, queue: BatchQueue, per_client: dict[int, list[EngineCoreOutput]]
    ) -> None:
        """vLLM's `step_with_batch_queue` (`core/pipeline.py`): submit one more step while
        fewer than pp are in flight, else apply the oldest one's output."""
        if not queue.full and self.scheduler.has_unfinished_requests():
            sched = self._schedule()
            if sched.num_scheduled_tokens or sched.finished_request_ids:
                self.token_feed.fill(sched, self.scheduler.requests)
                queue.steps.append((sched, self.executor.submit_model(sched)))
                if sched.num_scheduled_tokens and not queue.full:
                    return  # fill the pipeline before waiting
        if queue.steps:
            sched, pending = queue.steps.popleft()
            self._update(sched, self.executor.wait(pending), per_client)

    def _log_stats(self) -> None:
        assert self.periodic_stats is not None
        busy = self.has_unfinished_requests()
        line = self.periodic_stats.tick(self.scheduler, busy, time.monotonic())
        if line is not None:
            logger.info("%s", line)

    def _crash_if_poisoned(self, sched: SchedulerOutput) -> None:
        """The test-only fault hooks (`TREADLE_TEST_CRASH_ON_TOKEN`, `..._RAISE_ON_TOKEN`)."""
        for new in sched.new_requests:
            prompt = new.token_ids[: new.num_prompt_tokens]
            if self._raise_token is not None and self._raise_token in prompt:
                raise RuntimeError(f"TREADLE_TEST_RAISE_ON_TOKEN: raising on {new.request_id!r}")
            if self._crash_token is not None and self._crash_token in prompt:
                logger.error("TREADLE_TEST_CRASH_ON_TOKEN: crashing on %r", new.request_id)
                faulthandler.disable()
                signal.signal(signal.SIGSEGV, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGSEGV)

    def _apply_eager_aborts(self) -> None:
        if self.aborts_queue is None:
            return
        while True:
            try:
                self.scheduler.abort_requests(self.aborts_queue.get_nowait())
            except queue.Empty:
                return

    # -- LoRA adapters (utility calls of the front end) --------------------------------------

    def add_lora(self, request: object) -> bool:
        self.loras.ensure(as_lora_request(request), self.scheduler.lora_ids())
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; its running requests finish first."""
        return self.loras.remove(lora_id, self.scheduler.lora_ids())

    def list_loras(self) -> list[list[Any]]:
        return self.loras.listed()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def get_topology(self) -> EngineReport:
        """This engine's part of `GET /topology` (`core/engine_report.py`). Answered from a
        report at most TOPOLOGY_CACHE_S old: it runs between steps, however many dashboards
        ask."""
        now = time.monotonic()
        if self._topology is None or now - self._topology[0] > TOPOLOGY_CACHE_S:
            self._topology = (now, engine_report(self, self.channels))
        return self._topology[1]

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        """Run `method` on every worker (a utility call, as vLLM's `collective_rpc`)."""
        return self.executor.collective_rpc(method, tuple(args or ()))

    def save_prompt_cache(self, token_ids: list[int], filename: str) -> dict[str, Any]:
        """Write a prompt's cached KV blocks to `filename` in --kv-cache-save-path
        (`core/prompt_cache.py`); a utility call."""
        return self.prompt_files.save(token_ids, filename)

    def restore_prompt_cache(self, filename: str) -> dict[str, Any]:
        """Read a saved prompt's KV blocks into the prefix cache; a utility call."""
        return self.prompt_files.restore(filename)

    def cached_prompt_tokens(self, token_ids: list[int]) -> int:
        """How many tokens of `token_ids` the prefix cache holds (whole blocks)."""
        return len(self.scheduler.kv.cached_prefix(token_ids)) * self.scheduler.kv.block_size

    def reset_prefix_cache(self) -> bool:
        self.scheduler.kv.reset_prefix_cache()
        return True

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.executor.shutdown()


def make_executor(
    config: EngineConfig, on_failure: Callable[[str, bool], None] | None = None
) -> UniProcExecutor | Executor:
    """World size 1: the worker lives here. Otherwise one worker process per rank (or one Ray
    actor per rank with --distributed-executor-backend ray), whose death is reported to
    `on_failure(reason, stopped)`."""
    if config.parallel.world_size == 1:
        if config.parallel.distributed_executor_backend == "ray":
            logger.info("One rank: the model runs in the engine core; Ray has nothing to place")
        return UniProcExecutor(config)
    arch = read_arch(model_source(config.model))
    parallel = config.parallel
    check_parallel_layout(arch, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    max_model_len = resolve_max_model_len(config.model.max_model_len, arch)
    if parallel.distributed_executor_backend == "ray":
        from treadle.executor.ray_executor import RayExecutor  # Ray is an optional dependency

        return RayExecutor(config, arch, max_model_len, on_failure)
    if parallel.nnodes > 1:
        from treadle.executor.multinode import MultinodeExecutor

        return MultinodeExecutor(config, arch, max_model_len, on_failure)
    from treadle.executor.multiproc import MultiprocExecutor  # (torch.distributed's ranks)

    return MultiprocExecutor(config, arch, max_model_len, on_failure)


def _fit_max_model_len(max_model_len: int, kv_capacity: int, explicit: bool) -> int:
    """A request must fit in the KV cache alone, or it could be preempted forever. An explicit
    max_model_len that does not fit is an error; the model's own limit is lowered instead."""
    if max_model_len <= kv_capacity:
        return max_model_len
    if explicit:
        raise ValueError(
            f"max_model_len {max_model_len} does not fit in the KV cache ({kv_capacity} tokens): "
            "lower --max-model-len or raise --kv-cache-memory"
        )
    logger.warning(
        "The KV cache holds %d tokens, fewer than the model's limit %d: max_model_len is %d",
        kv_capacity,
        max_model_len,
        kv_capacity,
    )
    return kv_capacity
