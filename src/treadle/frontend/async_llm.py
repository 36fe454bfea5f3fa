"""`AsyncLLM`: the API server's engine client. Sends the requests its `InputProcessor` prepared
(truncated, checked, fanned out) to the engine core processes, and turns their outputs into
`RequestOutput`s for each waiting caller.

Each request has a `RequestOutputCollector`. Outputs are cumulative (text and tokens so far),
so a consumer that falls behind simply gets the latest one: the deltas merge by themselves.
Cancelling `generate()` (a client that disconnected) aborts the request in the engine core.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from treadle.config import EngineConfig, resolve_model
from treadle.frontend.async_client import AsyncMPClient, stop_this_process
from treadle.frontend.core_client import AttachTo, EngineDeadError
from treadle.frontend.engine_state import ShownState
from treadle.frontend.images import ImageInputs
from treadle.frontend.input_processor import InputProcessor, PreparedRequest
from treadle.frontend.metrics import StatLogger
from treadle.frontend.output_processor import OutputProcessor
from treadle.frontend.request_stats import LatencyWindow, RequestStatsTable
from treadle.frontend.startup import StartupProgress
from treadle.ipc.zmq_utils import get_bound_address
from treadle.logger import init_logger
from treadle.model.arch_files import read_arch
from treadle.outputs import RequestOutput
from treadle.tokenizer import load_model_tokenizer
from treadle.validation import InvalidRequest, ModelLimits
from treadle.wire.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

logger = init_logger(__name__)

HEALTH_PING_INTERVAL_S = 1.0
"""How often each engine gets a health ping (at most; a quarter of --engine-stall-timeout
when that is shorter)."""


@dataclass(eq=False)
class RequestOutputCollector:
    latest: RequestOutput | None = None
    error: BaseException | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, output: RequestOutput) -> None:
        self.latest = output
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    async def get(self) -> RequestOutput:
        """The latest output; once the request failed, the error (after an output still
        pending: the next call raises)."""
        await self.ready.wait()
        if self.latest is None:
            assert self.error is not None
            raise self.error
        if self.error is None:
            self.ready.clear()
        out, self.latest = self.latest, None
        return out


class AsyncLLM:
    """The API server's engine: requests in, `RequestOutput`s out; it is its client's
    `ClientListener` (outputs, failed requests, restart events, the engines' end)."""

    def __init__(
        self,
        config: EngineConfig,
        model_name: str,
        shutdown_timeout: float = 0.0,
        client_index: int = 0,
        attach: AttachTo | None = None,
        progress: StartupProgress | None = None,
    ):
        """Starts the engines (or attaches to them) and returns once they are ready;
        `progress` is told how far their start-up got (it is `finish`ed here)."""
        self.config = config
        self.client_index = client_index
        self.model_name = model_name
        self.shutdown_timeout = shutdown_timeout
        # Load the tokenizer while the engine core loads the model (both take seconds).
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer-load") as pool:
            tokenizer = pool.submit(load_model_tokenizer, config.model)
            self.client = AsyncMPClient(
                config,
                self,
                shutdown_timeout=shutdown_timeout,
                client_index=client_index,
                attach=attach,
                progress=progress,
            )
            self.tokenizer = tokenizer.result()
        if config.frontend.chat_template is not None:  # --chat-template
            self.tokenizer.chat_template = config.frontend.chat_template
        info = self.client.info
        self.max_model_len = info.max_model_len
        limits = ModelLimits(info.vocab_size, info.max_model_len, config.model.max_logprobs)
        source = resolve_model(config.model.model)
        arch = read_arch(source)
        # prompt_embeds are refused unless --enable-prompt-embeds
        hidden_size = arch.hidden_size if config.model.enable_prompt_embeds else None
        images = ImageInputs.for_model(
            source.path,
            arch.vision,
            self.tokenizer,
            config.model.dtype,
            config.model.limit_mm_per_prompt,
        )
        self.input_processor = InputProcessor(
            self.tokenizer,
            limits,
            config.frontend.max_prompt_chars,
            client_index,
            hidden_size,
            images,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.collectors: dict[str, RequestOutputCollector] = {}
        self._when_dead: list[Callable[[str], None]] = []
        self.request_stats = RequestStatsTable()
        # Engine-wide counters reach every API server; only the first one adds them up.
        self.stat_loggers = [
            StatLogger(
                model_name,
                self.max_model_len,
                engine,
                count_engine_totals=client_index == 0,
                max_loras=config.lora.max_loras if config.lora else None,
            )
            for engine in range(self.client.num_engines)
        ]
        for stat_logger in self.stat_loggers:
            stat_logger.record_cache_config(config.cache, info.num_blocks)
        self.last_output_time = time.monotonic()
        self.latencies = LatencyWindow(self.client.num_engines)  # for the dashboard
        self._pings: dict[int, int] = {}  # rank -> the generation of its ping task
        self.progress = progress or StartupProgress(self.client.num_engines)
        self.progress.finish()

    def start(self) -> None:
        """Start reading engine outputs and pinging the engines; call inside the running event
        loop. (The periodic stats line comes from each engine core, which sees all of its
        requests.)"""
        self.client.start()
        self._start_pings(0)

    def _start_pings(self, first: int) -> None:
        for rank in range(first, self.client.num_engines):
            ping = self._ping(rank, self._pings.get(rank, 0) + 1)
            self.client.spawn(ping, f"health pings of engine core {rank}")

    async def scale(self, n: int, drain_timeout: float) -> int:
        """Scale to `n` engines (`POST /scale`, `engine_scale.py`); returns the size before."""
        return await self.client.scaler.scale(n, drain_timeout)

    @property
    def dead(self) -> bool:
        return self.client.dead_reason is not None

    async def generate(
        self, request: PreparedRequest, data_parallel_rank: int | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Send a request `input_processor.prepare` made (checked there, once) and yield its
        growing output until it finishes; raises `EngineDeadError` if the engine dies,
        `InvalidRequest` (a `ValueError`) for a request the engine core refuses, `ValueError`
        for a DP rank that does not exist."""
        if self.dead:
            raise EngineDeadError(self.client.dead_reason or "the engine core is dead")
        request_id, params = request.request_id, request.params
        prompt_token_ids = request.prompt_token_ids
        collector = RequestOutputCollector()
        self.collectors[request_id] = collector
        self.request_stats.add(
            request_id,
            [r.request_id for r in request.children],
            time.monotonic(),
            len(prompt_token_ids),
            params.max_tokens,
            len(request.children[0].mm_inputs or ()) if request.children else 0,
            _lora_name(request),
        )
        self.output_processor.add_request(
            request_id, request.prompt, request.shown_prompt_token_ids, params
        )
        if self.config.frontend.enable_log_requests:
            logger.info(
                "Received request %s: %d prompt tokens, params: %s",
                request_id,
                len(prompt_token_ids),
                params,
            )
        finished = False
        try:
            for child in request.children:
                await self.client.add_request(child, data_parallel_rank)
            while True:
                out = await collector.get()
                _raise_if_refused(out)
                finished = out.finished
                if finished and self.config.frontend.enable_log_requests:
                    logger.info(
                        "Finished request %s: %s, %d output tokens",
                        request_id,
                        ", ".join(str(c.finish_reason) for c in out.outputs),
                        sum(len(c.token_ids) for c in out.outputs),
                    )
                yield out
                if finished:
                    return
        finally:
            self.collectors.pop(request_id, None)
            self.request_stats.forget(request_id)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        child_ids = self.output_processor.abort(request_id)
        self.collectors.pop(request_id, None)
        self.request_stats.forget(request_id)
        if child_ids:
            await self.client.abort_requests(child_ids)

    async def get_stats(self) -> list[Any]:
        """Every engine's `SchedulerStats` (a call to each: also a liveness check)."""
        calls = [
            self.client.call_utility("get_stats", engine=e) for e in range(self.client.num_engines)
        ]
        return list(await asyncio.gather(*calls))

    # -- what /topology and the dashboard read (`frontend/topology.py:Engines`) ---------------

    def shown_states(self) -> list[ShownState]:
        """Each engine's state as `/topology` and the dashboard show it."""
        client = self.client
        dead = client.dead_reason is not None
        return [ShownState.of(slot, dead) for slot in client.restarts.slots]

    async def topology_report(self, rank: int) -> Any:
        return await self.client.call_utility("get_topology", engine=rank)

    def coordinator_address(self) -> str:
        sock = self.client.coordinator_socket
        return get_bound_address(sock) if sock is not None else ""

    def last_deaths(self) -> list[dict[str, Any] | None]:
        return [
            s.last_death.to_json() if s.last_death else None for s in self.client.restarts.slots
        ]

    def event_counts(self) -> dict[str, int]:
        return self.client.watch.counts.to_json()

    # -- health: /health (liveness) and /health/ready (readiness) --------------------------
    #
    # Both answer at once from what the front end knows; neither waits for an engine. An
    # engine shows it lives by finishing steps while it has requests (the stall watch of
    # `engine_restarts.py`) and by answering a health ping (a `get_stats` call, at most one
    # unanswered per engine, sent every HEALTH_PING_INTERVAL_S): the pings catch an engine
    # that froze while it had nothing to do, which makes no steps to miss.

    def liveness(self) -> str | None:
        """None while this server should be left running (/health), else why not: its engines
        are dead (no restart left), or one has shown no sign of life for longer than
        --engine-stall-kill-timeout (an engine of this host that the front end restarts is
        killed at that point and counts as alive while it restarts; one it cannot kill is
        for the orchestrator to restart). A restarting engine, or a lost remote one with the
        others serving on, is alive."""
        if self.client.dead_reason is not None:
            return f"the engine is dead: {self.client.dead_reason}"
        kill = self.config.restart.engine_stall_kill_timeout
        for rank, (step, ping) in enumerate(self._silences()):
            # A busy engine of ours is killed by the stall watch at this point, and restarted.
            killed = step > kill and rank in self.client.killable
            if kill > 0 and max(step, ping) > kill and not killed:
                return (
                    f"engine core {rank} has shown no sign of life for {max(step, ping):.0f} s "
                    "(--engine-stall-kill-timeout)"
                )
        return None

    def readiness(self) -> str | None:
        """None when ready to serve at full speed (/health/ready), else why not: an engine is
        restarting, lost or resuming, or has shown no sign of life for longer than
        --engine-stall-timeout."""
        why = self.client.readiness()
        if why is not None:
            return why
        timeout = self.config.restart.engine_stall_timeout
        for rank, (step, ping) in enumerate(self._silences()):
            if step > timeout:  # (the stall watch says so too, within a quarter second)
                return f"engine core {rank} has requests but finished no step for {step:.0f} s"
            if ping > timeout:
                return f"engine core {rank} has not answered a health ping for {ping:.0f} s"
        return None

    def silence(self) -> list[float]:
        """Seconds each engine has gone without a sign of life: since its last finished step
        while it has requests, or since the health ping it has not answered, whichever is
        longer. 0 for an engine that is restarting or lost (its state says so)."""
        return [max(step, ping) for step, ping in self._silences()]

    def _silences(self) -> list[tuple[float, float]]:
        """Each engine's (seconds since its last step while it has requests, seconds since
        the health ping it has not answered)."""
        now = time.monotonic()
        restarts = self.client.restarts
        silences = []
        for rank, slot in enumerate(restarts.slots):
            if not slot.state.serves:
                silences.append((0.0, 0.0))
                continue
            busy = self.client.inflight.count(rank) > 0
            step = now - slot.last_progress if busy else 0.0
            sent = slot.ping_sent
            silences.append((step, 0.0 if sent is None else now - sent))
        return silences

    async def _ping(self, rank: int, generation: int) -> None:
        """Health pings to one engine, one at a time. A call that fails (the engine died, or
        restarts) is no silence: the engine's state says what happened. Ends when the rank
        is removed (`POST /scale`; one added again gets a new task, of a new generation)."""
        interval = min(HEALTH_PING_INTERVAL_S, self.config.restart.engine_stall_timeout / 4)
        self._pings[rank] = generation
        while not self.client.ended and self._pings.get(rank) == generation:
            if rank >= self.client.num_engines:
                self._pings.pop(rank, None)
                return
            if self.client.engine_states[rank].serves:
                self.client.restarts.ping(rank, sent=True)
                try:
                    await self.client.call_utility("get_stats", engine=rank)
                except EngineDeadError:
                    pass
                finally:
                    self.client.restarts.ping(rank, sent=False)
            await asyncio.sleep(interval)

    # -- what the client tells (`ClientListener`) ------------------------------------------

    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        now = time.monotonic()
        self.last_output_time = now
        stat_logger = self.stat_loggers[outputs.engine_index]
        if outputs.scheduler_stats is not None:
            stat_logger.record_scheduler_stats(outputs.scheduler_stats)
        results, to_abort = self.output_processor.process_outputs(outputs.outputs)
        engine_ts = outputs.timestamp or time.time()
        iteration = self.request_stats.iteration(outputs.outputs, to_abort, now, engine_ts)
        stat_logger.record_iteration(iteration)
        self.latencies.observe(outputs.engine_index, iteration)
        for out in results:
            collector = self.collectors.get(out.request_id)
            if collector is not None:
                collector.put(out)
        if to_abort:
            self.client.spawn(self.client.abort_requests(to_abort), "abort", fatal=False)

    def on_failed(self, rank: int, request_ids: list[str], error: Exception) -> None:
        """The client failed these engine requests (children of n > 1 included): each one's
        caller gets `error`; they end with finish reason `error` in the metrics."""
        for rid in request_ids:
            collector = self.collectors.pop(self.output_processor.parent_of(rid), None)
            if collector is not None:
                collector.fail(error)
        ends = [EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR) for rid in request_ids]
        self.on_outputs(EngineCoreOutputs(engine_index=rank, outputs=ends))

    def on_event(self, kind: str, engine: int, count: int) -> None:
        self.stat_loggers[engine].record_event(kind, count)

    def on_dead(self, reason: str) -> None:
        logger.error("Engine core is dead: %s", reason)
        error = EngineDeadError(reason)
        for collector in self.collectors.values():
            collector.fail(error)
        for callback in self._when_dead:
            callback(reason)

    def on_stopped(self, reason: str) -> None:
        """An engine stopped on purpose answered every request it had before saying so; a
        request still open here reached it too late (during its last moments): end it now,
        or its stream would hold the server's shutdown until uvicorn cancels it."""
        error = EngineDeadError(reason)
        for collector in self.collectors.values():
            collector.fail(error)
        stop_this_process(reason)

    def on_resize(self, num_engines: int) -> None:
        """Engines added (their metrics, dashboard windows and health pings start) or the
        highest removed (their counters keep their totals, their gauges go to 0; their pings
        end)."""
        old, n = len(self.stat_loggers), num_engines
        for removed in self.stat_loggers[n:]:
            removed.retire()
        del self.stat_loggers[n:]
        for engine in range(old, n):
            stat_logger = StatLogger(
                self.model_name,
                self.max_model_len,
                engine,
                self.client_index == 0,
                self.config.lora.max_loras if self.config.lora else None,
            )
            stat_logger.record_cache_config(self.config.cache, self.client.info.num_blocks)
            self.stat_loggers.append(stat_logger)
        self.latencies.resize(n)
        self.progress.resize(n)
        if n > old:
            self._start_pings(old)

    def when_dead(self, callback: Callable[[str], None]) -> None:
        """Run `callback(reason)` after `on_dead` (the API server stops serving)."""
        self._when_dead.append(callback)

    def shutdown(self) -> None:
        self.client.shutdown()


def _raise_if_refused(out: RequestOutput) -> None:
    """An engine core refuses a request it cannot run with a finish reason "error" (see
    `EngineCore.add_request`); the caller gets it as the same error the front end raises."""
    for comp in out.outputs:
        if comp.finish_reason == str(FinishReason.ERROR):
            raise InvalidRequest(None, f"the engine refused the request: {comp.stop_reason}")


def _lora_name(request: PreparedRequest) -> str | None:
    lora = request.children[0].lora_request if request.children else None
    return None if lora is None else lora.lora_name
