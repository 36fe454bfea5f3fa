"""A model's shape read from its files without torch: config.json, or the GGUF header.

The API server and the engine core read it (issue 41: no torch there); `loader.read_arch` is
this function (and `ModelLoadError` this module's). torch is imported only for
`--hf-overrides` (their RoPE check)."""

from __future__ import annotations

from treadle.config import ModelSource
from treadle.model.arch import ModelArch
from treadle.model.gguf_file import GGUFFile, GGUFFormatError


class ModelLoadError(RuntimeError):
    """The weights could not be read; the message names the file and the cause."""


def read_arch(source: ModelSource) -> ModelArch:
    """The model's shape from config.json or the GGUF header, with `source.hf_overrides`."""
    if source.is_gguf:
        try:
            gguf = GGUFFile(source.path)
        except (OSError, GGUFFormatError) as e:
            raise ModelLoadError(
                f"{source.path} is not a readable GGUF file (truncated or corrupt?): {e}"
            ) from e
        arch = ModelArch.from_gguf_fields(gguf.fields, {t.name for t in gguf.tensors})
    else:
        arch = ModelArch.from_hf_dir(source.path)
    if not source.hf_overrides:
        return arch
    from treadle.model.hf_overrides import apply_hf_overrides

    return apply_hf_overrides(arch, source.hf_overrides)
