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
