"""Tokenizers from local files only: a Hugging Face directory, or a GGUF file's vocabulary
(converted once by transformers, then cached on disk because conversion takes seconds).

A directory whose `tokenizer_config.json` names transformers' `TokenizersBackend` (what
transformers 5 saves, the GGUF cache included) is loaded by that class directly: `AutoTokenizer`
imports transformers' model configurations, and with them torch, which the API server does
without (issue 41 item 2). Any other directory goes through `AutoTokenizer`."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Any

from treadle import envs
from treadle.config import ModelConfig, ModelSource, resolve_model
from treadle.logger import init_logger

logger = init_logger(__name__)


def _cache_dir(source: ModelSource) -> str:
    stat = os.stat(source.path)
    key = hashlib.sha256(f"{source.path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return os.path.join(envs.cache_dir(), "tokenizers", key[:16])


LEAN_CLASSES = ("TokenizersBackend",)
"""`tokenizer_class` values loaded without `AutoTokenizer` (and so without torch)."""


def _lean_class(directory: str) -> Any:
    """transformers' class for `directory` when its tokenizer_config.json names one of
    `LEAN_CLASSES` (and no custom code), else None."""
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("tokenizer_class") not in LEAN_CLASSES:
        return None
    if "auto_map" in config:
        return None
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend


def _from_directory(directory: str) -> Any:
    cls = _lean_class(directory)
    if cls is not None:
        return cls.from_pretrained(directory, local_files_only=True)
    from transformers import AutoTokenizer  # (imports torch)

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def load_tokenizer(source: ModelSource) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not source.is_gguf:
        return _from_directory(source.path)
    cache = _cache_dir(source)
    if not _is_cached(cache):
        _convert_in_child(source, cache)
    if _is_cached(cache):
        return _from_directory(cache)
    return _convert(source, cache)  # here (imports torch): the child could not cache it


def _is_cached(cache: str) -> bool:
    return os.path.isfile(os.path.join(cache, "tokenizer_config.json"))


_CONVERT = (
    "import sys; from treadle.config import resolve_model; from treadle.tokenizer import "
    "_convert; _convert(resolve_model(sys.argv[1]), sys.argv[2])"
)


def _convert_in_child(source: ModelSource, cache: str) -> None:
    """Convert the GGUF vocabulary in a child interpreter, which caches it: transformers'
    conversion imports torch, which the API server does without (issue 41 item 2)."""
    logger.info("Converting the GGUF tokenizer (once; cached in %s)", cache)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CONVERT, source.path, cache],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("Could not convert the GGUF tokenizer in a child process: %s", e)
        return
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        logger.warning("Converting the GGUF tokenizer in a child process failed: %s", tail[0])


def _convert(source: ModelSource, cache: str) -> Any:
    """The GGUF file's tokenizer, by transformers (imports torch), saved in `cache`."""
    from transformers import AutoTokenizer

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
