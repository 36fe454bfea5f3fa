"""What psutil says about treadle's processes: titles to roles and ranks, and a titled child
found under its parent."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from treadle.ipc.proc_info import parse_title, process_info, treadle_tree


@pytest.mark.parametrize(
    ("title", "role", "ranks"),
    [
        ("treadle::APIServer_3", "APIServer", {"api_server": 3}),
        ("APIServerSupervisor", "APIServerSupervisor", {}),
        ("EngineCore_DP12", "EngineCore", {"dp_rank": 12}),
        ("Worker_TP1", "Worker", {"tp_rank": 1}),
        ("Worker_PP1_TP0", "Worker", {"pp_rank": 1, "tp_rank": 0}),
        ("DPCoordinator", "DPCoordinator", {}),
        ("Headless", "Headless", {}),
        ("Something", "Something", {}),
    ],
)
def test_parse_title(title: str, role: str, ranks: dict[str, int]) -> None:
    assert parse_title(title) == (role, ranks)


def test_process_info_of_this_process_and_of_a_gone_one() -> None:
    info = process_info(os.getpid(), "EngineCore_DP0")
    assert info is not None
    assert (info.title, info.pid, info.ppid) == ("EngineCore_DP0", os.getpid(), os.getppid())
    assert info.rss_bytes > 0 and info.started <= time.time()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_info(child.pid) is None


def test_treadle_tree_finds_a_titled_child() -> None:
    code = (
        "import setproctitle, sys, time; setproctitle.setproctitle('treadle::Worker_TP1');"
        "print('ready', flush=True); time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        mine = [p for p in treadle_tree(os.getpid()) if p.pid == child.pid]
        assert [(p.title, p.ppid) for p in mine] == [("Worker_TP1", os.getpid())]
    finally:
        child.kill()
        child.wait()
