"""`LoRAManager`: the adapters this rank has read (those the engine core keeps: at most
`--max-cpu-loras`) and the `max_loras` slots of the model's layers that hold the ones a step
uses (`model/lora.py`).

Adapters arrive by `LoRARequest` (name, id, PEFT directory): through `add` (the engine core
asks every rank once, before a request that names it runs) or, failing that, with the first
request that names it. Ids are the server's, unique per adapter.

The slots hold float32 weights, or int8 ones (a scale per row) where every linear layer runs
on GGUF blocks (a quantized model on the C kernels): there a step's update is bound by
reading the slots' weights, and int8 quarters them at a rounding (1/254 of a row's largest
weight) far below the blocks' own; each adapter read is then kept in bfloat16 (half the
memory of float32) to fill the slots from."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from treadle.model.linear_method import GGUFLinear
from treadle.model.llama import LlamaForCausalLM
from treadle.model.lora import Adapter, LoRAError, LoRALayer, read_adapter
from treadle.wire.engine import LoRARequest


def slot_layers(model: LlamaForCausalLM) -> list[tuple[LoRALayer, list[int], bool]]:
    """Each target layer's slots, where its shards end, and whether it runs on GGUF blocks."""
    out = []
    for layer in model.decoder_layers():
        attn, mlp = layer.self_attn, layer.mlp
        for linear, ends in (
            (attn.qkv_proj, [sum(attn.qkv_proj.local_sizes[: k + 1]) for k in range(3)]),
            (attn.o_proj, [attn.o_proj.out_features]),
            (mlp.gate_up_proj, [sum(mlp.gate_up_proj.local_sizes[: k + 1]) for k in range(2)]),
            (mlp.down_proj, [mlp.down_proj.out_features]),
        ):
            assert linear.lora is not None, "enable_lora first"
            out.append((linear.lora, ends, isinstance(linear.method, GGUFLinear)))
    return out


def give_back_freed_memory() -> None:
    """Hand the memory freed back to the system (glibc's `malloc_trim`; elsewhere nothing):
    an adapter's tensors come and go in pieces that glibc's arenas otherwise keep."""
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(None).malloc_trim
            _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):
            _trim = False
    if _trim:
        _trim(0)


_trim: Any = None


class LoRAManager:
    def __init__(self, model: LlamaForCausalLM, max_loras: int, max_rank: int) -> None:
        self.model = model
        self.batch = model.enable_lora(max_loras, max_rank)
        layers = slot_layers(model)
        on_blocks = self.batch.kernels is not None and all(gguf for _, _, gguf in layers)
        self.weight_dtype = torch.int8 if on_blocks else None
        for lora, ends, _ in layers:
            lora.allocate(ends, self.weight_dtype)
        self.max_loras, self.max_rank = max_loras, max_rank
        self.adapters: dict[int, Adapter] = {}
        self.slot_of: dict[int, int] = {}  # adapter id -> slot
        self.device = next(model.parameters()).device
        self._step: tuple[tuple[int, int], ...] = ()  # the last step's (slot, rows) runs
        self._slot_of_row = torch.empty(0, dtype=torch.long)

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
        if self.weight_dtype is not None:  # (int8 slots: a bfloat16 copy is plenty to fill them)
            adapter.weights = {
                key: (a.bfloat16(), b.bfloat16()) for key, (a, b) in adapter.weights.items()
            }
        self.adapters[request.lora_int_id] = adapter
        return adapter.nbytes

    def remove(self, lora_id: int) -> bool:
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.model.set_lora(slot, None)
            self._step = ()
        removed = self.adapters.pop(lora_id, None) is not None
        if removed:
            give_back_freed_memory()
        return removed

    def ids(self) -> list[int]:
        return list(self.adapters)

    def begin_step(self, spans: list[tuple[LoRARequest | None, int]]) -> None:
        """Put each adapter of the step in a slot (freeing slots of adapters it does not use)
        and tell the layers which rows are whose. `spans`: each request's adapter (None: the
        base model) and its rows, in the batch's order."""
        requests = {lora.lora_int_id: lora for lora, _ in spans if lora is not None}
        if not requests:
            return
        if len(requests) > self.max_loras:
            raise LoRAError(
                f"a step with {len(requests)} adapters, over --max-loras {self.max_loras}"
            )
        for lora_id, request in requests.items():
            if lora_id not in self.adapters:
                self.add(request)
        for lora_id in requests:
            if lora_id not in self.slot_of:
                self._fill_slot(lora_id, requests)
        runs = tuple(
            (-1 if lora is None else self.slot_of[lora.lora_int_id], n) for lora, n in spans
        )
        if runs != self._step:  # (a decode step's rows are often the last step's)
            self._step = runs
            slots = [slot for slot, n in runs for _ in range(n)]
            self._slot_of_row = torch.tensor(slots, dtype=torch.long)
        if self.batch.apply is not None and self.device.type == "cpu":
            self.batch.set_rows(self._slot_of_row)
            return
        slot_of_row = self._slot_of_row.to(self.device)
        used = sorted({slot for slot, _ in runs if slot >= 0})
        self.batch.set(
            [(s, (slot_of_row == s).nonzero().flatten()) for s in used], slot_of_row.shape[0]
        )

    def _fill_slot(self, lora_id: int, step: dict[int, LoRARequest]) -> None:
        taken = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if not free:  # a slot whose adapter this step does not use
            gone = next(i for i in self.slot_of if i not in step)
            free.append(self.slot_of.pop(gone))
        slot = free.pop()
        self.model.set_lora(slot, self.adapters[lora_id])
        self.slot_of[lora_id] = slot
        self._step = ()

    def end_step(self) -> None:
        self.batch.set([])
