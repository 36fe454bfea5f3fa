"""A tiny random LLaVA-1.5 (CLIP vision tower at 336 x 336, patch 14: 576 image tokens; a
small Llama) saved as a Hugging Face directory, with the default model's tokenizer plus an
`<image>` token and llava-hf's chat template: what the image tests serve and compare with
transformers on."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from random_weights import randomize

IMAGE_TOKEN = "<image>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' ' }}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def build_tiny_llava(path: Path, seed: int = 0) -> Path:
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    from treadle.config import resolve_model
    from treadle.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(None))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=336,
        patch_size=14,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer) + 63,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    model = LlavaForConditionalGeneration(config)
    randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    CLIPImageProcessor(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}
    ).save_pretrained(path)
    return path


def random_image(seed: int, width: int = 500, height: int = 400) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


class Reference:
    """transformers' own LLaVA on the same directory: greedy token ids for a prompt (one
    `<image>` per image) and its images."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer, CLIPImageProcessor, LlavaForConditionalGeneration

        self.model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
        self.model.eval()
        self.processor = CLIPImageProcessor.from_pretrained(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokens_per_image = (336 // 14) ** 2

    def prompt_ids(self, prompt: str) -> list[int]:
        text = prompt.replace(IMAGE_TOKEN, IMAGE_TOKEN * self.tokens_per_image)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def greedy_ignore_eos(
        self, prompt: str, images: list[Image.Image], max_tokens: int
    ) -> list[int]:
        return self.greedy(prompt, images, max_tokens, ignore_eos=True)

    def greedy(
        self, prompt: str, images: list[Image.Image], max_tokens: int, ignore_eos: bool = False
    ) -> list[int]:
        ids = torch.tensor([self.prompt_ids(prompt)])
        kwargs: dict[str, object] = {}
        if ignore_eos:
            kwargs["min_new_tokens"] = max_tokens
        if images:
            kwargs["pixel_values"] = self.processor(images, return_tensors="pt").pixel_values
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids, max_new_tokens=max_tokens, do_sample=False, **kwargs
            )
        return out[0, ids.shape[1] :].tolist()


def bomb_png(width: int, height: int, rows: int | None = None) -> bytes:
    """A valid PNG of ~100 KB that decodes to `width` x `height` black pixels (with `rows`:
    only that many rows are written, a truncated one that declares the whole size)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    packer = zlib.compressobj(9)
    row = b"\x00" * (1 + 3 * width)  # filter byte, then black RGB pixels
    n = height if rows is None else rows
    idat = b"".join(packer.compress(row) for _ in range(n)) + packer.flush()
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )
