"""Fixtures for end-to-end tests of `treadle serve`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_helpers import RemoteServer


@pytest.fixture(scope="session")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaVA-1.5 directory (`llava_helpers.py`), built once per test process."""
    from llava_helpers import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="session")
def llava_reference(llava: Path):  # type: ignore[no-untyped-def]
    """transformers' own LLaVA on `llava`: the greedy ids to compare with."""
    from llava_helpers import Reference

    return Reference(llava)


@pytest.fixture(scope="session")
def lora_base(tiny_model_factory) -> Path:  # type: ignore[no-untyped-def]
    """The base model of the LoRA tests: the tiny random Llama."""
    return Path(tiny_model_factory("llama"))


@pytest.fixture(scope="session")
def merged_reference(lora_base: Path):  # type: ignore[no-untyped-def]
    """PEFT's merged models on `lora_base`: the greedy ids to compare with."""
    from lora_helpers import MergedReference

    return MergedReference(lora_base)


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    servers: list[RemoteServer] = []

    def make(args: list[str], env: dict[str, str] | None = None, wait: bool = True) -> RemoteServer:
        workdir = tmp_path / f"server{len(servers)}"
        workdir.mkdir()
        server = RemoteServer(args, workdir, env, wait)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()
