"""Weight loading: safetensors and GGUF as two generators of Hugging Face-named tensors."""

from __future__ import annotations

import functools
import glob
import os
import time
from collections.abc import Callable, Iterator

import torch

from treadle.config import ModelSource
from treadle.logger import init_logger
from treadle.model import cpu_kernels
from treadle.model.arch import ModelArch, UnsupportedModelError
from treadle.model.arch_files import ModelLoadError
from treadle.model.arch_files import read_arch as read_arch  # (its callers import it here too)
from treadle.model.gguf_file import GGUFFile, GGUFFormatError
from treadle.model.gguf_layout import unpermute_rope_rows
from treadle.model.llama import LlamaForCausalLM, Stage
from treadle.model.llava import model_class
from treadle.model.quantized import GGUFBlocks, blocks_only, kernel_type

logger = init_logger(__name__)

GGUF_SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"}

# GGUF tensor name (after `blk.N.`) -> Hugging Face name (after `model.layers.N.`).
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


TRIM_EVERY = 16  # tensors read, or modules prepared, between two `_release_freed_memory`


def load_model(
    source: ModelSource,
    arch: ModelArch,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    cpu_activation_dtype: str = "float32",
    stage: Stage | None = None,
) -> LlamaForCausalLM:
    """The model, loaded and prepared; `cpu_activation_dtype`: the GGUF-block linear layers'
    activations on treadle's CPU kernels (`Kernels.with_activations`; nothing elsewhere);
    `stage`: a pipeline stage's layers (default: the whole model), whose tensors alone are
    read from the file.

    Loads and prepares on one PyTorch thread: a layer's preparation is many small tensor
    operations, and with two intra-op threads on a busy CPU each one waited for the thread that
    lost its core (a warm start's preparation, 2 cores at load 5: 3.3-6.9 s on 2 threads
    against 0.38 s on one). The model's own steps use the threads
    the engine set (restored here before the last line)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, prepared = _load_and_prepare(
            source, arch, dtype, device, max_positions, cpu_activation_dtype, stage
        )
    finally:
        torch.set_num_threads(threads)
    on_threads = f" with {threads} threads" if device.type == "cpu" else ""
    logger.info("Model runs on %s", prepared % on_threads)
    return model


def _load_and_prepare(
    source: ModelSource,
    arch: ModelArch,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    cpu_activation_dtype: str,
    stage: Stage | None,
) -> tuple[LlamaForCausalLM, str]:
    """`load_model`'s work: the model, and what it runs on (a `%s` where its threads go)."""
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(arch)(arch, max_positions, stage)
    finally:
        torch.set_default_dtype(torch.float32)
    weights = (
        _gguf_weights(source.path, arch, model.wants)
        if source.is_gguf
        else _safetensors_weights(source.path, model.wants)
    )
    # One line per phase with its time (a progress bar of a load this short stayed at 0%).
    started, count = time.monotonic(), [0]
    model.load_weights(_counted(weights, count))
    loaded = time.monotonic()
    logger.info(
        "Read %d tensors from %s in %.1f s",
        count[0],
        os.path.basename(source.path.rstrip("/")),
        loaded - started,
    )
    kernels = cpu_kernels.for_model(device, dtype)
    if kernels is not None and source.is_gguf:  # (only GGUF-block layers read it)
        kernels = kernels.with_activations(cpu_activation_dtype)
    for i, module in enumerate(model.modules()):
        prepare = getattr(module, "prepare", None)
        if module is not model and callable(prepare):
            prepare(kernels)  # each layer picks its implementation, once
        if i % TRIM_EVERY == TRIM_EVERY - 1:
            _release_freed_memory()
    model.prepare(kernels)  # then the model, which looks at its layers' choices
    _release_freed_memory()
    fused = model.fused
    runs_on = cpu_kernels.describe(kernels, device, dtype)
    steps = f"; decode steps of up to {fused.max_rows} requests in one fused call" if fused else ""
    return (
        model.eval(),
        f"{runs_on}%s{steps} (layers prepared in {time.monotonic() - loaded:.1f} s)",
    )


def _counted(
    weights: Iterator[tuple[str, torch.Tensor]], count: list[int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights`, counting them in `count[0]`."""
    for item in weights:
        count[0] += 1
        yield item


def _release_freed_memory() -> None:
    """Hand the heap's freed pages back to the OS (glibc's malloc_trim): what the load read and
    let go (the blocks as the file held them, the copies made while laying them out) stays
    resident in the heap's middle otherwise, ~15 MiB of the default model's with int8x2
    (engine core 361 against 347 MiB). Called every `TRIM_EVERY` tensors and layers of the
    load too, not only at its end: the freed pages no longer pile up to a peak (the default
    model's engine core 357 -> 346 MiB at start, ~0.1 ms a call). Without glibc nothing
    happens."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, looked up once in this process's own symbols (None without it)."""
    import ctypes

    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def _safetensors_weights(
    path: str, wants: Callable[[str], bool] = lambda name: True
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {path}")
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in [k for k in f.keys() if wants(k)]:  # noqa: SIM118 (not a dict)
                    yield name, f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types
            raise ModelLoadError(f"cannot read {file}: {e}") from e


def open_gguf(path: str) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (OSError, GGUFFormatError) as e:
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (truncated or corrupt?): {e}"
        ) from e


def _gguf_weights(
    path: str, arch: ModelArch, wants: Callable[[str], bool] = lambda name: True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face-named tensors: float32, or for the block types the kernels read only the
    blocks (`quantized.blocks_only`), which unmap the file's pages once copied out. Tensors
    that `wants` refuses (another pipeline stage's) are never read: their pages stay on disk."""
    gguf = open_gguf(path)
    for i, tensor in enumerate(gguf.tensors):
        if i % TRIM_EVERY == TRIM_EVERY - 1:
            _release_freed_memory()
        kind = tensor.kind
        if kind not in GGUF_SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"GGUF tensor {tensor.name} has type {kind}; treadle reads {sorted(GGUF_SUPPORTED_TYPES)}"
            )
        name = _hf_name(tensor.name)
        if not wants(name):
            continue
        heads = 0
        if arch.family in ("llama", "mistral") and name.endswith(
            ("q_proj.weight", "k_proj.weight")
        ):
            heads = arch.num_heads if "q_proj" in name else arch.num_kv_heads
        if kernel_type(kind) and len(tensor.shape) == 2:
            # Only the blocks (quantized.py): float32 only where a layer asks for it.
            raw = unpermute_rope_rows(tensor.data, heads) if heads else tensor.data
            yield name, blocks_only(tensor.shape, GGUFBlocks(kind, raw, gguf.release_pages))
            continue
        try:
            array = tensor.dequantize()
        except Exception as e:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} is unreadable (truncated?): {e}"
            ) from e
        yield name, torch.from_numpy(unpermute_rope_rows(array, heads) if heads else array)


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, base, suffix = parts[1], parts[2], ".".join(parts[3:])
        if base not in _GGUF_LAYER_NAMES:
            raise UnsupportedModelError(f"unknown GGUF tensor {gguf_name}")
        return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[base]}.{suffix}"
    if parts[0] not in _GGUF_TOP_NAMES:
        raise UnsupportedModelError(f"unknown GGUF tensor {gguf_name}")
    return f"{_GGUF_TOP_NAMES[parts[0]]}.{'.'.join(parts[1:])}"
