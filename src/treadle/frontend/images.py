"""A vision-language model's images on the API server's side: pixels as its Hugging Face
image processor makes them (`ImageProcessor`: resize the shortest edge, center crop, rescale,
normalize, as transformers' PIL backend does), and a prompt's image placeholders expanded to
one token per feature row (`expand_placeholders`), each image becoming a `MultiModalInput`.

Runs in the API server's thread pool (`entrypoints/openai/inputs.py`), never on its event
loop; the engine core only checks what arrives (`core/engine_core.py`).

numpy, torch and PIL are imported when a vision-language model's images are set up: a
text-only model's API server runs without them (issue 41 item 2)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from treadle.model.arch import VisionArch
from treadle.validation import InvalidRequest
from treadle.wire.engine import MultiModalInput

if TYPE_CHECKING:
    import numpy as np
    import torch
    from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageProcessor:
    """The preprocessing of `CLIPImageProcessor` / `LlavaImageProcessor` (their PIL backend),
    read from the model's `preprocessor_config.json` (or transformers 5's
    `processor_config.json`)."""

    shortest_edge: int | None  # resize so that the shorter side is this (keeps the aspect)
    resize_to: tuple[int, int] | None  # or to exactly (height, width)
    crop: tuple[int, int] | None  # center crop (height, width)
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    resample: int
    pad_to_square: bool
    dtype: torch.dtype
    """The pixels' dtype on the wire: float32 for a float32 model, else float16 (the seed's)."""

    @classmethod
    def from_config(
        cls, config: dict[str, Any], vision: VisionArch, dtype: torch.dtype
    ) -> ImageProcessor:
        import torch
        from PIL import Image

        def edge(value: Any, key: str) -> int | None:
            return int(value[key]) if isinstance(value, dict) and key in value else None

        size = config.get("size", {"shortest_edge": vision.image_size})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        crop = config.get("crop_size", {"height": vision.image_size, "width": vision.image_size})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        height, width = edge(size, "height"), edge(size, "width")
        return cls(
            shortest_edge=edge(size, "shortest_edge") if config.get("do_resize", True) else None,
            resize_to=(height, width)
            if config.get("do_resize", True) and height and width
            else None,
            crop=(int(crop["height"]), int(crop["width"]))
            if config.get("do_center_crop", True)
            else None,
            rescale=float(config.get("rescale_factor", 1 / 255))
            if config.get("do_rescale", True)
            else None,
            mean=tuple(config.get("image_mean", CLIP_MEAN))
            if config.get("do_normalize", True)
            else None,
            std=tuple(config.get("image_std", CLIP_STD))
            if config.get("do_normalize", True)
            else None,
            resample=int(config.get("resample", Image.Resampling.BICUBIC)),
            pad_to_square=bool(config.get("do_pad", False)),
            dtype=torch.float32 if dtype == torch.float32 else torch.float16,
        )

    @classmethod
    def from_model_dir(cls, path: str, vision: VisionArch, dtype: torch.dtype) -> ImageProcessor:
        config: dict[str, Any] = {}
        for name in ("preprocessor_config.json", "processor_config.json"):
            file = os.path.join(path, name)
            if os.path.isfile(file):
                with open(file) as f:
                    loaded = json.load(f)
                config = loaded.get("image_processor", loaded)
                break
        from PIL import Image

        processor = cls.from_config(config, vision, dtype)
        side = vision.image_size
        shape = processor(Image.new("RGB", (side + 7, side - 3))).shape
        if tuple(shape) != (3, side, side):
            raise ValueError(
                f"{path}: its image processor makes pixels of shape {tuple(shape)}, but the "
                f"vision tower takes (3, {side}, {side})"
            )
        return processor

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """RGB picture -> pixels [3, H, W] of `self.dtype`."""
        import numpy as np
        import torch
        from PIL import Image

        if self.pad_to_square and image.width != image.height:
            side = max(image.size)
            fill = tuple(int(m * 255) for m in self.mean) if self.mean else (0, 0, 0)
            square = Image.new("RGB", (side, side), fill)  # type: ignore[arg-type]
            square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
            image = square
        if self.resize_to is not None:
            image = image.resize((self.resize_to[1], self.resize_to[0]), self.resample)
        elif self.shortest_edge is not None:
            short, long = sorted(image.size)
            new_long = int(self.shortest_edge * long / short)
            new = (
                (self.shortest_edge, new_long)
                if image.width <= image.height
                else (new_long, self.shortest_edge)
            )
            image = image.resize(new, self.resample)
        pixels = np.asarray(image).transpose(2, 0, 1)  # [3, H, W] uint8
        if self.crop is not None:
            pixels = center_crop(pixels, self.crop)
        out = pixels.astype(np.float64) * self.rescale if self.rescale else pixels
        out = out.astype(np.float32)
        if self.mean is not None and self.std is not None:
            mean = np.array(self.mean, dtype=np.float32)[:, None, None]
            std = np.array(self.std, dtype=np.float32)[:, None, None]
            out = (out - mean) / std
        return torch.from_numpy(np.ascontiguousarray(out)).to(self.dtype)


def center_crop(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """transformers' `center_crop` of [C, H, W]: the middle (height, width), zero padded
    where the picture is smaller."""
    import numpy as np

    height, width = pixels.shape[1:]
    ch, cw = size
    if ch > height or cw > width:
        padded = np.zeros((pixels.shape[0], max(ch, height), max(cw, width)), pixels.dtype)
        top, left = (padded.shape[1] - height + 1) // 2, (padded.shape[2] - width + 1) // 2
        padded[:, top : top + height, left : left + width] = pixels
        pixels, height, width = padded, padded.shape[1], padded.shape[2]
    top, left = (height - ch) // 2, (width - cw) // 2
    return pixels[:, top : top + ch, left : left + cw]


def pixel_hash(pixels: torch.Tensor) -> str:
    """The content hash of preprocessed pixels (with their dtype and shape)."""
    import torch

    head = f"{pixels.dtype}{tuple(pixels.shape)}".encode()
    return hashlib.sha256(
        head + pixels.contiguous().view(torch.uint8).numpy().tobytes()
    ).hexdigest()


def collapse_placeholders(token_ids: list[int], images: list[MultiModalInput]) -> list[int]:
    """The prompt as it goes on the wire: each image's run of placeholders as one token (the
    engine core expands it again: `core/prompt_inputs.py`)."""
    out: list[int] = []
    at = 0
    for mm in images:
        out.extend(token_ids[at : mm.offset + 1])
        at = mm.offset + mm.length
    out.extend(token_ids[at:])
    return out


def expand_placeholders(
    token_ids: list[int], pixels: list[torch.Tensor], vision: VisionArch, param: str
) -> tuple[list[int], list[MultiModalInput]]:
    """The prompt with each image token repeated once per feature row, and its images at
    those places, in order. Raises `InvalidRequest(param)` when the prompt's image tokens
    and the images do not pair up one to one."""
    token = vision.image_token_id
    found = token_ids.count(token)
    if found != len(pixels):
        raise InvalidRequest(
            param,
            f"has {found} image placeholder(s) for {len(pixels)} image(s): each image needs "
            "exactly one placeholder (the chat template writes them for image parts)",
        )
    n = vision.num_image_tokens
    out: list[int] = []
    inputs: list[MultiModalInput] = []
    images = iter(pixels)
    for t in token_ids:
        if t == token:
            p = next(images)
            inputs.append(MultiModalInput(p, len(out), n, pixel_hash(p)))
            out.extend([token] * n)
        else:
            out.append(t)
    return out, inputs


@dataclass(frozen=True)
class ImageInputs:
    """What a front end needs to take a vision-language model's images: its tower's shape,
    its processor, the image token's text (what a chat template writes for an image part) and
    `--limit-mm-per-prompt`."""

    vision: VisionArch
    processor: ImageProcessor
    placeholder: str
    limit: int

    @classmethod
    def for_model(
        cls, model_dir: str, vision: VisionArch | None, tokenizer: Any, dtype: str, limit: int
    ) -> ImageInputs | None:
        """None for a text-only model."""
        if vision is None:
            return None
        import torch

        wire = torch.float32 if dtype in ("auto", "float32", "float") else torch.float16
        processor = ImageProcessor.from_model_dir(model_dir, vision, wire)
        placeholder = str(tokenizer.convert_ids_to_tokens(vision.image_token_id))
        return cls(vision, processor, placeholder, limit)

    def check_count(self, count: int, param: str, max_model_len: int | None = None) -> None:
        """At most `limit` images, and (before any is loaded) no more than the context holds."""
        if count > self.limit:
            raise InvalidRequest(
                param,
                f"has {count} images, more than this server takes per prompt ({self.limit}; "
                "see --limit-mm-per-prompt)",
            )
        tokens = count * self.vision.num_image_tokens
        if max_model_len is not None and tokens >= max_model_len:
            raise InvalidRequest(
                param,
                f"has {count} images of {self.vision.num_image_tokens} tokens each, more than "
                f"this model's context of {max_model_len} tokens holds",
            )

    def prompt(
        self, token_ids: list[int], images: list[Image.Image], param: str
    ) -> tuple[list[int], list[MultiModalInput]]:
        """A prompt's ids with one placeholder per image -> expanded ids and its images."""
        self.check_count(len(images), param)
        pixels = [self.processor(image) for image in images]
        return expand_placeholders(token_ids, pixels, self.vision, param)

    def template_reads_parts(self, template: str | None) -> bool:
        """Whether a chat template writes image parts itself (it names `image`: vLLM's
        "openai" content format); else the image token's text goes into the message text."""
        return template is not None and "image" in template
