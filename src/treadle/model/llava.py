"""LLaVA (`LlavaForConditionalGeneration`): a CLIP vision tower and a projector beside a
Llama-family decoder. An image's rows of input embeddings (`encode_images`) take the places
of its placeholder tokens in the prompt, as a prompt's `prompt_embeds` rows do
(`worker/encoder_cache.py` keeps them between steps)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from treadle.model.arch import ModelArch
from treadle.model.clip import CLIPVisionTower, Projector
from treadle.model.llama import LlamaForCausalLM, Stage

VISION_MODULES = ("vision_tower.", "multi_modal_projector.")

# Checkpoint prefixes -> ours: llava-hf's layout (`language_model.model.*`,
# `vision_tower.vision_model.*`) and transformers 5's (`model.language_model.*`, ...).
_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


class LlavaForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, arch: ModelArch, max_positions: int, stage: Stage | None = None) -> None:
        super().__init__(arch, max_positions, stage)
        if arch.vision is None:
            raise ValueError("a LLaVA model needs its vision tower's shape (ModelArch.vision)")
        self.vision = arch.vision
        # Only the first pipeline stage embeds, so only it holds the tower (`-pp`).
        self.vision_tower: CLIPVisionTower | None = None
        self.multi_modal_projector: Projector | None = None
        if self.stage.first:
            self.vision_tower = CLIPVisionTower(arch.vision)
            self.multi_modal_projector = Projector(arch.vision, arch.hidden_size)

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[images, 3, S, S] pixels -> [images, num_image_tokens, hidden] input embeddings."""
        if self.vision_tower is None or self.multi_modal_projector is None:
            raise RuntimeError("images are encoded on the first pipeline stage")
        features = self.vision_tower(pixels)
        if self.vision.select_strategy == "default":
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def checkpoint_name(self, name: str) -> str | None:
        """Our name for a checkpoint tensor; None for one LLaVA does not read (CLIP's layers
        past the feature layer, its final norm)."""
        for theirs, ours in _PREFIXES:
            if name.startswith(theirs):
                name = ours + name[len(theirs) :]
                break
        if name.startswith("vision_tower."):
            name = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
            if name.startswith("vision_tower.post_layernorm."):
                return None
            parts = name.split(".")
            if parts[1:3] == ["encoder", "layers"] and int(parts[3]) >= self.vision.layers_needed:
                return None
        return name

    def wants(self, name: str) -> bool:
        ours = self.checkpoint_name(name)
        if ours is None:
            return False
        return self.stage.first if ours.startswith(VISION_MODULES) else super().wants(ours)

    def own_parameters(self) -> dict[str, nn.Parameter]:
        return {
            n: p for n, p in super().own_parameters().items() if not n.startswith(VISION_MODULES)
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The language model's tensors through its loaders; the vision tower's and the
        projector's copied whole (they are replicated on every rank)."""
        vision = {n: p for n, p in self.named_parameters() if n.startswith(VISION_MODULES)}
        loaded: set[str] = set()

        def language() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                ours = self.checkpoint_name(name)
                if ours is None:
                    continue
                if not ours.startswith(VISION_MODULES):
                    yield ours, tensor
                    continue
                if not self.stage.first:
                    continue  # a later pipeline stage holds no tower
                param = vision.get(ours)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in LLaVA")
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(param.shape)}"
                    )
                with torch.no_grad():
                    param.copy_(tensor)
                loaded.add(ours)

        super().load_weights(language())
        missing = set(vision) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def model_class(arch: ModelArch) -> type[LlamaForCausalLM]:
    """The model that runs `arch`: LLaVA for a vision-language checkpoint, else the decoder."""
    return LlavaForConditionalGeneration if arch.vision is not None else LlamaForCausalLM
