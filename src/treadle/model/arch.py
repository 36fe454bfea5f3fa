"""`ModelArch`: the shape of a Llama-family model, read from config.json or GGUF metadata."""

from __future__ import annotations

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

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArch:
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or config.get('model_type')!r}; "
                f"treadle runs {sorted(SUPPORTED_ARCHITECTURES)}"
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
