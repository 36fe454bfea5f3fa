"""`Worker`: one device's share of the engine: picks the device, loads the model, sizes and
holds the KV cache, and runs steps. The executor calls its methods by name."""

from __future__ import annotations

import functools
import os
from typing import Any

import psutil
import torch

from treadle import envs
from treadle.config import (
    EngineConfig,
    ModelSource,
    model_source,
    pp_layer_partition,
    pp_layer_range,
)
from treadle.logger import init_logger
from treadle.model import cpu_kernels
from treadle.model.arch import ModelArch
from treadle.model.attention import kv_row_bytes, resolve_kv_cache_dtype
from treadle.model.llama import LlamaForCausalLM, Stage
from treadle.model.loader import load_model, read_arch
from treadle.model.lora import LoRAError
from treadle.model.parallel import pp_rank, pp_size, tp_rank
from treadle.wire.engine import LoRARequest
from treadle.wire.worker import ModelRunnerOutput, SchedulerOutput
from treadle.worker import kv_file
from treadle.worker.cpu_share import ThreadGovernor
from treadle.worker.model_runner import ModelRunner
from treadle.worker.pp_transfer import StageLink, StageLinkError
from treadle.worker.sampler import TokenPieces

logger = init_logger(__name__)

CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30
GPU_KV_CACHE_FRACTION = 0.9

# vLLM's names: `half` is float16, `float` is float32.
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
DTYPE_NAMES = ("auto", *_DTYPES)


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: float32 on CPU (on this class of CPU, 2-core AVX-512, bfloat16 matmuls at these
    sizes were measured slower than float32; see README), bfloat16 on CUDA."""
    check_dtype_name(name)
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


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


def kv_bytes_per_block(arch: ModelArch, kv_dtype: str, block_size: int, tp: int = 1) -> int:
    """K and V of one block on one rank: 2 x kv heads (this rank's share) x the bytes of a row
    of head_dim values in `kv_dtype` (`attention.kv_row_bytes`: 4, 2 or 1 byte a value, int8
    plus a 4-byte scale) x block_size x layers."""
    kv_heads = max(1, arch.num_kv_heads // tp)
    row = kv_row_bytes(kv_dtype, arch.head_dim)
    return 2 * kv_heads * row * block_size * arch.num_layers


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
        f"length needs {_size(needed_blocks * per_block)} of KV cache, but {_size(budget)} "
        f"({source}) holds {f'only {fits} tokens' if fits else f'no block of {block_size} tokens'}; "
        f"raise --kv-cache-memory to {needed_mib}MiB or more"
        + (f", or pass --max-model-len {fits} or less" if fits else "")
    )


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} bytes"


def model_arch(source: ModelSource) -> ModelArch:
    """`read_arch`, remembered per file (and its size and mtime) for this process: reading a
    GGUF header takes seconds, and the start-up checks, the CLI and the front end all ask."""
    path = os.path.join(source.path, "config.json") if not source.is_gguf else source.path
    st = os.stat(path)
    return _model_arch(source, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _model_arch(source: ModelSource, size: int, mtime_ns: int) -> ModelArch:
    return read_arch(source)


def check_config(config: EngineConfig) -> None:
    """The start-up checks that need no device and no weights, run before any process starts:
    the thread count and kernel ISA level from the environment, the dtype name, max_model_len against the model's limit (config.json or GGUF header) and,
    when the budget is known without loading (an explicit --kv-cache-memory, or the CPU
    default), whether the KV cache holds one request of max_model_len. Raises `ValueError`
    with one line that says what to change. The engine checks the same again after loading
    (`Worker.determine_num_blocks`), where a CUDA budget is known."""
    scheduler = config.scheduler
    for name, value in (
        ("--block-size", config.cache.block_size),
        ("--max-num-seqs", scheduler.max_num_seqs),
        ("--max-num-batched-tokens", scheduler.max_num_batched_tokens),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, not {value}")
    config.parallel.model_threads()  # a bad TREADLE_CPU_THREADS
    if envs.cpu_kernels():
        cpu_kernels.select_isa()  # a bad TREADLE_CPU_ISA, or a level this CPU cannot run
    check_dtype_name(config.model.dtype)
    arch = model_arch(model_source(config.model))
    max_model_len = resolve_max_model_len(config.model.max_model_len, arch)
    budget = config.cache.kv_cache_memory
    if budget is None:
        if torch.backends.cuda.is_built():
            return  # a fraction of free device memory: known only once the model is loaded
        budget, source = CPU_DEFAULT_KV_CACHE_BYTES, "the CPU default"
    else:
        source = "--kv-cache-memory"
    name = config.model.dtype
    dtype = torch.float32 if name == "auto" else _DTYPES[name]  # auto is float32 on CPU
    if name == "auto" and torch.backends.cuda.is_built():
        dtype = torch.bfloat16  # the smaller one: never refuse what the device may accept
    block_size = config.cache.block_size
    kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype)
    parallel = config.parallel
    per_block = kv_bytes_per_block(arch, kv_dtype, block_size, parallel.tensor_parallel_size)
    if parallel.pipeline_parallel_size > 1:  # the stage with the most layers holds the most
        most = max(pp_layer_partition(arch.num_layers, parallel.pipeline_parallel_size))
        per_block = per_block * most // arch.num_layers
    check_kv_budget(budget, per_block, block_size, max_model_len, source)


def weight_bytes(model: LlamaForCausalLM) -> int:
    """The bytes of the weights this process holds: parameters and GGUF blocks (each storage
    once, a tied table too)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for module in model.modules():
        quant = getattr(getattr(module, "method", None), "quant", None)
        tiles = getattr(quant, "tiles", None)
        if isinstance(tiles, torch.Tensor):
            seen[tiles.untyped_storage().data_ptr()] = tiles.untyped_storage().nbytes()
    return sum(seen.values())


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = pick_device()
        self.source = model_source(config.model)
        self.arch = read_arch(self.source)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.max_model_len = resolve_max_model_len(config.model.max_model_len, self.arch)
        self.runner: ModelRunner | None = None
        # Pipeline parallelism: this rank's stage and its link to the neighbours (the worker
        # process makes the link before loading).
        start, end = pp_layer_range(self.arch.num_layers, pp_rank(), pp_size())
        self.stage = Stage(self.arch.num_layers, start, end)
        self.link: StageLink | None = None
        self._rss_before_load = self._weights_bytes = 0  # for the memory line
        self._fingerprint: str | None = None  # of the weights, for prompt-cache files
        parallel = config.parallel
        self.threads = ThreadGovernor(
            parallel.model_threads(),
            pinned=self.device.type != "cpu" or parallel.threads_pinned(),
        )

    def load_model(self) -> None:
        logger.info("Loading %s (%s, %s)", self.source.path, self.dtype, self.device)
        self._rss_before_load = _rss()
        model = load_model(
            self.source,
            self.arch,
            self.dtype,
            self.device,
            self.max_model_len,
            self.config.model.cpu_activation_dtype,
            self.stage,
        )
        self._weights_bytes = _rss() - self._rss_before_load
        source = self.source
        self.runner = ModelRunner(
            model,
            self.device,
            self.dtype,
            self.config.cache.block_size,
            self.config.model.seed,
            TokenPieces(functools.partial(_load_tokenizer, source)),
            kv_dtype=self.kv_dtype,
            lora=self.config.lora,
        )
        self.runner.link = self.link

    def determine_num_blocks(self) -> int:
        assert self.runner is not None
        per_block = self.runner.kv_bytes_per_block()
        budget = self.config.cache.kv_cache_memory
        source = "--kv-cache-memory"
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * GPU_KV_CACHE_FRACTION)
                source = f"{GPU_KV_CACHE_FRACTION:.0%} of the free device memory"
            else:
                budget = CPU_DEFAULT_KV_CACHE_BYTES
                source = "the CPU default"
        block_size = self.config.cache.block_size
        return check_kv_budget(budget, per_block, block_size, self.max_model_len, source)

    def initialize_cache(self, num_blocks: int) -> None:
        assert self.runner is not None
        self.runner.initialize_cache(num_blocks)
        kv = num_blocks * self.runner.kv_bytes_per_block()
        if pp_size() > 1:
            stage = self.stage
            logger.info(
                "Pipeline stage %d/%d, TP rank %d: layers %d-%d%s%s, weights %.1f MiB, "
                "KV cache %.1f MiB",
                pp_rank(),
                pp_size(),
                tp_rank(),
                stage.start,
                stage.end - 1,
                " + embedding" if stage.first else "",
                " + final norm, LM head, sampling" if stage.last else "",
                self.weight_bytes() / (1 << 20),
                kv / (1 << 20),
            )
        per_token = self.runner.kv_bytes_per_block() // self.config.cache.block_size
        logger.info(
            "KV cache: %s, %s tokens of %s each (%.2fx the tokens of float32 in the same memory)",
            self.kv_dtype,
            f"{num_blocks * self.config.cache.block_size:,}",
            _size(per_token),
            kv_row_bytes("float32", self.arch.head_dim)
            / kv_row_bytes(self.kv_dtype, self.arch.head_dim),
        )
        if self.device.type == "cpu":
            logger.info(
                "Memory of this process: %s runtime, %s weights (resident), KV cache %s "
                "reserved, resident as it fills",
                _size(self._rss_before_load),
                _size(max(0, self._weights_bytes)),
                _size(kv),
            )

    def weight_bytes(self) -> int:
        """The bytes of this rank's weights (`weight_bytes`), e.g. a pipeline stage's share."""
        assert self.runner is not None
        return weight_bytes(self.runner.model)

    def stage_info(self) -> dict[str, int]:
        """This rank's place: pipeline stage, TP rank, its layers [start, end)."""
        return {
            "pp_rank": pp_rank(),
            "tp_rank": tp_rank(),
            "layer_start": self.stage.start,
            "layer_end": self.stage.end,
        }

    def kv_bytes_per_block(self) -> int:
        """This rank's bytes of one KV block (for the engine core's start-up log)."""
        assert self.runner is not None
        return self.runner.kv_bytes_per_block()

    def save_kv_blocks(self, path: str, block_ids: list[int], header: dict[str, Any]) -> int:
        """Write these blocks' KV to this rank's file of `path` (`kv_file.py`); its bytes."""
        assert self.runner is not None
        header = {**header, **self._kv_identity()}
        return kv_file.save_blocks(
            kv_file.rank_path(path, self.rank), self.runner.kv_caches, block_ids, header
        )

    def load_kv_blocks(self, path: str, targets: dict[int, int]) -> int:
        """Copy blocks of this rank's file of `path` into the cache (`targets`: index in the
        file -> block id), after checking the file fits this model and cache; its bytes."""
        assert self.runner is not None
        return kv_file.load_blocks(
            kv_file.rank_path(path, self.rank), self.runner.kv_caches, targets, self._kv_identity()
        )

    def kv_identity(self) -> dict[str, Any]:
        """What a prompt-cache file must say to fit this rank (`kv_file.py`)."""
        assert self.runner is not None
        return {**kv_file.layout(self.runner.kv_caches), **self._kv_identity()}

    def _kv_identity(self) -> dict[str, Any]:
        assert self.runner is not None
        if self._fingerprint is None:
            self._fingerprint = kv_file.model_fingerprint(self.runner.model)
        tp = self.config.parallel.tensor_parallel_size
        return {"fingerprint": self._fingerprint, "tp_size": tp, "tp_rank": self.rank}

    # -- LoRA adapters (the engine core's collective calls) --------------------------------

    def add_lora(self, request: LoRARequest) -> int:
        """Read an adapter (once); its bytes. Raises `LoRAError` (a failure reply)."""
        manager = self.runner.lora if self.runner is not None else None
        if manager is None:
            raise LoRAError("LoRA adapters are not enabled: start with --enable-lora")
        return manager.add(request)

    def remove_lora(self, lora_id: int) -> bool:
        manager = self.runner.lora if self.runner is not None else None
        return manager is not None and manager.remove(lora_id)

    def list_loras(self) -> list[int]:
        manager = self.runner.lora if self.runner is not None else None
        return [] if manager is None else manager.ids()

    def check_health(self, payload: object = None) -> bool:
        """A no-op round trip; the control-path benchmark sends payloads through it."""
        return True

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None
        link = self.link
        if link is None:
            output = self.runner.execute_model(sched)
        else:
            link.sent = False
            try:
                output = self.runner.execute_model(sched)
            except Exception as e:  # the later stages must not wait for this step's output
                if link.push is not None and not link.sent:
                    said = str(e) if isinstance(e, StageLinkError) else f"{type(e).__name__}: {e}"
                    if not isinstance(e, StageLinkError):
                        said = f"pipeline stage {pp_rank()} failed: {said}"
                    link.send_failure(said)
                raise
        self.threads.after_step()
        return output


def _load_tokenizer(source: ModelSource) -> object:
    """The tokenizer, for the infill sampler's token texts (imported here: transformers is
    slow to import and most workers never need it)."""
    from treadle.tokenizer import load_tokenizer

    return load_tokenizer(source)
