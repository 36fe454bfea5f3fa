"""LoRA adapters (PEFT's format) over the decoder's linear layers, many in one batch.

An adapter is `adapter_config.json` + `adapter_model.safetensors` (a pickle `.bin` is
refused: loading one runs code). `read_adapter` checks it against the base model (rank,
targets, shapes, finite weights) and returns its full-size A and B matrices per (layer,
module); `LoRASlots` holds up to `max_loras` adapters on this rank, each target layer's share
of them (`LoRALayer`: A and B sliced as the layer's weight is under tensor parallelism), and
the step's rows per slot (`LoRASlots.set_batch`).

A layer's output gets, for the rows of each slot, `scale * (x A^T) B^T`: one product pair per
adapter in the step, over all its rows (gathered), not one per request. A packed layer
(q/k/v, gate/up) multiplies by its shards' A matrices side by side, then each shard's B into
its columns. A row-parallel layer adds its partial delta before the all-reduce (the product
is linear in the input's shards)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

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
    """One adapter's share on this rank of one layer: the A matrices of its shards stacked
    ([sum r, in]) and each shard's B ([columns of that shard, r]) with where its output goes."""

    a: torch.Tensor
    bs: list[tuple[int, int, torch.Tensor]]  # (first column, first row of `a`, B)
    scale: float


class LoRABatch:
    """The step's rows of each adapter slot, shared by every target layer of the model (the
    model runner sets it around the forward pass; no rows: no adapter in this step).

    The rows are laid out once a step for batched products: slot s's rows go to places
    [s n, s n + its rows) of a `slots x n` grid (n: the most rows of one slot; the grid's
    other places repeat row 0 and are dropped after the products)."""

    def __init__(self, num_slots: int, kernels: Kernels | None = None) -> None:
        """`kernels`: the C kernels' `lora_apply` does the update of float32 rows (each row
        its own adapter's product); otherwise batched products over the grid."""
        self.num_slots = num_slots
        self.kernels = kernels
        self.rows: list[tuple[int, torch.Tensor]] = []
        self.per_slot = 0  # n
        self.gather = self.places = self.dest = torch.empty(0, dtype=torch.long)
        self.slot_of_row = torch.empty(0, dtype=torch.long)  # (for `kernels`) -1: none

    def set(self, rows: list[tuple[int, torch.Tensor]], num_rows: int = 0) -> None:
        self.rows = rows
        if not rows:
            return
        if self.kernels is not None:
            slot_of_row = torch.full((num_rows,), -1, dtype=torch.long)
            for slot, r in rows:
                slot_of_row[r.cpu()] = slot
            self.slot_of_row = slot_of_row
            if rows[0][1].device.type == "cpu":
                return  # (the C kernel reads only this; other layouts are the fallback's)
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


class LoRALayer:
    """Every slot's adapter weights of one linear layer on this rank, stacked: A as
    [slots, W, in] and B^T as [slots, W, out] (W = its shards x the largest rank; B scaled; a
    slot an adapter does not fill holds zeros). A step's update is two batched products
    over the rows gathered by slot (`LoRABatch`), whatever adapters its rows use."""

    def __init__(
        self,
        batch: LoRABatch,
        width: int,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.batch, self.width = batch, width
        slots = batch.num_slots
        # A as the C kernel reads it (rows of `in`: one dot product per rank), B^T as both
        # read it (a transposed view costs bmm 3x).
        self.a = torch.zeros(slots, width, in_features, dtype=dtype, device=device)
        self.b_t = torch.zeros(slots, width, out_features, dtype=dtype, device=device)

    def set_slot(self, slot: int, weights: SlotWeights | None) -> None:
        """Put an adapter's share in `slot` (None: empty it)."""
        self.a[slot].zero_()
        self.b_t[slot].zero_()
        if weights is None:
            return
        rows = weights.a.shape[0]
        if rows > self.width:
            raise LoRAError(f"an adapter share of rank {rows} over the slot's {self.width}")
        self.a[slot, :rows] = weights.a
        for col, at, b in weights.bs:
            self.b_t[slot, at : at + b.shape[1], col : col + b.shape[0]] = b.t() * weights.scale

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add each row's adapter update to `out` (in place)."""
        batch = self.batch
        kernels = batch.kernels
        if kernels is not None:  # (only a float32 model on the CPU has them)
            x = x if x.stride(1) == 1 else x.contiguous()
            if out.stride(1) == 1:
                kernels.lora_apply(x, batch.slot_of_row, self.a, self.b_t, out)
            else:  # (never so far: the layers' outputs are their own row-major tensors)
                update = torch.zeros(out.shape, dtype=out.dtype)
                kernels.lora_apply(x, batch.slot_of_row, self.a, self.b_t, update)
                out.add_(update)
            return
        grid = x.index_select(0, batch.gather).to(self.a.dtype)
        grid = grid.view(batch.num_slots, batch.per_slot, x.shape[1])
        y = torch.bmm(torch.bmm(grid, self.a.transpose(1, 2)), self.b_t).view(-1, out.shape[1])
        out.index_add_(0, batch.dest, y.index_select(0, batch.places).to(out.dtype))


def column_share(
    pieces: list[tuple[int, torch.Tensor, torch.Tensor]],
    local_sizes: list[int],
    source: list[tuple[int, int]],
    scale: float,
    dtype: torch.dtype,
) -> SlotWeights:
    """A column-parallel layer's share: `pieces` are (shard, A, B) of the shards the adapter
    targets; B keeps this rank's rows of its shard (`source`: (first row, rows) per shard),
    written at the shard's columns here."""
    a_parts, bs, first = [], [], 0
    for shard, a, b in pieces:
        start, size = source[shard]
        a_parts.append(a)
        bs.append((sum(local_sizes[:shard]), first, b.narrow(0, start, size).to(dtype)))
        first += a.shape[0]
    return SlotWeights(torch.cat(a_parts).to(dtype).contiguous(), bs, scale)


def row_share(
    a: torch.Tensor, b: torch.Tensor, start: int, local_in: int, scale: float, dtype: torch.dtype
) -> SlotWeights:
    """A row-parallel layer's share: this rank's columns of A, all of B (the partial update
    is summed by the layer's all-reduce)."""
    return SlotWeights(
        a.narrow(1, start, local_in).to(dtype).contiguous(), [(0, 0, b.to(dtype))], scale
    )
