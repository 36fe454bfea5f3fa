"""`prompt_embeds.decode`: torch.save payloads read without torch.load or unpickling; only one
plain dense finite 2-D float tensor of the model's hidden size is taken (issue 23)."""

from __future__ import annotations

import base64
import io
import random
import zipfile

import pytest
import torch

from treadle.prompt_embeds import decode, max_base64_chars
from treadle.validation import InvalidRequest

HIDDEN, MAX_ROWS = 8, 16


def saved(tensor: object) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


def refused(data: str, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match) as e:
        decode(data, HIDDEN, MAX_ROWS)
    assert e.value.param == "prompt_embeds"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_plain_tensor_comes_back_equal(dtype: torch.dtype) -> None:
    t = torch.randn(5, HIDDEN).to(dtype)
    got = decode(saved(t), HIDDEN, MAX_ROWS)
    assert got.dtype == dtype and torch.equal(got, t)
    sliced = torch.randn(7, HIDDEN)[2:]  # saved with its whole storage and an offset
    assert torch.equal(decode(saved(sliced), HIDDEN, MAX_ROWS), sliced)
    grad = torch.randn(1, HIDDEN, requires_grad=True)
    assert not decode(saved(grad), HIDDEN, MAX_ROWS).requires_grad


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        (torch.randn(HIDDEN), "1-D"),
        (torch.randn(2, 3, HIDDEN), "3-D"),
        (torch.randn(3, HIDDEN + 1), "hidden size is 8"),
        (torch.randn(MAX_ROWS + 1, HIDDEN), "17 rows"),
        (torch.randn(HIDDEN, 3).t(), "contiguous"),
        (torch.zeros(2, HIDDEN, dtype=torch.int64), "plain CPU storage|names"),
        (torch.tensor([[float("nan")] * HIDDEN]), "NaN"),
        (torch.tensor([[float("inf")] * HIDDEN]), "infinite"),
        (torch.eye(HIDDEN).to_sparse(), "names"),
        ({"a": torch.randn(2, HIDDEN)}, "uses EMPTY_DICT|pickle"),
        ([torch.randn(2, HIDDEN)], "pickle"),
    ],
)
def test_anything_else_is_refused(tensor: object, match: str) -> None:
    refused(saved(tensor), match)


def zipped(files: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> str:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return base64.b64encode(buf.getvalue()).decode()


def test_a_pickle_that_calls_anything_is_never_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    marker = tmp_path / "ran"
    payload = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    refused(zipped({"archive/data.pkl": payload}), "names 'os system'")
    assert not marker.exists()
    exec_builtin = b"cbuiltins\neval\n(S'1'\ntR."
    refused(zipped({"archive/data.pkl": exec_builtin}), "names 'builtins eval'")


def test_lies_about_sizes_are_refused_before_allocating() -> None:
    good = base64.b64decode(saved(torch.randn(2, HIDDEN)))
    files = {
        i.filename: zipfile.ZipFile(io.BytesIO(good)).read(i)
        for i in zipfile.ZipFile(io.BytesIO(good)).infolist()
    }
    # The pickle claims a storage of 2^31 floats (8 GiB): refused, nothing that big made.
    huge = files["archive/data.pkl"].replace(b"K\x10t", b"J\x00\x00\x00\x7ft")
    refused(zipped({**files, "archive/data.pkl": huge}), "pickle|storage|past")
    short = {**files, "archive/data/0": files["archive/data/0"][:-4]}
    refused(zipped(short), "wrong size")
    refused(zipped(files, zipfile.ZIP_DEFLATED), "compressed")
    refused(zipped({**files, "other/x": b""}), "outside")
    refused(zipped({**files, "archive/byteorder": b"big"}), "little-endian")


def test_bad_base64_and_oversize_text_are_refused_first() -> None:
    refused("not base64!", "valid base64")
    refused("A" * (max_base64_chars(HIDDEN, MAX_ROWS) + 4), "base64 characters")
    refused(base64.b64encode(b"PK\x03\x04 junk").decode(), "torch.save zip")
    with pytest.raises(InvalidRequest, match="base64 string"):
        decode(123, HIDDEN, MAX_ROWS)  # type: ignore[arg-type]


def test_random_damage_only_ever_gives_invalid_request() -> None:
    good = bytearray(base64.b64decode(saved(torch.randn(3, HIDDEN))))
    rng = random.Random(0)
    outcomes = set()
    for _ in range(3000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            decode(base64.b64encode(bytes(data)).decode(), HIDDEN, MAX_ROWS)
            outcomes.add("taken")
        except InvalidRequest:
            outcomes.add("refused")
    assert "refused" in outcomes
