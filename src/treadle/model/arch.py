"""`ModelArch`: the shape of a Llama-family model, read from config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# Vision-language architectures -> their vision tower's kind (`VisionArch`); the language
# model inside is a Llama-family decoder read from the config's `text_config`.
MULTIMODAL_ARCHITECTURES = {"LlavaForConditionalGeneration": "clip"}
# A text config's `model_type` -> the Hugging Face architecture name of that decoder.
TEXT_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# GGUF `general.architecture` -> Hugging Face architecture name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class UnsupportedModelError(ValueError):
    """The checkpoint is not a model treadle can run; the message says what it is instead."""


@dataclass(frozen=True)
class VisionArch:
    """A CLIP vision tower and LLaVA's projector: what `model/llava.py` builds itself from.
    An image of `image_size`^2 pixels becomes `num_image_tokens` rows of the language
    model's input embeddings."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    feature_layer: int
    """The hidden state the projector reads (as an index into CLIP's hidden states: 0 the
    embeddings, i the output of layer i; negative counts from the end)."""
    select_strategy: str  # "default" drops the class token, "full" keeps it
    projector_act: str
    projector_bias: bool
    image_token_id: int

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """Feature rows per image: one per patch, plus the class token with "full"."""
        return self.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def layers_needed(self) -> int:
        """How many encoder layers run: those up to the feature layer (the rest never do)."""
        layer = self.feature_layer
        return layer if layer >= 0 else self.num_layers + 1 + layer

    @classmethod
    def from_llava_config(cls, config: dict[str, Any]) -> VisionArch:
        vision = config.get("vision_config") or {}
        if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise UnsupportedModelError(
                f"unsupported vision tower {vision.get('model_type')!r}: treadle runs LLaVA "
                "with a CLIP vision tower"
            )
        layer = config.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise UnsupportedModelError(
                f"vision_feature_layer {layer!r}: treadle reads one layer's features"
            )
        strategy = config.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise UnsupportedModelError(f"unsupported vision_feature_select_strategy {strategy!r}")
        token = config.get("image_token_id", config.get("image_token_index"))
        if not isinstance(token, int):
            raise UnsupportedModelError("the config names no image token (image_token_id)")
        arch = cls(
            hidden_size=int(vision.get("hidden_size", 1024)),
            intermediate_size=int(vision.get("intermediate_size", 4096)),
            num_layers=int(vision.get("num_hidden_layers", 24)),
            num_heads=int(vision.get("num_attention_heads", 16)),
            image_size=int(vision.get("image_size", 336)),
            patch_size=int(vision.get("patch_size", 14)),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5)),
            hidden_act=str(vision.get("hidden_act", "quick_gelu")),
            feature_layer=layer,
            select_strategy=strategy,
            projector_act=str(config.get("projector_hidden_act", "gelu")),
            projector_bias=bool(config.get("multimodal_projector_bias", True)),
            image_token_id=token,
        )
        if not 0 <= arch.layers_needed <= arch.num_layers:
            raise UnsupportedModelError(f"vision_feature_layer {layer} is out of range")
        return arch


@dataclass(frozen=True)
class ModelArch:
    """What the model code needs to build itself; discovered from the checkpoint, never configured."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # A vision-language model's vision tower (None: a text-only model), and its architecture
    # name (`architecture` is then its language model's).
    vision: VisionArch | None = None
    multimodal_architecture: str | None = None

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def name(self) -> str:
        """The checkpoint's architecture as Hugging Face names it."""
        return self.multimodal_architecture or self.architecture

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArch:
        archs = config.get("architectures") or []
        multimodal = next((a for a in archs if a in MULTIMODAL_ARCHITECTURES), None)
        if multimodal is not None:
            text = dict(config.get("text_config") or {})
            text_arch = TEXT_MODEL_TYPES.get(text.get("model_type", "llama"))
            if text_arch is None:
                raise UnsupportedModelError(
                    f"unsupported language model {text.get('model_type')!r} in {multimodal}; "
                    f"treadle runs {sorted(TEXT_MODEL_TYPES)}"
                )
            text["architectures"] = [text_arch]
            text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
            language = cls.from_hf_config(text)
            return dataclasses.replace(
                language,
                vision=VisionArch.from_llava_config(config),
                multimodal_architecture=multimodal,
            )
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or config.get('model_type')!r}; "
                f"treadle runs {sorted(SUPPORTED_ARCHITECTURES | MULTIMODAL_ARCHITECTURES)}"
            )
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_scaling = config.get("rope_scaling")
        rope_theta = config.get("rope_theta")
        params = config.get("rope_parameters")
        if isinstance(params, dict):  # transformers >= 5 spelling
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        family = SUPPORTED_ARCHITECTURES[arch]
        return cls(
            architecture=arch,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
            qkv_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> ModelArch:
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise UnsupportedModelError(f"{path} has no config.json: not a Hugging Face model dir")
        with open(config_path) as f:
            return cls.from_hf_config(json.load(f))

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any], tensor_names: set[str]) -> ModelArch:
        """Build from GGUF metadata (already decoded to Python values)."""
        gguf_arch = fields.get("general.architecture")
        if gguf_arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {gguf_arch!r}; treadle runs {sorted(GGUF_ARCHITECTURES)}"
            )

        def get(key: str, default: Any = None) -> Any:
            return fields.get(f"{gguf_arch}.{key}", default)

        num_heads = get("attention.head_count")
        hidden = get("embedding_length")
        key_length = get("attention.key_length")
        vocab = get("vocab_size") or len(fields.get("tokenizer.ggml.tokens", []))
        eos = fields.get("tokenizer.ggml.eos_token_id")
        rope_scaling = None
        if get("rope.scaling.type") == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        return cls(
            architecture=GGUF_ARCHITECTURES[gguf_arch],
            vocab_size=int(vocab),
            hidden_size=int(hidden),
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=int(num_heads),
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(key_length or hidden // num_heads),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            rope_scaling=rope_scaling,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )
