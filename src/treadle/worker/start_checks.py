"""The start-up checks that need no device, no weights and no torch (`check_config`), and the
sizes they reason with. The API server runs them before any process starts, and does without
torch (issue 41 item 2), so this module imports none: dtypes are known here by their names and
byte sizes (`worker.py` maps the same names to torch dtypes; a test holds the two together)."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys

from treadle import envs
from treadle.config import EngineConfig, ModelSource, model_source
from treadle.model.arch import ModelArch
from treadle.model.arch_files import read_arch
from treadle.parallel_config import pp_layer_partition

CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
"""`--dtype` names (vLLM's: `half` is float16, `float` is float32) -> bytes a value."""
DTYPE_NAMES = ("auto", *DTYPE_BYTES)

KV_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
"""`--kv-cache-dtype` names (besides `auto`: the model's dtype) -> bytes a value
(`model/attention.py`'s `_KV_STORAGE`)."""
INT8_SCALE_BYTES = 4  # an int8 row's float32 scale, after its head_dim values (attention.py)


def check_dtype_name(name: str) -> None:
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPE_NAMES)}")


def resolve_max_model_len(requested: int | None, arch: ModelArch) -> int:
    limit = arch.max_position_embeddings
    if requested is None:
        return limit
    if requested < 1 or requested > limit:
        raise ValueError(
            f"max_model_len {requested} is out of range: this model takes at most {limit} "
            f"tokens (max_position_embeddings); pass --max-model-len {limit} or less"
        )
    return requested


def kv_cache_dtype_name(name: str, model_dtype: str) -> str:
    """`--kv-cache-dtype` resolved: `auto` is the model's dtype (`attention.resolve_kv_cache_dtype`
    by names)."""
    if name == "auto":
        return model_dtype
    if name not in KV_DTYPE_BYTES:
        raise ValueError(
            f"kv cache dtype {name!r}: choose one of auto, {', '.join(KV_DTYPE_BYTES)}"
        )
    return name


def kv_row_bytes(kv_dtype: str, head_dim: int) -> int:
    """The bytes of one row of head_dim values in `kv_dtype` (int8: plus its scale)."""
    if kv_dtype == "int8":
        return head_dim + INT8_SCALE_BYTES
    return KV_DTYPE_BYTES[kv_dtype] * head_dim


def kv_bytes_per_block(arch: ModelArch, kv_dtype: str, block_size: int, tp: int = 1) -> int:
    """K and V of one block on one rank: 2 x kv heads (this rank's share) x the bytes of a row
    of head_dim values in `kv_dtype` (4, 2 or 1 byte a value, int8 plus a 4-byte scale) x
    block_size x layers."""
    kv_heads = max(1, arch.num_kv_heads // tp)
    row = kv_row_bytes(kv_dtype, arch.head_dim)
    return 2 * kv_heads * row * block_size * arch.num_layers


def size_text(n: int) -> str:
    """n bytes in GiB, MiB or KiB (two decimals), or bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} bytes"


def check_kv_budget(
    budget: int,
    per_block: int,
    block_size: int,
    max_model_len: int,
    source: str = "--kv-cache-memory",
) -> int:
    """The number of blocks `budget` bytes hold; raises `ValueError` (saying how much memory
    `max_model_len` needs and which length would fit) when one request of `max_model_len`
    tokens would not fit: it could never run, or be preempted forever."""
    num_blocks = budget // per_block
    needed_blocks = -(-max_model_len // block_size)
    if num_blocks >= needed_blocks:
        return int(num_blocks)
    fits = num_blocks * block_size
    needed_mib = -(-needed_blocks * per_block // (1 << 20))
    raise ValueError(
        f"the KV cache is too small for max_model_len {max_model_len}: one request of that "
        f"length needs {size_text(needed_blocks * per_block)} of KV cache, but {size_text(budget)} "
        f"({source}) holds {f'only {fits} tokens' if fits else f'no block of {block_size} tokens'}; "
        f"raise --kv-cache-memory to {needed_mib}MiB or more"
        + (f", or pass --max-model-len {fits} or less" if fits else "")
    )


def model_arch(source: ModelSource) -> ModelArch:
    """`read_arch`, remembered per file (and its size and mtime) for this process: reading a
    GGUF header takes seconds, and the start-up checks, the CLI and the front end all ask."""
    path = os.path.join(source.path, "config.json") if not source.is_gguf else source.path
    st = os.stat(path)
    return _model_arch(source, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _model_arch(source: ModelSource, size: int, mtime_ns: int) -> ModelArch:
    return read_arch(source)


@functools.cache
def torch_has_cuda() -> bool:
    """`torch.backends.cuda.is_built()`, read from torch's generated `version.py` while torch
    is not imported (importing it costs the API server ~200 MiB)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.backends.cuda.is_built())
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    for folder in spec.submodule_search_locations:
        try:
            with open(os.path.join(folder, "version.py")) as f:
                text = f.read()
        except OSError:
            continue
        found = re.search(r"^cuda\b[^=\n]*=\s*(.+)$", text, re.MULTILINE)
        return found is not None and found.group(1).strip() != "None"
    return False


