"""Tokenizers from local files only: a Hugging Face directory, or a GGUF file's vocabulary
(converted once by transformers, then cached on disk because conversion takes seconds)."""

from __future__ import annotations

import hashlib
import os
from typing import Any

from treadle import envs
from treadle.config import ModelConfig, ModelSource, resolve_model
from treadle.logger import init_logger

logger = init_logger(__name__)


def _cache_dir(source: ModelSource) -> str:
    stat = os.stat(source.path)
    key = hashlib.sha256(f"{source.path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return os.path.join(envs.cache_dir(), "tokenizers", key[:16])


def load_tokenizer(source: ModelSource) -> Any:
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not source.is_gguf:
        return AutoTokenizer.from_pretrained(source.path, local_files_only=True)
    cache = _cache_dir(source)
    if os.path.isfile(os.path.join(cache, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cache, local_files_only=True)
    logger.info("Converting the GGUF tokenizer (once; cached in %s)", cache)
    tokenizer = AutoTokenizer.from_pretrained(
        source.directory, gguf_file=source.gguf_file, local_files_only=True
    )
    try:
        tmp = f"{cache}.tmp{os.getpid()}"
        tokenizer.save_pretrained(tmp)
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        os.replace(tmp, cache)
    except OSError as e:  # a read-only home is fine, just slower next time
        logger.warning("Could not cache the tokenizer in %s: %s", cache, e)
    return tokenizer


def load_model_tokenizer(model: ModelConfig) -> Any:
    """The tokenizer of `model`: its `--tokenizer` (a local directory or .gguf file) when
    given, else the model's own."""
    return load_tokenizer(resolve_model(model.tokenizer or model.model))
