"""Shared fixtures: tiny random Llama-family checkpoints built on the fly (no hub, no network)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from random_weights import randomize

os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_VOCAB = 49152  # the default model's tokenizer is reused, so the vocab matches it


def _tiny_config(family: str, **overrides: object):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, object] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common, rope_theta=10000.0)
    if family == "qwen2":
        return Qwen2Config(**common, rope_theta=1000000.0)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
    raise ValueError(family)


def build_tiny_model(path: Path, family: str, seed: int = 0, **overrides: object) -> Path:
    """A random model whose every parameter (norms and biases too) differs from its init, so
    a parameter that fails to load shows up as a wrong output. `overrides` change the config
    (e.g. a bigger model for a benchmark)."""
    from transformers import AutoModelForCausalLM

    from treadle.config import resolve_model
    from treadle.tokenizer import load_tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_tiny_config(family, **overrides), dtype=torch.float32)
    randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    load_tokenizer(resolve_model(None)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    built: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family)
        return built[family]

    return make


@pytest.fixture(scope="session")
def tiny_model_builder():  # type: ignore[no-untyped-def]
    """`build_tiny_model` itself, for a test that needs a model of its own (other overrides)."""
    return build_tiny_model


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from treadle.config import default_model_path

    return default_model_path()


@pytest.fixture
def check_request_calls(monkeypatch: pytest.MonkeyPatch) -> list[Sequence[int]]:
    """The prompt of every call to `validation.check_request` in this process from now on
    (wherever it is called from: every loaded module that holds it by name gets the spy), for
    tests that a request is checked once per process (issue 25 item 7)."""
    from treadle import validation

    calls: list[Sequence[int]] = []
    original = validation.check_request

    def spy(prompt_token_ids: Sequence[int], *args: Any, **kwargs: Any) -> None:
        calls.append(prompt_token_ids)
        original(prompt_token_ids, *args, **kwargs)

    for module in list(sys.modules.values()):
        # (its __dict__, not getattr: a module's __getattr__ may import or warn)
        if getattr(module, "__dict__", {}).get("check_request") is original:
            monkeypatch.setattr(module, "check_request", spy)
    return calls


HEAVY_FIRST = [
    "entrypoints/test_data_parallel.py",
    "entrypoints/test_engine_restart.py",
    "model/test_reference.py",
    "executor/test_multiproc_executor.py",
    "executor/test_pipeline_parallel.py",
    "executor/test_ray_executor.py",
    "entrypoints/test_engine_scale.py",
    "entrypoints/test_startup_checks.py",
]
"""The test files that take longest (make test prints its 40 slowest tests), in that order.
`make test` hands whole files to its processes in collection order: a long file handed out
last would leave one process idle while the other finishes it, so these go first."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    first = {name: index for index, name in enumerate(HEAVY_FIRST)}

    def rank(item: pytest.Item) -> int:
        name = item.path.relative_to(tests).as_posix() if item.path.is_relative_to(tests) else ""
        return first.get(name, len(HEAVY_FIRST))

    items.sort(key=rank)  # (stable: each file's tests stay together and in order)
