"""Fixtures for end-to-end tests of `treadle serve`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_helpers import RemoteServer


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


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    """`treadle serve` on the default model (SmolLM2-135M), shared by the modules that only
    send it requests: one start-up for all of them."""
    srv = RemoteServer(["--max-model-len", "512"], tmp_path_factory.mktemp("default-server"))
    yield srv
    srv.stop()
