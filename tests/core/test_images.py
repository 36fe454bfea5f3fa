"""The engine core's side of images (`core/prompt_inputs.py`): the wire's one placeholder per image
expanded, then every forged or broken image refused with `InvalidRequest` (never a crash of
a step)."""

from __future__ import annotations

import pytest
import torch

from treadle.core.prompt_inputs import check_mm_inputs, expand_images
from treadle.model.arch import VisionArch
from treadle.sampling_params import SamplingParams
from treadle.validation import InvalidRequest
from treadle.wire.engine import EngineCoreRequest, MultiModalInput

TOKEN = 500
VISION = VisionArch(
    hidden_size=8,
    intermediate_size=16,
    num_layers=2,
    num_heads=2,
    image_size=28,
    patch_size=14,
    layer_norm_eps=1e-5,
    hidden_act="quick_gelu",
    feature_layer=-2,
    select_strategy="default",
    projector_act="gelu",
    projector_bias=True,
    image_token_id=TOKEN,
)  # 4 image tokens an image


def request(ids: list[int], images: list[MultiModalInput]) -> EngineCoreRequest:
    return EngineCoreRequest("r", ids, SamplingParams(max_tokens=2), mm_inputs=images)


def image(offset: int, pixels: torch.Tensor | None = None, length: int = 4) -> MultiModalInput:
    return MultiModalInput(
        torch.zeros(3, 28, 28) if pixels is None else pixels, offset, length, "h" * 64
    )


def test_each_placeholder_is_expanded_to_its_image_tokens() -> None:
    wire = request([7, TOKEN, 8, TOKEN, 9], [image(1), image(6)])
    expanded = expand_images(wire, VISION, limit=4)
    assert expanded.prompt_token_ids == [7, *[TOKEN] * 4, 8, *[TOKEN] * 4, 9]
    check_mm_inputs(expanded, VISION, limit=4)  # passes
    assert expand_images(request([1, 2], []), VISION, 4).prompt_token_ids == [1, 2]


@pytest.mark.parametrize(
    ("ids", "images", "limit", "vision", "needle"),
    [
        ([7, TOKEN, 9], [image(1)], 4, None, "text only"),
        ([7, TOKEN, TOKEN, 9], [image(1), image(5)], 1, VISION, "per prompt"),
        ([7, TOKEN, 9], [image(1, length=5)], 4, VISION, "not 4 tokens"),
        ([7, 8, 9], [image(1)], 4, VISION, "no placeholder"),
        ([7, TOKEN, 9], [image(2)], 4, VISION, "no placeholder"),
        ([7, TOKEN, 9], [image(99)], 4, VISION, "no placeholder"),
        ([7, TOKEN, 9], [image(-3)], 4, VISION, "no placeholder"),
    ],
)
def test_forged_placeholders_are_refused(
    ids: list[int],
    images: list[MultiModalInput],
    limit: int,
    vision: VisionArch | None,
    needle: str,
) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        expand_images(request(ids, images), vision, limit)


@pytest.mark.parametrize(
    ("pixels", "needle"),
    [
        (torch.zeros(3, 28, 29), "shape"),
        (torch.zeros(1, 28, 28), "shape"),
        (torch.zeros(3, 28, 28, dtype=torch.int32), "float"),
        (torch.full((3, 28, 28), float("nan")), "finite"),
    ],
)
def test_broken_pixels_are_refused(pixels: torch.Tensor, needle: str) -> None:
    expanded = expand_images(request([7, TOKEN, 9], [image(1, pixels)]), VISION, 4)
    with pytest.raises(InvalidRequest, match=needle):
        check_mm_inputs(expanded, VISION, 4)


def test_image_tokens_without_an_image_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="image tokens come only with images"):
        check_mm_inputs(request([7, TOKEN, 9], []), VISION, 4)


def test_a_chunk_stops_before_the_image_that_overflows_the_encoder_budget() -> None:
    from treadle.core.prompt_inputs import encoder_cut

    images = [image(10, length=4), image(20, length=4), image(30, length=4)]
    assert encoder_cut(images, 0, 40, budget=100, fresh=True) == (40, 12)
    assert encoder_cut(images, 0, 40, budget=8, fresh=True) == (30, 8)  # the third waits
    assert encoder_cut(images, 0, 40, budget=3, fresh=True) == (20, 4)  # one always fits
    assert encoder_cut(images, 0, 40, budget=3, fresh=False) == (10, 0)
    assert encoder_cut(images, 12, 10, budget=0, fresh=False) == (8, 0)  # begun: free
    assert encoder_cut(None, 0, 40, budget=0, fresh=False) == (40, 0)
