"""`UniProcExecutor`: world size 1, so the worker is an object in the engine core process: the
lean runner's (`worker/lean_worker.py`, no torch in the process) where it takes the model,
else the torch runner's `Worker`."""

from __future__ import annotations

from typing import Any

from treadle.config import EngineConfig
from treadle.logger import init_logger
from treadle.model.arch import ModelArch
from treadle.wire.worker import ModelRunnerOutput, SchedulerOutput
from treadle.worker.lean_worker import LeanWorker, open_lean

logger = init_logger(__name__)


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        chosen = open_lean(config)
        self.worker: Any
        if isinstance(chosen, str):
            logger.info("The torch runner runs the model: %s", chosen)
            from treadle.worker.worker import Worker  # imports torch

            self.worker = Worker(config)
        else:
            logger.info("The lean runner (no PyTorch in this process) runs the model")
            self.worker = LeanWorker(config, chosen)
        self.worker.load_model()

    @property
    def max_model_len(self) -> int:
        return int(self.worker.max_model_len)

    @property
    def arch(self) -> ModelArch:
        arch: ModelArch = self.worker.arch
        return arch

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
