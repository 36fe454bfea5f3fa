"""Fixtures of the ipc tests: a private socket directory, leak checks, child clean-up."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

IPC_TEST_DIR = str(Path(__file__).parent)
if IPC_TEST_DIR not in sys.path:
    sys.path.insert(0, IPC_TEST_DIR)  # so spawned children can import ipc_children

SHM_DIR = Path("/dev/shm")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every ipc test compares /dev/shm before and after (`rpc_dir`): it runs alone (`serial`),
    never beside tests that make segments of their own."""
    for item in items:
        if item.path.is_relative_to(IPC_TEST_DIR):
            item.add_marker(pytest.mark.serial)


def _treadle_segments() -> set[str]:
    if not SHM_DIR.is_dir():
        return set()
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith("treadle_")}


@pytest.fixture(autouse=True)
def rpc_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test gets its own TREADLE_RPC_BASE_PATH; afterwards it and /dev/shm must hold
    nothing the test made (no ipc socket file, no shared-memory segment)."""
    path = Path(tempfile.mkdtemp(prefix="trd-"))
    monkeypatch.setenv("TREADLE_RPC_BASE_PATH", str(path))
    before = _treadle_segments()
    try:
        yield path
        leftovers = sorted(p.name for p in path.iterdir())
        segments = sorted(_treadle_segments() - before)
        assert not leftovers, f"ipc socket files left behind: {leftovers}"
        assert not segments, f"shared-memory segments left behind: {segments}"
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def strays() -> Iterator[list[psutil.Process]]:
    """Processes a test starts outside `ChildProcess` handles (e.g. grandchildren): SIGKILLed
    at the end if still alive (psutil checks the pid was not reused meanwhile)."""
    procs: list[psutil.Process] = []
    yield procs
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=5)
