"""`LoRAManager`: the adapters this rank has read (those the engine core keeps: at most
`--max-cpu-loras`) and the `max_loras` slots of the model's layers that hold the ones a step
uses (`model/lora.py`).

Adapters arrive by `LoRARequest` (name, id, PEFT directory): through `add` (the engine core
asks every rank once, before a request that names it runs) or, failing that, with the first
request that names it. Ids are the server's, unique per adapter."""

from __future__ import annotations

import torch

from treadle.model.llama import LlamaForCausalLM
from treadle.model.lora import Adapter, LoRAError, read_adapter
from treadle.wire.engine import LoRARequest


class LoRAManager:
    def __init__(self, model: LlamaForCausalLM, max_loras: int, max_rank: int) -> None:
        self.model = model
        self.batch = model.enable_lora(max_loras, max_rank)
        self.max_loras, self.max_rank = max_loras, max_rank
        self.adapters: dict[int, Adapter] = {}
        self.slot_of: dict[int, int] = {}  # adapter id -> slot
        self.device = next(model.parameters()).device

    def add(self, request: LoRARequest) -> int:
        """Read the adapter unless it is here; returns its bytes. Raises `LoRAError`. (Which
        adapters stay is the engine core's choice: `core/loras.py`.)"""
        adapter = self.adapters.get(request.lora_int_id)
        if adapter is not None and adapter.path == request.lora_path:
            return adapter.nbytes
        self.remove(request.lora_int_id)
        adapter = read_adapter(
            request.lora_path, self.max_rank, self.model.lora_shapes(), self.model.arch.num_layers
        )
        self.adapters[request.lora_int_id] = adapter
        return adapter.nbytes

    def remove(self, lora_id: int) -> bool:
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.model.set_lora(slot, None)
        return self.adapters.pop(lora_id, None) is not None

    def ids(self) -> list[int]:
        return list(self.adapters)

    def begin_step(self, spans: list[tuple[LoRARequest | None, int]]) -> None:
        """Put each adapter of the step in a slot (freeing slots of adapters it does not use)
        and tell the layers which rows are whose. `spans`: each request's adapter (None: the
        base model) and its rows, in the batch's order."""
        rows: dict[int, list[int]] = {}
        requests: dict[int, LoRARequest] = {}
        first = 0
        for lora, n in spans:
            if lora is not None:
                rows.setdefault(lora.lora_int_id, []).extend(range(first, first + n))
                requests[lora.lora_int_id] = lora
            first += n
        if len(rows) > self.max_loras:
            raise LoRAError(f"a step with {len(rows)} adapters, over --max-loras {self.max_loras}")
        for lora_id in rows:
            if lora_id not in self.adapters:
                self.add(requests[lora_id])
        free = [s for s in range(self.max_loras) if s not in self.slot_of.values()]
        for lora_id in rows:
            if lora_id in self.slot_of:
                continue
            if not free:  # a slot whose adapter this step does not use
                gone = next(i for i in self.slot_of if i not in rows)
                free.append(self.slot_of.pop(gone))
            slot = free.pop()
            self.model.set_lora(slot, self.adapters[lora_id])
            self.slot_of[lora_id] = slot
        self.batch.set(
            [(self.slot_of[i], torch.tensor(r, device=self.device)) for i, r in rows.items()],
            first,
        )

    def end_step(self) -> None:
        self.batch.set([])
