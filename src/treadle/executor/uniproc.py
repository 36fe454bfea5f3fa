"""`UniProcExecutor`: world size 1, so the worker is an object in the engine core process."""

from __future__ import annotations

from typing import Any

import torch

from treadle.config import EngineConfig
from treadle.model.arch import ModelArch
from treadle.wire.worker import ModelRunnerOutput, SchedulerOutput
from treadle.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.threads_pinned():
            # The engine core's own process has set it already; in a user's process (`LLM`
            # with TREADLE_ENABLE_MULTIPROCESSING=0) nothing else would, and `cpu_threads` /
            # TREADLE_CPU_THREADS would go unheard.
            torch.set_num_threads(config.parallel.model_threads())
        self.worker = Worker(config)
        self.worker.load_model()

    @property
    def max_model_len(self) -> int:
        return self.worker.max_model_len

    @property
    def arch(self) -> ModelArch:
        return self.worker.arch

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        try:
            return [getattr(self.worker, method)(*args)]
        except Exception as e:
            raise RuntimeError(f"Worker failed with error '{type(e).__name__}: {e}'") from e

    def determine_num_blocks(self) -> int:
        return int(self.collective_rpc("determine_num_blocks")[0])

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        result: ModelRunnerOutput = self.collective_rpc("execute_model", (sched,))[0]
        return result

    def submit_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """As `MultiprocExecutor.submit_model`; here the step runs at once."""
        return self.execute_model(sched)

    def wait(self, pending: ModelRunnerOutput) -> ModelRunnerOutput:
        return pending

    def shutdown(self) -> None:
        pass
