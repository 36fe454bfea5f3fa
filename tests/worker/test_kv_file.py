"""Prompt-cache files (worker/kv_file.py) from numpy caches (the lean runner's) and torch
tensors (the torch runner's): the same bytes either way, read back into either; the model
fingerprint computed from numpy arrays equals the torch model's."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from treadle.worker import kv_file


def _caches(dtype: str, layers: int = 2) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer (K, V) `[kv_heads 3, blocks 6, block_size 4, head_dim 8]`; int8: rows of 8
    values and 4 scale bytes."""
    rng = np.random.default_rng(7)
    width = 8 + 4 if dtype == "int8" else 8
    shape = (3, 6, 4, width)

    def one() -> np.ndarray:
        if dtype == "int8":
            return rng.integers(-128, 128, shape).astype(np.int8)
        return rng.standard_normal(shape).astype(dtype)

    return [(one(), one()) for _ in range(layers)]


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_numpy_and_torch_caches_write_the_same_file_and_read_it_back(
    tmp_path: Path, dtype: str
) -> None:
    arrays = _caches(dtype)
    tensors = [(torch.from_numpy(k.copy()), torch.from_numpy(v.copy())) for k, v in arrays]
    header = {"token_ids": list(range(8)), "fingerprint": "x"}
    assert kv_file.layout(arrays) == kv_file.layout(tensors)
    assert kv_file.layout(arrays)["head_dim"] == 8 and kv_file.layout(arrays)["dtype"] == dtype
    from_numpy, from_torch = tmp_path / "np.bin", tmp_path / "torch.bin"
    kv_file.save_blocks(str(from_numpy), arrays, [4, 1], header)
    kv_file.save_blocks(str(from_torch), tensors, [4, 1], header)
    assert from_numpy.read_bytes() == from_torch.read_bytes()

    back_np = [(np.zeros_like(k), np.zeros_like(v)) for k, v in arrays]
    back_torch = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in tensors]
    for back in (back_np, back_torch):
        size = kv_file.load_blocks(str(from_numpy), back, {0: 2, 1: 5}, {"fingerprint": "x"})
        assert size == from_numpy.stat().st_size
    for (k, v), (nk, nv), (tk, tv) in zip(arrays, back_np, back_torch, strict=True):
        for cache, np_back, torch_back in ((k, nk, tk), (v, nv, tv)):
            assert np.array_equal(np_back[:, [2, 5]], cache[:, [4, 1]])
            assert np.array_equal(np.delete(np_back, [2, 5], axis=1), 0 * cache[:, :4])
            assert np.array_equal(torch_back.numpy(), np_back)


def test_a_numpy_cache_refuses_what_a_torch_cache_refuses(tmp_path: Path) -> None:
    path = str(tmp_path / "f.bin")
    kv_file.save_blocks(path, _caches("float32"), [0], {"token_ids": [1, 2, 3, 4]})
    with pytest.raises(kv_file.KVFileError, match="float32 KV cache .*is int8"):
        kv_file.load_blocks(path, _caches("int8"), {0: 0}, {})
    with pytest.raises(kv_file.KVFileError, match="num_layers"):
        kv_file.load_blocks(path, _caches("float32", layers=3), {0: 0}, {})
    data = bytearray(Path(path).read_bytes())
    data[-40] ^= 1
    Path(path).write_bytes(bytes(data))
    with pytest.raises(kv_file.KVFileError, match="corrupt"):
        kv_file.load_blocks(path, _caches("float32"), {0: 0}, {})


def test_fingerprint_arrays_is_the_torch_models_fingerprint() -> None:
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Embedding(40, 8), torch.nn.Linear(8, 300), torch.nn.LayerNorm(300)
    )
    model.register_buffer("empty", torch.empty(0))
    named = [(name, t.detach().numpy().copy()) for name, t in model.state_dict().items()]
    assert kv_file.fingerprint_arrays(named) == kv_file.model_fingerprint(model)
    assert kv_file.fingerprint_arrays(reversed(named)) == kv_file.model_fingerprint(model)
    named[1][1][0, 0] += 1
    assert kv_file.fingerprint_arrays(named) != kv_file.model_fingerprint(model)


GGUF_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
BLOCK_WEIGHTS = ("mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj", "self_attn.qkv_proj")


def lean_named_arrays(path: str) -> list[tuple[str, np.ndarray]]:
    """What a runner without torch passes to `fingerprint_arrays` for a Llama GGUF model whose
    linear layers (and tied embedding / LM head) run on the GGUF blocks: the torch model's
    state_dict names, empty float32 arrays for the weights held as blocks (the torch model's
    parameters are empty placeholders there), the norms as float32 values from the file."""
    from treadle.model.gguf_file import GGUFFile

    gguf = GGUFFile(path)
    empty = np.empty(0, dtype=np.float32)
    named = [("lm_head.weight", empty), ("model.embed_tokens.weight", empty)]
    for t in gguf.tensors:
        if t.name == "output_norm.weight":
            named.append(("model.norm.weight", t.dequantize().astype(np.float32)))
        parts = t.name.split(".")  # blk.N.attn_norm.weight
        if parts[0] == "blk" and parts[2] in GGUF_NORMS:
            name = f"model.layers.{parts[1]}.{GGUF_NORMS[parts[2]]}.weight"
            named.append((name, t.dequantize().astype(np.float32)))
    layers = {int(t.name.split(".")[1]) for t in gguf.tensors if t.name.startswith("blk.")}
    named += [(f"model.layers.{i}.{w}.weight", empty) for i in layers for w in BLOCK_WEIGHTS]
    return named


def test_the_lean_recipe_gives_the_default_models_fingerprint(default_model_path: str) -> None:
    """The recipe of `lean_named_arrays` (the names and values a lean runner hashes) against
    the torch runner's model on this CPU's kernels: a prompt-cache file saved by one runner
    is read by the other."""
    from treadle.config import resolve_model
    from treadle.model.loader import load_model, read_arch

    source = resolve_model(default_model_path)
    model = load_model(source, read_arch(source), torch.float32, torch.device("cpu"), 512)
    state = model.state_dict()
    if any(state[f"model.layers.0.{w}.weight"].numel() for w in BLOCK_WEIGHTS):
        pytest.skip("the linear layers are not on the GGUF blocks at this CPU's level")
    lean = lean_named_arrays(source.path)
    assert {name for name, _ in lean} == set(state)
    for name, a in itertools.islice(sorted(lean), kv_file.FINGERPRINT_TENSORS):
        assert np.array_equal(a, state[name].numpy()), name
    assert kv_file.fingerprint_arrays(lean) == kv_file.model_fingerprint(model)


def test_kv_file_imports_no_torch(tmp_path: Path) -> None:
    code = (
        "import sys, numpy as np\n"
        "from treadle.worker import kv_file\n"
        "c = [(np.ones((1, 2, 4, 8), np.float32), np.zeros((1, 2, 4, 8), np.float32))]\n"
        f"kv_file.save_blocks({str(tmp_path / 'f')!r}, c, [1], {{'token_ids': [1, 2, 3, 4]}})\n"
        f"kv_file.load_blocks({str(tmp_path / 'f')!r}, c, {{0: 0}}, {{}})\n"
        "kv_file.fingerprint_arrays([('a', c[0][0])])\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
