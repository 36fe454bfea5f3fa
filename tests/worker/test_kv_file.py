"""Prompt-cache files (worker/kv_file.py) from numpy caches (the lean runner's) and torch
tensors (the torch runner's): the same bytes either way, read back into either; a GGUF model's
fingerprint, which both runners use."""

from __future__ import annotations

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


def test_a_gguf_fingerprint_reads_the_blocks(tmp_path: Path, default_model_path: str) -> None:
    """Both runners' fingerprint of a GGUF model: stable, and changed by a byte of a
    tensor's blocks (two quantizations of one model share their norms, not their blocks)."""
    first = kv_file.gguf_fingerprint(default_model_path)
    assert kv_file.gguf_fingerprint(default_model_path) == first
    from treadle.model.gguf_file import GGUFFile

    tensor = next(t for t in GGUFFile(default_model_path).tensors if t.kind == "Q4_1")
    data = bytearray(Path(default_model_path).read_bytes())
    offset = data.find(tensor.data.reshape(-1)[:64].tobytes())
    data[offset + 7] ^= 1
    changed = tmp_path / "changed.gguf"
    changed.write_bytes(bytes(data))
    assert kv_file.gguf_fingerprint(str(changed)) != first


def test_kv_file_imports_no_torch(tmp_path: Path) -> None:
    code = (
        "import sys, numpy as np\n"
        "from treadle.worker import kv_file\n"
        "c = [(np.ones((1, 2, 4, 8), np.float32), np.zeros((1, 2, 4, 8), np.float32))]\n"
        f"kv_file.save_blocks({str(tmp_path / 'f')!r}, c, [1], {{'token_ids': [1, 2, 3, 4]}})\n"
        f"kv_file.load_blocks({str(tmp_path / 'f')!r}, c, {{0: 0}}, {{}})\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
