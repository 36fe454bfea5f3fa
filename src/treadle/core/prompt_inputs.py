"""The engine core's checks of what a prompt carries besides token ids: its rows of input
embeddings (`check_embeds`) and its images (`EngineCoreRequest.mm_inputs`: each image's one
placeholder on the wire expanded to its `length` by `expand_images`, then every image checked
again by `check_mm_inputs`). The API server made them, but a bad value here would crash a
step."""

from __future__ import annotations

import msgspec

from treadle import prompt_embeds as embeds_format
from treadle.ipc.serial import Tensor  # torch.Tensor, without importing torch
from treadle.model.arch import VisionArch
from treadle.validation import InvalidRequest
from treadle.wire.engine import EngineCoreRequest, MultiModalInput

PIXEL_DTYPES = ("torch.float16", "torch.bfloat16", "torch.float32")  # (str(tensor.dtype))


def expand_images(
    request: EngineCoreRequest, vision: VisionArch | None, limit: int
) -> EngineCoreRequest:
    """The request with each image's placeholder token (one on the wire) repeated `length`
    times, so that its offsets hold. The count and the lengths are checked first, so that
    the expansion is bounded (`limit` x the image tokens of one image). Raises
    `InvalidRequest`."""
    images = request.mm_inputs
    if not images:
        return request
    if vision is None:
        raise InvalidRequest("messages", "this model takes no images (it is text only)")
    if len(images) > limit:
        raise InvalidRequest(
            "messages", f"has {len(images)} images, over this server's {limit} per prompt"
        )
    ids = request.prompt_token_ids
    out: list[int] = []
    at = 0
    for i, mm in enumerate(images):
        if not isinstance(mm, MultiModalInput) or mm.length != vision.num_image_tokens:
            raise InvalidRequest("mm_inputs", f"image {i}: not {vision.num_image_tokens} tokens")
        take = mm.offset - len(out)  # wire tokens before this image's placeholder
        if take < 0 or at + take >= len(ids) or ids[at + take] != vision.image_token_id:
            raise InvalidRequest("mm_inputs", f"image {i}: no placeholder at its offset")
        out.extend(ids[at : at + take])
        out.extend([vision.image_token_id] * mm.length)
        at += take + 1
    out.extend(ids[at:])
    return msgspec.structs.replace(request, prompt_token_ids=out)


def check_mm_inputs(request: EngineCoreRequest, vision: VisionArch | None, limit: int) -> None:
    """Each image: pixels [3, S, S] of a float type, all finite, its placeholders inside the
    prompt, in order, not overlapping, each one the image token; every image token of the
    prompt belongs to an image; at most `limit` images. Raises `InvalidRequest`."""
    images = request.mm_inputs or []
    ids = request.prompt_token_ids
    if vision is None:
        if images:
            raise InvalidRequest("messages", "this model takes no images (it is text only)")
        return
    if len(images) > limit:
        raise InvalidRequest(
            "messages", f"has {len(images)} images, over this server's {limit} per prompt"
        )
    side, token = vision.image_size, vision.image_token_id
    end = 0
    for i, mm in enumerate(images):
        pixels = mm.pixel_values
        if not isinstance(pixels, Tensor) or str(pixels.dtype) not in PIXEL_DTYPES:
            raise InvalidRequest("mm_inputs", f"image {i}: pixels must be a float tensor")
        if tuple(pixels.shape) != (3, side, side):
            raise InvalidRequest(
                "mm_inputs",
                f"image {i}: pixels of shape {tuple(pixels.shape)}, not (3, {side}, {side})",
            )
        if not bool(pixels.isfinite().all()):
            raise InvalidRequest("mm_inputs", f"image {i}: pixels must be finite")
        if mm.length != vision.num_image_tokens or mm.offset < end:
            raise InvalidRequest("mm_inputs", f"image {i}: placeholders out of order or size")
        if mm.offset + mm.length > len(ids) or any(
            t != token for t in ids[mm.offset : mm.offset + mm.length]
        ):
            raise InvalidRequest("mm_inputs", f"image {i}: its placeholders are not image tokens")
        if not isinstance(mm.hash, str) or not 0 < len(mm.hash) <= 128:
            raise InvalidRequest("mm_inputs", f"image {i}: a hash of 1 to 128 characters")
        end = mm.offset + mm.length
    covered = len(images) * vision.num_image_tokens
    if ids.count(token) != covered:
        raise InvalidRequest(
            "prompt",
            f"holds {ids.count(token)} image tokens but its {len(images)} image(s) cover "
            f"{covered}: image tokens come only with images",
        )


def encoder_cut(
    images: list[MultiModalInput] | None, start: int, n: int, budget: int, fresh: bool
) -> tuple[int, int]:
    """(tokens to schedule, image tokens the vision encoder starts) for a chunk of `n`
    positions from `start`: the chunk stops before the first image that would take the
    step's encoder budget past `budget` (image tokens; `fresh`: nothing spent yet this step,
    so one image always fits). An image begun by an earlier chunk costs nothing (its
    features are cached)."""
    cost = 0
    for mm in images or ():
        if mm.offset < start:
            continue
        if mm.offset >= start + n:
            break
        if cost + mm.length > budget and not (fresh and cost == 0):
            return mm.offset - start, cost
        cost += mm.length
    return n, cost


def check_embeds(request: EngineCoreRequest, width: int | None, max_model_len: int) -> None:
    """The front end's checks of `prompt_embeds` again (`width` None: they are not enabled),
    and one row per prompt token. Raises `InvalidRequest`."""
    if width is None:
        raise embeds_format.disabled()
    embeds = embeds_format.check_tensor(request.prompt_embeds, width, max_model_len)
    if embeds.shape[0] != len(request.prompt_token_ids):
        raise InvalidRequest(
            "prompt_embeds",
            f"have {embeds.shape[0]} rows for {len(request.prompt_token_ids)} prompt tokens",
        )
    if request.sampling_params.prompt_logprobs is not None:
        raise InvalidRequest("prompt_logprobs", "are not available for prompt_embeds")
