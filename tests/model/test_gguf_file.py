"""treadle's GGUF reader against the `gguf` package's on the default model: the same metadata,
the same tensors, the same dequantized floats to the bit; and clear errors for broken files."""

from __future__ import annotations

import numpy as np
import pytest

from treadle.config import resolve_model
from treadle.model.gguf_file import GGUFFile, GGUFFormatError
from treadle.model.loader import ModelLoadError, read_arch


def test_same_fields_tensors_and_floats_as_the_gguf_package(default_model_path: str) -> None:
    import gguf
    from gguf.quants import dequantize

    ours = GGUFFile(default_model_path)
    theirs = gguf.GGUFReader(default_model_path)
    header = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # gguf's own extras
    assert set(ours.fields) == set(theirs.fields) - header
    for key, field in theirs.fields.items():
        if key not in header:
            assert ours.fields[key] == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    kinds = set()
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.kind == ref.tensor_type.name
        assert mine.shape == tuple(int(n) for n in reversed(ref.shape))
        assert np.array_equal(
            mine.data.reshape(-1), np.asarray(ref.data).reshape(-1).view(np.uint8)
        )
        if mine.kind not in kinds:  # one tensor of each type, floats compared bit for bit
            kinds.add(mine.kind)
            expected = np.asarray(dequantize(ref.data, ref.tensor_type), np.float32)
            got = mine.dequantize()
            assert (
                got.view(np.uint32).tobytes()
                == expected.reshape(got.shape).view(np.uint32).tobytes()
            ), mine.kind
    assert {"Q4_1", "Q8_0", "F32"} <= kinds


def test_own_type_table_agrees_with_the_gguf_package() -> None:
    """The block sizes treadle keeps itself (so that an engine core never imports gguf) are
    gguf's: the same names, values and bytes a block."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from treadle.model.gguf_file import _TYPES

    for kind, (name, block, nbytes) in _TYPES.items():
        t = GGMLQuantizationType(kind)
        assert (t.name, *GGML_QUANT_SIZES[t]) == (name, block, nbytes)


# Q5_0: a type outside treadle's own table, whose sizes come from the gguf package
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "Q5_0"])
def test_each_dequantized_type_matches_gguf(kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import gguf
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    floats = rng.standard_normal((8, 64)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "BF16":
        raw = (floats.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(8, -1)
    else:
        raw = np.asarray(quantize(floats, qtype)).view(np.uint8).reshape(8, -1)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("t", raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = GGUFFile(str(path)).tensors
    assert tensor.kind == kind and tensor.shape == (8, 64)
    expected = np.asarray(dequantize(raw, qtype), np.float32).reshape(8, 64)
    assert np.array_equal(tensor.dequantize(), expected)


def test_broken_files_are_named(tmp_path, default_model_path: str) -> None:  # type: ignore[no-untyped-def]
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFFormatError, match="junk.gguf"):
        GGUFFile(str(junk))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFFormatError, match="empty"):
        GGUFFile(str(empty))
    truncated = tmp_path / "truncated.gguf"
    with open(default_model_path, "rb") as f:
        truncated.write_bytes(f.read(5_000_000))
    with pytest.raises(ModelLoadError, match="truncated"):
        read_arch(resolve_model(str(truncated)))
