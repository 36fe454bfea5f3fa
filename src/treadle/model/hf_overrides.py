"""`--hf-overrides` applied to a `ModelArch` read from config.json or a GGUF header.

vLLM sets each key on the Hugging Face config (a dict value merges into a nested config such
as LLaVA's `text_config`). treadle builds `ModelArch` from config.json or from GGUF metadata,
so a key applies through the field it maps to, the same for both; the keys are checked at the
edge (`vllm_args.values.HF_OVERRIDE_KEYS`), and here against the model: a LLaVA model's
decoder reads `text_config`, a text model has none."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from treadle.model.arch import ModelArch
from treadle.model.layers import _scale_inv_freq


def apply_hf_overrides(arch: ModelArch, text: str) -> ModelArch:
    """`arch` with the overrides of `text` (canonical JSON, '' for none). Raises `ValueError`
    for a key that cannot apply to this model."""
    if not text:
        return arch
    overrides: dict[str, Any] = json.loads(text)
    nested = overrides.pop("text_config", None)
    if arch.vision is None and nested is not None:
        raise ValueError(
            "--hf-overrides: text_config is a vision-language model's; this model's keys go at "
            "the top level"
        )
    if arch.vision is not None:
        if overrides:
            raise ValueError(
                f"--hf-overrides: {', '.join(sorted(overrides))} at the top level would not reach "
                f"{arch.name}'s decoder (vLLM's neither): put them under text_config"
            )
        overrides = nested or {}
    changes: dict[str, Any] = {}
    if "rope_parameters" in overrides:  # transformers >= 5 spelling, read as `from_hf_config`
        params = overrides["rope_parameters"]
        changes["rope_theta"] = float(params.get("rope_theta", arch.rope_theta))
        if params.get("rope_type", "default") != "default":
            changes["rope_scaling"] = params
    if "rope_theta" in overrides:
        changes["rope_theta"] = float(overrides["rope_theta"])
    if "rope_scaling" in overrides:
        changes["rope_scaling"] = overrides["rope_scaling"]
    if "rms_norm_eps" in overrides:
        changes["rms_norm_eps"] = float(overrides["rms_norm_eps"])
    if "max_position_embeddings" in overrides:
        changes["max_position_embeddings"] = int(overrides["max_position_embeddings"])
    if changes.get("rope_scaling"):
        try:  # the fields its type needs, as the model will read them
            _scale_inv_freq(torch.ones(2), changes["rope_scaling"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"--hf-overrides: rope_scaling lacks or mistypes {e}") from None
    return dataclasses.replace(arch, **changes)
