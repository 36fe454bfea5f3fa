"""`Worker`: one device's share of the engine: picks the device, loads the model, sizes and
holds the KV cache, and runs steps. The executor calls its methods by name."""

from __future__ import annotations

import torch

from treadle.config import EngineConfig, resolve_model
from treadle.logger import init_logger
from treadle.model.arch import ModelArch
from treadle.model.loader import load_model, read_arch
from treadle.wire.worker import ModelRunnerOutput, SchedulerOutput
from treadle.worker.model_runner import ModelRunner

logger = init_logger(__name__)

CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30
GPU_KV_CACHE_FRACTION = 0.9

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: float32 on CPU (on this class of CPU, 2-core AVX-512, bfloat16 matmuls at these
    sizes were measured slower than float32; see README), bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or float16")
    return _DTYPES[name]


def resolve_max_model_len(requested: int | None, arch: ModelArch) -> int:
    limit = arch.max_position_embeddings
    if requested is None:
        return limit
    if requested < 1 or requested > limit:
        raise ValueError(
            f"max_model_len {requested} must be between 1 and the model's limit {limit}"
        )
    return requested


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = pick_device()
        self.source = resolve_model(config.model.model)
        self.arch = read_arch(self.source)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.max_model_len = resolve_max_model_len(config.model.max_model_len, self.arch)
        self.runner: ModelRunner | None = None

    def load_model(self) -> None:
        logger.info("Loading %s (%s, %s)", self.source.path, self.dtype, self.device)
        model = load_model(self.source, self.arch, self.dtype, self.device, self.max_model_len)
        self.runner = ModelRunner(
            model, self.device, self.dtype, self.config.cache.block_size, self.config.model.seed
        )

    def determine_num_blocks(self) -> int:
        assert self.runner is not None
        per_block = self.runner.kv_bytes_per_block()
        budget = self.config.cache.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * GPU_KV_CACHE_FRACTION)
            else:
                budget = CPU_DEFAULT_KV_CACHE_BYTES
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory {budget} bytes holds no KV block (one block needs {per_block} bytes)"
            )
        return int(num_blocks)

    def initialize_cache(self, num_blocks: int) -> None:
        assert self.runner is not None
        self.runner.initialize_cache(num_blocks)

    def check_health(self, payload: object = None) -> bool:
        """A no-op round trip; the control-path benchmark sends payloads through it."""
        return True

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None
        return self.runner.execute_model(sched)
