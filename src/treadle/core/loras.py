"""`EngineLoRAs`: the LoRA adapters the engine core's workers hold (`worker/lora_manager.py`),
as the engine core knows them, and so decides for them: an adapter is read by every rank once,
before the first request that names it runs; past `--max-cpu-loras` the least recently used
one that no request here uses is dropped first (none such: the new request is refused); an
adapter asked to go while requests use it goes once they have finished."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Protocol

from treadle.config import LoRAConfig
from treadle.logger import init_logger
from treadle.validation import InvalidRequest
from treadle.wire.engine import LoRARequest

logger = init_logger(__name__)


class _Executor(Protocol):
    def collective_rpc(self, method: str, args: tuple[Any, ...] = ...) -> list[Any]: ...


def as_lora_request(value: object) -> LoRARequest:
    """A utility call's argument (plain data off the wire) as a `LoRARequest`."""
    if isinstance(value, LoRARequest):
        return value
    if isinstance(value, list | tuple) and 2 <= len(value) <= 3:
        name, lora_id, *path = value
        if (
            isinstance(name, str)
            and isinstance(lora_id, int)
            and all(isinstance(p, str) for p in path)
        ):
            return LoRARequest(name, lora_id, *path)
    raise InvalidRequest("lora_request", "must be [name, id, path]")


class EngineLoRAs:
    def __init__(self, config: LoRAConfig | None, executor: _Executor) -> None:
        self.config = config
        self.executor = executor
        self.loaded: OrderedDict[int, LoRARequest] = OrderedDict()  # least recently used first
        self.leaving: set[int] = set()  # asked to go while requests use them

    def ensure(self, request: LoRARequest, in_use: Iterable[int] = ()) -> None:
        """Every rank holds the adapter (read now if not; `in_use`: the adapters of the
        requests here, which are never dropped for it). Raises `InvalidRequest` with the
        reason it cannot be served."""
        if self.config is None:
            raise InvalidRequest("model", "LoRA adapters are not enabled: start with --enable-lora")
        known = self.loaded.get(request.lora_int_id)
        if known is not None and known.lora_path == request.lora_path:
            self.leaving.discard(request.lora_int_id)
            self.loaded.move_to_end(request.lora_int_id)
            return
        if known is not None:  # the same id for another directory: read it again
            self._drop(request.lora_int_id)
        if len(self.loaded) >= self.config.loaded:
            busy = set(in_use)
            idle = next((i for i in self.loaded if i not in busy), None)
            if idle is None:
                raise InvalidRequest(
                    "model",
                    f"adapter {request.lora_name!r} cannot be loaded: {len(self.loaded)} adapters "
                    f"are loaded and all in use (--max-cpu-loras {self.config.loaded})",
                )
            self._drop(idle)
        try:
            self.executor.collective_rpc("add_lora", (request,))
        except Exception as e:  # a worker's LoRAError arrives as its failure reply
            reason = str(e)
            marker = "LoRAError: "
            if marker in reason:
                reason = reason.split(marker, 1)[1].split("' (at ")[0]
            raise InvalidRequest("lora", f"adapter {request.lora_name!r}: {reason}") from None
        self.loaded[request.lora_int_id] = request
        logger.info("Loaded LoRA adapter %r (id %d)", request.lora_name, request.lora_int_id)

    def remove(self, lora_id: int, in_use: Iterable[int]) -> bool:
        """Drop an adapter now, or once the requests that use it have finished."""
        if lora_id not in self.loaded:
            return False
        if lora_id in set(in_use):
            self.leaving.add(lora_id)
        else:
            self._drop(lora_id)
        return True

    def sweep(self, in_use: Iterable[int]) -> None:
        """Drop the leaving adapters no request uses any more."""
        busy = set(in_use)
        for lora_id in [i for i in self.leaving if i not in busy]:
            self._drop(lora_id)

    def _drop(self, lora_id: int) -> None:
        self.leaving.discard(lora_id)
        request = self.loaded.pop(lora_id)
        self.executor.collective_rpc("remove_lora", (lora_id,))
        logger.info("Unloaded LoRA adapter %r (id %d)", request.lora_name, lora_id)

    def listed(self) -> list[list[Any]]:
        return [[r.lora_name, r.lora_int_id, r.lora_path] for r in self.loaded.values()]
