"""LoRA adapters (PEFT's format) over the decoder's linear layers, many in one batch.

An adapter is `adapter_config.json` + `adapter_model.safetensors` (a pickle `.bin` is
refused: loading one runs code). `read_adapter` checks it against the base model (rank,
targets, shapes, finite weights) and returns its full-size A and B matrices per (layer,
module); each target layer's `LoRALayer` holds up to `max_loras` adapters' shares on this
rank (A and B sliced as the layer's weight is under tensor parallelism), and `LoRABatch` the
step's rows per slot, which every layer reads.

A layer's output gets, for the rows of each slot, `scale * (x A^T) B^T`: one pass over each
adapter's weights in the step, for all its rows, not one per request (the C kernel
`lora_apply_sharded`, or two batched products). A packed layer (q/k/v, gate/up) multiplies by
its shards' A matrices side by side, then each shard's B into its own columns only. A
row-parallel layer adds its partial delta before the all-reduce (the product is linear in the
input's shards)."""

from __future__ import annotations

import ctypes
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from treadle.model.arch import ModelArch
from treadle.model.cpu_kernels import Kernels

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The modules an adapter may target (PEFT's names); embeddings and the LM head are refused."""


def lora_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """Each module an adapter may target: its full (out, in) in the base checkpoint."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return {
        "q_proj": (q, arch.hidden_size),
        "k_proj": (kv, arch.hidden_size),
        "v_proj": (kv, arch.hidden_size),
        "o_proj": (arch.hidden_size, q),
        "gate_proj": (arch.intermediate_size, arch.hidden_size),
        "up_proj": (arch.intermediate_size, arch.hidden_size),
        "down_proj": (arch.hidden_size, arch.intermediate_size),
    }


class LoRAError(ValueError):
    """The adapter cannot be served; the message says why (a 400, or a start-up error)."""


@dataclass
class Adapter:
    """One adapter's weights as PEFT saved them (float32, full size), by (layer, module)."""

    path: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (A [r, in], B [out, r])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter(
    path: str,
    max_rank: int,
    shapes: dict[str, tuple[int, int]],
    num_layers: int,
) -> Adapter:
    """Read and check the adapter at `path`: `shapes` gives each target module's (out, in)
    in the base model. Raises `LoRAError` for anything that cannot be served."""
    if not os.path.isdir(path):
        raise LoRAError(f"{path!r} is not a directory (an adapter is a PEFT directory)")
    config_file = os.path.join(path, "adapter_config.json")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAError(f"cannot read {config_file}: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{config_file} is not a JSON object")
    tensors_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(tensors_file):
        pickled = os.path.isfile(os.path.join(path, "adapter_model.bin"))
        raise LoRAError(
            f"{path} has no adapter_model.safetensors"
            + (" (adapter_model.bin is a pickle, which treadle never loads)" if pickled else "")
        )
    rank = config.get("r")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"{config_file}: r must be a positive integer, not {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"rank {rank} is over --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoRAError(f"{config_file}: lora_alpha must be a number, not {alpha!r}")
    for key, allowed in (("bias", ("none", None)), ("fan_in_fan_out", (False, None))):
        if config.get(key) not in allowed:
            raise LoRAError(f"{config_file}: {key}={config.get(key)!r} is not supported")
    if config.get("modules_to_save"):
        raise LoRAError(f"{config_file}: modules_to_save is not supported (whole modules)")
    if config.get("use_dora"):
        raise LoRAError(f"{config_file}: DoRA is not supported")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _read_weights(tensors_file, rank, shapes, num_layers)
    if not weights:
        raise LoRAError(f"{tensors_file} holds no LoRA weights of {', '.join(TARGETS)}")
    return Adapter(path, rank, float(scale), weights)


def _read_weights(
    file: str, rank: int, shapes: dict[str, tuple[int, int]], num_layers: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(file, framework="pt") as f:
            names = list(f.keys())  # noqa: SIM118 (not a dict)
            for name in names:
                key, which = _parse_name(name, num_layers)
                pairs.setdefault(key, {})[which] = f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise LoRAError(f"cannot read {file}: {e}") from None
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{file}: layer {layer} {module} lacks its lora_A or lora_B")
        a, b = ab["A"].float(), ab["B"].float()
        out_features, in_features = shapes[module]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoRAError(
                f"{file}: layer {layer} {module} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}, but the base model takes A ({rank}, {in_features}) and "
                f"B ({out_features}, {rank})"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"{file}: layer {layer} {module} has weights that are not finite")
        out[(layer, module)] = (a.contiguous(), b.contiguous())
    return out


def _parse_name(name: str, num_layers: int) -> tuple[tuple[int, str], str]:
    """`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` -> ((3, "q_proj"),
    "A"); anything else is refused."""
    parts = name.split(".")
    try:
        at = parts.index("layers")
        layer = int(parts[at + 1])
        module = parts[at + 3]
        which = parts[at + 4]
    except (ValueError, IndexError):
        raise LoRAError(
            f"tensor {name!r}: treadle takes LoRA weights of {', '.join(TARGETS)}"
        ) from None
    if module not in TARGETS or which not in ("lora_A", "lora_B") or parts[-1] != "weight":
        raise LoRAError(f"tensor {name!r}: treadle takes LoRA weights of {', '.join(TARGETS)}")
    if not 0 <= layer < num_layers:
        raise LoRAError(f"tensor {name!r}: the base model has {num_layers} layers")
    return (layer, module), which[-1]


@dataclass
class SlotWeights:
    """One adapter's share on this rank of one layer: per shard it targets, (shard, A [r, in],
    B [this rank's rows of the shard's outputs, r]); `ends`: where each shard's outputs end
    in the layer's (a row-parallel layer is one shard)."""

    pieces: list[tuple[int, torch.Tensor, torch.Tensor]]
    ends: list[int]
    scale: float


COLUMNS = 64
"""The columns of B^T in one tile of the C kernel's layout (`lora_apply_sharded`)."""
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
"""The slots' dtypes the C kernel reads (its LORA_F32, LORA_BF16, LORA_I8)."""


class LoRABatch:
    """The step's rows of each adapter slot, shared by every target layer of the model (the
    model runner sets it around the forward pass; no rows: no adapter in this step).

    On the C kernels (`kernels`) the step is each row's slot (`slot_of_row`, -1: the base
    model). Otherwise its rows are laid out for batched products: slot s's rows go to places
    [s n, s n + its rows) of a `slots x n` grid (n: the most rows of one slot; the grid's
    other places repeat row 0 and are dropped after the products)."""

    def __init__(self, num_slots: int, kernels: Kernels | None = None) -> None:
        self.num_slots = num_slots
        self.kernels = kernels
        self.apply = None if kernels is None else _bind_apply(kernels)
        self.weight_dtype: torch.dtype | None = None  # the slots' (None: the model's)
        self.rows: list[tuple[int, torch.Tensor]] = []
        self.per_slot = 0  # n
        self.gather = self.places = self.dest = torch.empty(0, dtype=torch.long)
        self.slot_of_row = torch.empty(0, dtype=torch.long)  # (for `kernels`) -1: none

    def set_rows(self, slot_of_row: torch.Tensor) -> None:
        """The step's rows for the C kernels: each row's slot (int64, -1: none), on the CPU."""
        self.slot_of_row = slot_of_row
        self.rows = [(-1, slot_of_row)]  # (not empty: the layers add their updates)

    def set(self, rows: list[tuple[int, torch.Tensor]], num_rows: int = 0) -> None:
        self.rows = rows
        if not rows:
            return
        if self.apply is not None and rows[0][1].device.type == "cpu":
            slot_of_row = torch.full((num_rows,), -1, dtype=torch.long)
            for slot, r in rows:
                slot_of_row[r] = slot
            self.slot_of_row = slot_of_row
            return
        n = max(r.shape[0] for _, r in rows)
        device = rows[0][1].device
        gather = torch.zeros(self.num_slots * n, dtype=torch.long, device=device)
        places, dest = [], []
        for slot, r in rows:
            gather[slot * n : slot * n + r.shape[0]] = r
            places.append(torch.arange(slot * n, slot * n + r.shape[0], device=device))
            dest.append(r)
        self.per_slot, self.gather = n, gather
        self.places, self.dest = torch.cat(places), torch.cat(dest)


def _bind_apply(kernels: Kernels) -> Any:
    """The C kernel `lora_apply_sharded` of `kernels`' library (the same library, loaded
    once: ctypes hands back its handle)."""
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn = ctypes.CDLL(str(kernels.path)).lora_apply_sharded
    fn.argtypes = [p, i64, i64, p, p, p, c_int, c_int, p, p, i64, i64, i64, p, i64, p, i64, c_int]
    fn.restype = None
    return fn


class LoRALayer:
    """Every slot's adapter weights of one linear layer on this rank, for `shards` packed
    shards of rank up to R each: A as [slots, shards R, in] (shard k's rows from k R) and B^T
    as [slots, R, out], each output column holding only its own shard's rows (B of a packed
    layer is block-diagonal: its zero blocks are not kept); B scaled, a slot an adapter does
    not fill holds zeros. On the C kernels B^T is kept in tiles of `COLUMNS` columns, each
    [R, COLUMNS] in one piece (`b`: [slots, tiles, R, COLUMNS]), so that the kernel reads
    every weight once a step in long runs; elsewhere as [slots, R, out] for batched products.

    The tensors are made by `allocate` (the manager, once the layer's shards and the slots'
    dtype are known); the layer's update then runs whatever adapters the step's rows use."""

    def __init__(
        self,
        batch: LoRABatch,
        width: int,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.batch, self.width = batch, width  # width: shards x R
        self.in_features, self.out_features = in_features, out_features
        self.dtype, self.device = dtype, device
        self.rank, self.ends = width, torch.tensor([out_features], dtype=torch.long)
        self.a = self.b = torch.empty(0, dtype=dtype)
        self.a_scale = self.b_scale = torch.empty(0)  # int8 slots: each row's scale

    @property
    def shards(self) -> int:
        return self.ends.shape[0]

    @property
    def wtype(self) -> int:
        return WEIGHT_TYPES[self.dtype]

    @property
    def tiled(self) -> bool:
        return self.batch.apply is not None and self.device.type == "cpu"

    def allocate(self, ends: list[int], dtype: torch.dtype | None = None) -> None:
        """Make the slots: `ends`, where each packed shard's outputs end on this rank; int8
        slots (the C kernels only) keep a float32 scale per row of A and per row of each
        tile of B^T."""
        if ends[-1] != self.out_features or self.width % len(ends):
            raise ValueError(f"shards ending at {ends} for {self.out_features} outputs")
        self.dtype = dtype or self.dtype
        self.ends = torch.tensor(ends, dtype=torch.long)
        self.rank = self.width // len(ends)
        slots, dtype, device = self.batch.num_slots, self.dtype, self.device
        self.a = torch.zeros(slots, self.width, self.in_features, dtype=dtype, device=device)
        if self.dtype == torch.int8 and not self.tiled:
            raise ValueError("int8 LoRA slots are for the C kernels")
        if self.tiled:
            tiles = -(-self.out_features // COLUMNS)
            self.b = torch.zeros(slots, tiles, self.rank, COLUMNS, dtype=dtype, device=device)
            self.a_scale = torch.zeros(slots, self.width)
            self.b_scale = torch.zeros(slots, tiles, self.rank)
        else:
            self.b = torch.zeros(slots, self.rank, self.out_features, dtype=dtype, device=device)

    def set_slot(self, slot: int, weights: SlotWeights | None) -> None:
        """Put an adapter's share in `slot` (None: empty it)."""
        if self.a.numel() == 0:
            self.allocate(weights.ends if weights is not None else [self.out_features])
        self.a[slot].zero_()
        self.b[slot].zero_()
        if weights is None:
            return
        a_full = torch.zeros(self.width, self.in_features)
        if torch.tensor(weights.ends).tolist() != self.ends.tolist():
            raise LoRAError(f"an adapter share for shards ending at {weights.ends}")
        b_t = torch.zeros(self.rank, self.out_features, dtype=torch.float32)
        for shard, a, b in weights.pieces:
            r = a.shape[0]
            if r > self.rank:
                raise LoRAError(f"an adapter share of rank {r} over the slot's {self.rank}")
            a_full[shard * self.rank : shard * self.rank + r] = a
            col = weights.ends[shard - 1] if shard else 0
            b_t[:r, col : col + b.shape[0]] = b.float().t() * weights.scale
        if self.tiled:
            tiles = self.b.shape[1]
            padded = torch.zeros(self.rank, tiles * COLUMNS)
            padded[:, : self.out_features] = b_t
            b_tiles = padded.view(self.rank, tiles, COLUMNS).transpose(0, 1)
            if self.dtype == torch.int8:
                a_full, self.a_scale[slot] = _int8_rows(a_full)
                b_tiles, self.b_scale[slot] = _int8_rows(b_tiles)
            self.a[slot] = a_full
            self.b[slot] = b_tiles
        else:
            self.a[slot] = a_full
            self.b[slot] = b_t

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add each row's adapter update to `out` (in place)."""
        batch = self.batch
        if self.tiled and batch.apply is not None:  # (a float32 model on the CPU)
            x = x if x.stride(1) == 1 else x.contiguous()
            target = out if out.stride(1) == 1 else torch.zeros(out.shape, dtype=out.dtype)
            batch.apply(
                x.data_ptr(), x.stride(0), x.shape[0], batch.slot_of_row.data_ptr(),
                self.a.data_ptr(), self.b.data_ptr(), self.wtype, 1, self.a_scale.data_ptr(),
                self.b_scale.data_ptr(), self.in_features, self.rank, self.shards, self.ends.data_ptr(),
                self.out_features, target.data_ptr(), target.stride(0), torch.get_num_threads(),
            )  # fmt: skip
            if target is not out:  # (never so far: the layers' outputs are their own tensors)
                out.add_(target)
            return
        grid = x.index_select(0, batch.gather).to(self.a.dtype)
        grid = grid.view(batch.num_slots, batch.per_slot, x.shape[1])
        h = torch.bmm(grid, self.a.transpose(1, 2))  # [slots, n, shards R]
        y = torch.empty(batch.num_slots, batch.per_slot, self.out_features, dtype=h.dtype)
        first, rank = 0, self.rank
        for k, end in enumerate(self.ends.tolist()):
            y[:, :, first:end] = torch.bmm(
                h[:, :, k * rank : (k + 1) * rank], self.b[:, :, first:end]
            )
            first = end
        y = y.view(-1, self.out_features)
        out.index_add_(0, batch.dest, y.index_select(0, batch.places).to(out.dtype))


def _int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `x` (its last dimension) as int8 with its scale (max |x| / 127)."""
    scale = x.abs().amax(dim=-1) / 127.0
    q = torch.round(x / torch.where(scale > 0, scale, 1.0).unsqueeze(-1))
    return q.clamp(-127, 127).to(torch.int8), scale


def column_share(
    pieces: list[tuple[int, torch.Tensor, torch.Tensor]],
    local_sizes: list[int],
    source: list[tuple[int, int]],
    scale: float,
    dtype: torch.dtype,
) -> SlotWeights:
    """A column-parallel layer's share: `pieces` are (shard, A, B) of the shards the adapter
    targets; B keeps this rank's rows of its shard (`source`: (first row, rows) per shard)."""
    ends = [sum(local_sizes[: k + 1]) for k in range(len(local_sizes))]
    kept = [(shard, a, b.narrow(0, *source[shard])) for shard, a, b in pieces]
    return SlotWeights(kept, ends, scale)


def row_share(
    a: torch.Tensor, b: torch.Tensor, start: int, local_in: int, scale: float, dtype: torch.dtype
) -> SlotWeights:
    """A row-parallel layer's share: this rank's columns of A, all of B (the partial update
    is summed by the layer's all-reduce)."""
    return SlotWeights([(0, a.narrow(1, start, local_in), b)], [b.shape[0]], scale)
