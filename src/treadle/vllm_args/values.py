"""vLLM's JSON-valued arguments, read and checked at the edge (the CLI and `LLM(**kwargs)`):
`--limit-mm-per-prompt`, `--hf-overrides` and `--override-generation-config`. Each becomes a
plain value of the config; `ValueError` with one line that says what to change."""

from __future__ import annotations

import json
from typing import Any

from treadle.config import ModelConfig
from treadle.sampling_params import GENERATION_CONFIG_KEYS, SamplingParams

MM_TENSOR_IPC = {"direct_rpc": "direct", "torch_shm": "shm"}
"""vLLM's `--mm-tensor-ipc` values -> ours (`--tensor-ipc`)."""

HF_OVERRIDE_KEYS = (
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "rms_norm_eps",
)
"""The config keys `--hf-overrides` may set: those of the model's config that treadle reads and
that the weights do not fix (the shapes are the weights'; `eos_token_id` comes from the
tokenizer). A LLaVA model's decoder takes them under `text_config`, as in vLLM."""
ROPE_TYPES = ("default", "linear", "llama3")


def parse_mm_limit(text: object) -> int:
    """`--limit-mm-per-prompt`: vLLM's JSON `{"image": N}` (no other modality), or N."""
    if isinstance(text, int) and not isinstance(text, bool):
        value: object = text
    else:
        raw = str(text).strip()
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            raise ValueError(f'--limit-mm-per-prompt {raw!r}: give {{"image": N}} or N') from None
        if isinstance(value, dict):
            other = sorted(set(value) - {"image"})
            if other:
                raise ValueError(
                    f"--limit-mm-per-prompt: treadle takes images only, not {', '.join(other)}"
                )
            value = value.get("image", ModelConfig.limit_mm_per_prompt)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"--limit-mm-per-prompt: the image count must be 0 or more, not {value!r}")
    return value


def json_object(flag: str, value: object) -> dict[str, Any]:
    """A JSON object given as text (the CLI) or as a dict (`LLM(...)`); None is empty."""
    if value is None:
        return {}
    if callable(value):
        raise ValueError(
            f"{flag}: a function cannot reach the engine's processes here; give a dict"
        )
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} {value!r:.80} is not JSON ({e.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, not {type(value).__name__}")
    return value


def parse_hf_overrides(value: object) -> str:
    """`--hf-overrides`: the checked keys as canonical JSON ('' for none). Which keys apply
    to which model (`text_config` for LLaVA) is checked where the config is read
    (`model/hf_overrides.py`)."""
    overrides = json_object("--hf-overrides", value)
    for key, v in overrides.items():
        if key == "text_config":
            if not isinstance(v, dict):
                raise ValueError("--hf-overrides: text_config must be an object")
            for inner, w in v.items():
                _check_hf_value(f"text_config.{inner}", inner, w)
        else:
            _check_hf_value(key, key, v)
    return json.dumps(overrides, sort_keys=True) if overrides else ""


def _check_hf_value(shown: str, key: str, value: object) -> None:
    if key not in HF_OVERRIDE_KEYS:
        raise ValueError(
            f"--hf-overrides: {shown!r} cannot apply here: treadle reads "
            f"{', '.join(HF_OVERRIDE_KEYS)} from a model's config (the shapes are the weights')"
        )
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if key == "max_position_embeddings":
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"--hf-overrides: {shown} must be a positive integer")
    elif key in ("rope_theta", "rms_norm_eps"):
        if not number or not value > 0:  # type: ignore[operator]
            raise ValueError(f"--hf-overrides: {shown} must be a positive number")
    elif value is not None or key == "rope_parameters":
        if not isinstance(value, dict):
            raise ValueError(f"--hf-overrides: {shown} must be an object")
        kind = value.get("rope_type") or value.get("type") or "default"
        if kind not in ROPE_TYPES:
            raise ValueError(
                f"--hf-overrides: {shown} rope type {kind!r}: treadle runs {', '.join(ROPE_TYPES)}"
            )


def parse_generation_overrides(value: object) -> str:
    """`--override-generation-config`: default sampling parameters over the model's
    generation_config.json (vLLM's keys; null drops the file's value), as canonical JSON."""
    overrides = json_object("--override-generation-config", value)
    known = (*GENERATION_CONFIG_KEYS, "max_new_tokens")
    for key in overrides:
        if key == "max_new_tokens":
            raise ValueError(
                "--override-generation-config: max_new_tokens cannot be honoured: treadle takes "
                "no default max_tokens from a generation config (give max_tokens per request)"
            )
        if key not in known:
            raise ValueError(
                f"--override-generation-config: {key!r} is not a default sampling parameter "
                f"(give {', '.join(GENERATION_CONFIG_KEYS)})"
            )
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        SamplingParams(**given)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--override-generation-config: {e}") from None
    return json.dumps(overrides, sort_keys=True) if overrides else ""
