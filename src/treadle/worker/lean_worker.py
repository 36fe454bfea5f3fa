"""`LeanWorker`: `Worker`'s calls for a model the lean runner runs (`lean_runner.py`), in an
engine core that never imports torch; and `lean_refusal`, the start-time choice between it and
the torch runner.

The default model (a Q4 GGUF Llama on the CPU) runs here: the engine core's process holds
python, numpy, the kernels and the weights (~155 MiB for the default model, against ~345 with
torch; docs/design/torch-free-engine-core.md). Every other configuration, and every feature
that needs PyTorch (images, prompt embeddings, LoRA, tensor or pipeline parallelism, a draft
model, CUDA, safetensors weights), takes the torch runner, chosen once at start with a log
line that says why; `TREADLE_LEAN_RUNNER=0` always takes it."""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

from treadle import envs
from treadle.config import EngineConfig, ModelSource, model_source
from treadle.ipc.memory import process_memory
from treadle.logger import init_logger
from treadle.model import kernel_lib
from treadle.model.arch import ModelArch
from treadle.model.gguf_file import GGUFFile, GGUFFormatError
from treadle.model.lean_model import KV_LAYOUTS, MAX_ROWS, LeanModel, unsupported
from treadle.wire.engine import LoRARequest
from treadle.wire.worker import ModelRunnerOutput, SchedulerOutput
from treadle.worker import kv_file
from treadle.worker.cpu_share import ThreadGovernor
from treadle.worker.lean_runner import LeanRunner
from treadle.worker.sampling_rows import TokenPieces
from treadle.worker.start_checks import (
    CPU_DEFAULT_KV_CACHE_BYTES,
    check_kv_budget,
    resolve_max_model_len,
    size_text,
)

logger = init_logger(__name__)


def lean_refusal(config: EngineConfig) -> str | None:
    """Why this engine (world size 1) runs on the torch runner; None: the lean runner takes it."""
    chosen = open_lean(config)
    return chosen if isinstance(chosen, str) else None


def open_lean(config: EngineConfig) -> GGUFFile | str:
    """The model's GGUF file, open (its header read once, for the choice and the worker),
    where the lean runner takes this engine (world size 1); else why the torch runner does."""
    m = config.model
    source = model_source(m)
    reasons = [
        (not envs.lean_runner(), "TREADLE_LEAN_RUNNER=0"),
        (not source.is_gguf, "weights that are not GGUF"),
        (os.path.exists("/proc/driver/nvidia/version"), "an NVIDIA GPU driver (CUDA)"),
        (m.dtype not in ("auto", "float32", "float"), f"--dtype {m.dtype}"),
        (
            config.cache.kv_cache_dtype not in ("auto", *KV_LAYOUTS),
            f"--kv-cache-dtype {config.cache.kv_cache_dtype}",
        ),
        (m.enable_prompt_embeds, "--enable-prompt-embeds"),
        (bool(m.hf_overrides or source.hf_overrides), "--hf-overrides"),
        (config.lora is not None, "--enable-lora"),
        (
            config.speculative is not None and config.speculative.model is not None,
            "a draft model",
        ),
        (not envs.cpu_kernels(), "TREADLE_CPU_KERNELS=0"),
        (envs.packed_gguf_weights(), "TREADLE_PACKED_GGUF_WEIGHTS=1"),
    ]
    for refused, why in reasons:
        if refused:
            return why
    if kernel_lib.select_isa() == "portable":
        return "the portable kernel level (no GGUF-block products)"
    try:
        gguf = GGUFFile(source.path)
    except (OSError, GGUFFormatError) as e:  # (the torch runner's loader says it in full)
        return f"an unreadable GGUF file ({e})"
    model_refusal = unsupported(gguf, _arch(gguf))
    if model_refusal is not None:
        return f"a model with {model_refusal}"
    try:
        _library(kernel_lib.select_isa())
    except (OSError, RuntimeError) as e:
        return f"no kernel library ({e})"
    return gguf


def _arch(gguf: GGUFFile) -> ModelArch:
    """`arch_files.read_arch` of an open file (no `--hf-overrides` here: `open_lean`)."""
    return ModelArch.from_gguf_fields(gguf.fields, {t.name for t in gguf.tensors})


@functools.cache
def _library(isa: str) -> ctypes.CDLL:
    """The kernels of ISA level `isa` (built into the cache on first use)."""
    from treadle.model.kernel_build import build

    return kernel_lib.open_library(isa, build(isa))


def _rss() -> int:
    memory = process_memory()
    return 0 if memory is None else memory.rss


