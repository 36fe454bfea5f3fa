"""`Worker`: one device's share of the engine: picks the device, loads the model, sizes and
holds the KV cache, and runs steps. The executor calls its methods by name."""

from __future__ import annotations

import functools
from typing import Any

import psutil
import torch

from treadle.config import EngineConfig, ModelSource, model_source
from treadle.logger import init_logger
from treadle.model.attention import kv_row_bytes, resolve_kv_cache_dtype
from treadle.model.llama import LlamaForCausalLM, Stage
from treadle.model.loader import load_model, read_arch
from treadle.model.lora import LoRAError
from treadle.model.parallel import pp_rank, pp_size, tp_rank
from treadle.parallel_config import pp_layer_range
from treadle.wire.engine import LoRARequest
from treadle.wire.worker import ModelRunnerOutput, SchedulerOutput
from treadle.worker import kv_file
from treadle.worker.cpu_share import ThreadGovernor, sets_model_threads
from treadle.worker.model_runner import ModelRunner
from treadle.worker.pp_transfer import StageLink, StageLinkError
from treadle.worker.sampling_rows import TokenPieces
from treadle.worker.start_checks import (  # the start-up checks, torch-free
    CPU_DEFAULT_KV_CACHE_BYTES,
    check_dtype_name,
    check_kv_budget,
    resolve_max_model_len,
    size_text,
)

# Re-exported: their callers import them from here too.

logger = init_logger(__name__)

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


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


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
        if sets_model_threads(parallel):  # the engine core's model (or a count the user chose)
            torch.set_num_threads(parallel.model_threads())
        self.threads = ThreadGovernor(
            parallel.model_threads(),
            pinned=self.device.type != "cpu" or parallel.threads_pinned(),
            apply=torch.set_num_threads,
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
            size_text(per_token),
            kv_row_bytes("float32", self.arch.head_dim)
            / kv_row_bytes(self.kv_dtype, self.arch.head_dim),
        )
        if self.device.type == "cpu":
            logger.info(
                "Memory of this process: %s runtime, %s weights (resident), KV cache %s "
                "reserved, resident as it fills",
                size_text(self._rss_before_load),
                size_text(max(0, self._weights_bytes)),
                size_text(kv),
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
            self._fingerprint = (
                kv_file.gguf_fingerprint(self.source.path)
                if self.source.is_gguf
                else kv_file.model_fingerprint(self.runner.model)
            )
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