def check_config(config: EngineConfig) -> None:
    """The start-up checks that need no device and no weights, run before any process starts:
    the thread count and kernel ISA level from the environment, the dtype name, max_model_len
    against the model's limit (config.json or GGUF header) and, when the budget is known without
    loading (an explicit --kv-cache-memory, or the CPU default), whether the KV cache holds one
    request of max_model_len. Raises `ValueError` with one line that says what to change. The
    engine checks the same again after loading (`Worker.determine_num_blocks`), where a CUDA
    budget is known."""
    scheduler = config.scheduler
    for name, value in (
        ("--block-size", config.cache.block_size),
        ("--max-num-seqs", scheduler.max_num_seqs),
        ("--max-num-batched-tokens", scheduler.max_num_batched_tokens),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, not {value}")
    config.parallel.model_threads()  # a bad TREADLE_CPU_THREADS
    if envs.cpu_kernels() and envs.cpu_isa() is not None:
        # A forced level this CPU cannot run, or a bad name (the kernels' module imports
        # torch: only when the variable is set; unset, the best level is picked).
        from treadle.model import cpu_kernels

        cpu_kernels.select_isa()
    check_dtype_name(config.model.dtype)
    arch = model_arch(model_source(config.model))
    max_model_len = resolve_max_model_len(config.model.max_model_len, arch)
    budget = config.cache.kv_cache_memory
    if budget is None:
        if torch_has_cuda():
            return  # a fraction of free device memory: known only once the model is loaded
        budget, source = CPU_DEFAULT_KV_CACHE_BYTES, "the CPU default"
    else:
        source = "--kv-cache-memory"
    name = config.model.dtype
    dtype = "float32" if name == "auto" else {"float": "float32", "half": "float16"}.get(name, name)
    if name == "auto" and torch_has_cuda():
        dtype = "bfloat16"  # the smaller one: never refuse what the device may accept
    block_size = config.cache.block_size
    kv_dtype = kv_cache_dtype_name(config.cache.kv_cache_dtype, dtype)
    parallel = config.parallel
    per_block = kv_bytes_per_block(arch, kv_dtype, block_size, parallel.tensor_parallel_size)
    if parallel.pipeline_parallel_size > 1:  # the stage with the most layers holds the most
        most = max(pp_layer_partition(arch.num_layers, parallel.pipeline_parallel_size))
        per_block = per_block * most // arch.num_layers
    check_kv_budget(budget, per_block, block_size, max_model_len, source)


def check_parallel_layout(arch: ModelArch, tp: int, pp: int = 1) -> None:
    """Reject a layout the model cannot be split into, before any process starts."""
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp}")
    pp_layer_partition(arch.num_layers, pp)  # a stage without a layer, a bad env partition
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if arch.num_heads % tp:
        divisors = [n for n in range(1, arch.num_heads + 1) if arch.num_heads % n == 0]
        raise ValueError(
            f"the model has {arch.num_heads} attention heads, not divisible by "
            f"tensor_parallel_size {tp} (the sizes that divide them: {_listed(divisors)}; "
            f"that this model splits at: {_listed(tp_sizes(arch))})"
        )
    kv = arch.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(
            f"the model has {kv} KV heads: tensor_parallel_size {tp} must divide them or be a "
            f"multiple of them (this model splits at: {_listed(tp_sizes(arch))})"
        )
    if arch.intermediate_size % tp:
        raise ValueError(
            f"the MLP width {arch.intermediate_size} is not divisible by tensor_parallel_size "
            f"{tp} (this model splits at: {_listed(tp_sizes(arch))})"
        )


def tp_sizes(arch: ModelArch) -> list[int]:
    """The tensor-parallel sizes `check_parallel_layout` accepts for `arch`."""
    kv, width = arch.num_kv_heads, arch.intermediate_size
    return [
        tp
        for tp in range(1, arch.num_heads + 1)
        if arch.num_heads % tp == 0 and not (kv % tp and tp % kv) and width % tp == 0
    ]


def _listed(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes))