class LeanWorker:
    def __init__(self, config: EngineConfig, gguf: GGUFFile, rank: int = 0) -> None:
        """`gguf`: the model's file, as `open_lean` opened it."""
        self.config = config
        self.rank = rank
        self.source = model_source(config.model)
        self._gguf: GGUFFile | None = gguf  # (until the model is loaded from it)
        self.arch = _arch(gguf)
        self.max_model_len = resolve_max_model_len(config.model.max_model_len, self.arch)
        name = config.cache.kv_cache_dtype
        self.kv_dtype = "float32" if name == "auto" else name  # (the model's dtype is float32)
        self.runner: LeanRunner | None = None
        parallel = config.parallel
        self.threads = ThreadGovernor(parallel.model_threads(), pinned=parallel.threads_pinned())
        self._rss_before_load = self._weights_rss = 0
        self._fingerprint: str | None = None

    def load_model(self) -> None:
        m = self.config.model
        logger.info("Loading %s (float32, cpu, the lean runner: no torch)", self.source.path)
        self._rss_before_load = _rss()
        isa = kernel_lib.select_isa()
        assert self._gguf is not None
        model = LeanModel(
            self._gguf, self.arch, isa, _library(isa), m.cpu_activation_dtype, self.max_model_len
        )
        self._gguf = None
        self._weights_rss = _rss() - self._rss_before_load
        source = self.source
        self.runner = LeanRunner(
            model,
            self.config.cache.block_size,
            m.seed,
            lambda: self.threads.threads,
            TokenPieces(functools.partial(_load_tokenizer, source)),
        )
        logger.info(
            "Model runs on treadle's CPU kernels (%s, %s activations) with %d threads; every "
            "step in one call per %d rows",
            isa,
            m.cpu_activation_dtype,
            self.threads.threads,
            MAX_ROWS,
        )

    def determine_num_blocks(self) -> int:
        budget = self.config.cache.kv_cache_memory
        source = "--kv-cache-memory"
        if budget is None:
            budget, source = CPU_DEFAULT_KV_CACHE_BYTES, "the CPU default"
        return check_kv_budget(
            budget,
            self.kv_bytes_per_block(),
            self.config.cache.block_size,
            self.max_model_len,
            source,
        )

    def kv_bytes_per_block(self) -> int:
        assert self.runner is not None
        return self.runner.model.kv_bytes_per_block(self.config.cache.block_size, self.kv_dtype)

    def initialize_cache(self, num_blocks: int) -> None:
        assert self.runner is not None
        self.runner.model.initialize_cache(num_blocks, self.config.cache.block_size, self.kv_dtype)
        kv = num_blocks * self.kv_bytes_per_block()
        per_token = self.kv_bytes_per_block() // self.config.cache.block_size
        logger.info(
            "KV cache: %s, %s tokens of %d bytes each",
            self.kv_dtype,
            f"{num_blocks * self.config.cache.block_size:,}",
            per_token,
        )
        logger.info(
            "Memory of this process: %s runtime, %s weights (resident), KV cache %s "
            "reserved, resident as it fills",
            size_text(self._rss_before_load),
            size_text(max(0, self._weights_rss)),
            size_text(kv),
        )

    def weight_bytes(self) -> int:
        assert self.runner is not None
        return self.runner.model.weight_bytes

    def stage_info(self) -> dict[str, int]:
        return {"pp_rank": 0, "tp_rank": 0, "layer_start": 0, "layer_end": self.arch.num_layers}

    # -- prompt-cache files (`kv_file.py`) -------------------------------------------------

    def save_kv_blocks(self, path: str, block_ids: list[int], header: dict[str, Any]) -> int:
        assert self.runner is not None
        header = {**header, **self._kv_identity()}
        caches = self.runner.model.kv_caches
        return kv_file.save_blocks(kv_file.rank_path(path, self.rank), caches, block_ids, header)

    def load_kv_blocks(self, path: str, targets: dict[int, int]) -> int:
        assert self.runner is not None
        return kv_file.load_blocks(
            kv_file.rank_path(path, self.rank),
            self.runner.model.kv_caches,
            targets,
            self._kv_identity(),
        )

    def kv_identity(self) -> dict[str, Any]:
        assert self.runner is not None
        return {**kv_file.layout(self.runner.model.kv_caches), **self._kv_identity()}

    def _kv_identity(self) -> dict[str, Any]:
        if self._fingerprint is None:
            self._fingerprint = kv_file.gguf_fingerprint(self.source.path)
        return {"fingerprint": self._fingerprint, "tp_size": 1, "tp_rank": self.rank}

    # -- LoRA adapters: not on this runner (--enable-lora chooses the torch runner) --------

    def add_lora(self, request: LoRARequest) -> int:
        raise RuntimeError("LoRA adapters are not enabled: start with --enable-lora")

    def remove_lora(self, lora_id: int) -> bool:
        return False

    def list_loras(self) -> list[int]:
        return []

    def check_health(self, payload: object = None) -> bool:
        return True

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None
        output = self.runner.execute_model(sched)
        self.threads.after_step()
        return output


def _load_tokenizer(source: ModelSource) -> object:
    """The tokenizer, for the infill sampler's token texts (imported on first use)."""
    from treadle.tokenizer import load_tokenizer

    return load_tokenizer(source)
