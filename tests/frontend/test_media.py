"""`frontend/media.py` on hostile images, in this process (the served test sends the same
through HTTP): each refusal names the part, and a decompression bomb never decodes."""

from __future__ import annotations

import base64
import io
import os
import resource
import time
from pathlib import Path

import pytest
from PIL import Image

from llava_helpers import bomb_png
from treadle.frontend.media import MediaPolicy, decode_image, load_image
from treadle.validation import InvalidRequest

WHERE = "messages[0].content[1].image_url"


def png_bytes(width: int = 32, height: int = 24, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height), "red" if mode != "P" else 3).save(buf, format="PNG")
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_a_data_uri_png_decodes_to_rgb() -> None:
    image = load_image(data_uri(png_bytes(mode="RGBA")), MediaPolicy(), WHERE)
    assert image.mode == "RGB" and image.size == (32, 24)


# 6,000^2: a whole valid image over our cap (decoded, it would take 108 MB: the check on RSS
# fails without the cap); 30,000^2: a header over Pillow's own limit too (the bomb).
@pytest.mark.parametrize(("side", "rows"), [(6_000, None), (30_000, 8)])
def test_a_decompression_bomb_is_refused_from_its_header_without_decoding(
    side: int, rows: int | None
) -> None:
    data = bomb_png(side, side, rows)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(InvalidRequest, match="pixels") as e:
        decode_image(data, MediaPolicy(), WHERE)
    assert e.value.param == WHERE
    assert time.perf_counter() - start < 1.0
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 32 * 1024  # never the 108 MB to 2.7 GB the RGB pixels would take


def test_an_animated_gif_gives_its_first_frame_without_reading_the_others() -> None:
    frames = [Image.new("P", (8, 8), i % 200) for i in range(3000)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=10)
    start = time.perf_counter()
    image = decode_image(buf.getvalue(), MediaPolicy(), WHERE)
    assert image.size == (8, 8) and image.mode == "RGB"
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        (data_uri(b"hello"), "not an image"),
        (data_uri(png_bytes()[:60]), "decoded"),
        (data_uri(b"<svg/>", "image/svg+xml"), "media type"),
        ("data:image/png;base64,@@@", "base64"),
        ("data:image/png,rawbytes", "base64"),
        ("data:image/png;base64", "','"),
        ("gopher://x/y.png", "scheme"),
        ("file:///etc/passwd", "allowed-local-media-path"),
        ("https://example.com/cat.png", "not an allowed one"),
        (12, "url string"),
    ],
)
def test_refusals_name_the_part(url: object, needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle) as e:
        load_image(url, MediaPolicy(max_bytes=1 << 20), WHERE)
    assert e.value.param == WHERE


def test_a_truncated_jpeg_is_refused() -> None:
    from llava_helpers import random_image

    buf = io.BytesIO()
    random_image(1, 64, 64).save(buf, format="JPEG")
    cut = buf.getvalue()[: len(buf.getvalue()) // 2]
    with pytest.raises(InvalidRequest, match="could not be decoded") as e:
        load_image(data_uri(cut, "image/jpeg"), MediaPolicy(), WHERE)
    assert e.value.param == WHERE


def test_other_formats_are_not_decoded_even_in_image_clothes() -> None:
    for fmt in ("BMP", "TIFF", "PPM"):
        buf = io.BytesIO()
        Image.new("RGB", (4, 4)).save(buf, format=fmt)
        with pytest.raises(InvalidRequest, match="not an image this server decodes"):
            load_image(data_uri(buf.getvalue()), MediaPolicy(), WHERE)


def test_a_body_over_the_cap_is_refused_before_it_is_decoded() -> None:
    url = "data:image/png;base64," + "A" * (4 << 20)
    with pytest.raises(InvalidRequest, match="over this server"):
        load_image(url, MediaPolicy(max_bytes=1 << 20), WHERE)


def test_local_files_only_inside_the_allowed_folder(tmp_path: Path) -> None:
    inside, outside = tmp_path / "media", tmp_path / "private"
    inside.mkdir()
    outside.mkdir()
    (inside / "ok.png").write_bytes(png_bytes())
    (outside / "secret.png").write_bytes(png_bytes())
    os.symlink(outside / "secret.png", inside / "link.png")
    policy = MediaPolicy(allowed_local_path=os.path.realpath(inside))
    assert load_image((inside / "ok.png").as_uri(), policy, WHERE).size == (32, 24)
    for url in (
        (inside / "link.png").as_uri(),
        f"file://{inside}/../private/secret.png",
        (outside / "secret.png").as_uri(),
        "file://otherhost/etc/passwd",
    ):
        with pytest.raises(InvalidRequest) as e:
            load_image(url, policy, WHERE)
        assert e.value.param == WHERE
    with pytest.raises(InvalidRequest, match="cannot be read"):
        load_image((inside / "missing.png").as_uri(), policy, WHERE)


def test_an_allowed_host_that_resolves_to_a_private_address_is_refused() -> None:
    policy = MediaPolicy(allowed_domains=("localhost",))
    with pytest.raises(InvalidRequest, match="non-public address"):
        load_image("http://localhost:9/cat.png", policy, WHERE)
