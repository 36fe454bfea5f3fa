"""The offline `LLM`'s engine clients: `SyncMPClient` (engine core processes, outputs read
by a thread into a queue) and `InprocClient` (the engine core in this process,
`TREADLE_ENABLE_MULTIPROCESSING=0`). Both offer add_request / abort_requests / get_output /
call_utility / shutdown.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any

from treadle.config import EngineConfig
from treadle.frontend.core_client import EngineDeadError, EngineInfo, MPClient, settle_utility
from treadle.logger import init_logger
from treadle.wire.control import ENGINE_CORE_DEAD, ENGINE_CORE_STOPPED, DeathReport
from treadle.wire.engine import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
from treadle.worker.start_checks import check_config

logger = init_logger(__name__)


class SyncMPClient(MPClient):
    """For the offline `LLM`: a thread moves decoded outputs into a queue. The ROUTER is used
    by the caller's thread and the reader's (which drains it), so both hold `_input_lock`."""

    def __init__(self, config: EngineConfig, shutdown_timeout: float = 0.0):
        if config.parallel.data_parallel_size > 1:
            raise ValueError("data parallelism is served by `treadle serve -dp N`, not by LLM")
        super().__init__(config, shutdown_timeout)
        self.outputs: queue.Queue[EngineCoreOutputs | str] = queue.Queue()
        self._utility: dict[int, Future[Any]] = {}
        self._input_lock = threading.Lock()
        self._reader = threading.Thread(target=self._run_reader, name="engine-outputs", daemon=True)
        self._reader.start()

    def _run_reader(self) -> None:
        try:
            self._read_outputs()
        except Exception as e:
            if self._closed:
                return
            logger.exception("The engine output reader failed")
            self._mark_dead(f"the engine output reader failed: {type(e).__name__}: {e}")

    def _read_outputs(self) -> None:
        assert self.output_socket is not None and self.input_socket is not None
        while not self._closed:
            with self._input_lock:
                while self.input_socket.poll(0):  # (an engine that connected again)
                    self._admit(self.input_socket.recv_multipart())
            if not self.output_socket.poll(200):
                continue
            item = self.reader.read(self.output_socket.recv_multipart(copy=False))
            if item is None:
                continue
            if isinstance(item, DeathReport):
                self._mark_dead(f"the engine core failed: {item.describe()}")
                return
            if item == ENGINE_CORE_DEAD:
                self._mark_dead("the engine core reported a fatal error (see its log)")
                return
            if item == ENGINE_CORE_STOPPED:
                self._mark_stopped("the engine core was stopped")
                return
            assert isinstance(item, EngineCoreOutputs)
            if item.utility_output is not None:
                settle_utility(self._utility, item.utility_output)
                continue
            self.outputs.put(item)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            self.outputs.put(reason)
            for fut in list(self._utility.values()):
                fut.set_exception(EngineDeadError(reason))
            self._utility.clear()

    def _mark_stopped(self, reason: str) -> None:
        self._mark_dead(reason)  # no error to log: whoever stopped it knows why

    def _send(self, frames: list[Any], copy: bool = True) -> None:
        assert self.input_socket is not None
        with self._input_lock:
            self.input_socket.send_multipart(frames, copy=copy)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        identity = self._route(request, None)
        self._send(self._frames(identity, EngineCoreRequestType.ADD, request), copy=False)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None:
            for frames in self._abort_frames(request_ids):
                self._send(frames)

    def get_output(self) -> EngineCoreOutputs:
        item = self.outputs.get()
        if isinstance(item, str):
            self.outputs.put(item)  # later callers see it too
            raise EngineDeadError(item)
        return item

    def call_utility(self, method: str, *args: Any, timeout: float | None = 60.0) -> Any:
        self._check_alive()
        call_id = next(self._call_ids)
        fut: Future[Any] = Future()
        frames = self._utility_frames(0, call_id, method, args)
        self._utility[call_id] = fut
        self._send(frames)
        return fut.result(timeout)


class InprocClient:
    """The engine core in this process (`TREADLE_ENABLE_MULTIPROCESSING=0`): same calls as
    `SyncMPClient`, `get_output` runs steps itself."""

    def __init__(self, config: EngineConfig):
        from treadle.core.engine_core import EngineCore

        check_config(config)  # the same start-up checks as the launcher's
        self.engine_core = EngineCore(config)
        self.info = EngineInfo(
            self.engine_core.num_blocks, self.engine_core.max_model_len, self.engine_core.vocab_size
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        while self.engine_core.has_unfinished_requests():
            outputs = self.engine_core.step().get(0)
            if outputs is not None:
                return outputs
        return EngineCoreOutputs()

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
