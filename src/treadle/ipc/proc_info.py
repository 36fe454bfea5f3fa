"""What psutil says about treadle's processes on this host (`GET /topology`): titles, roles,
ranks, memory and CPU. Both the engine core (itself, its workers) and the API server (the
front-end processes) use it.

CPU% is measured between two looks at the same process from the same process (psutil keeps
the previous CPU times in its `Process` object, cached here): the first look says 0.
"""

from __future__ import annotations

import re
import socket

import psutil

from treadle import envs
from treadle.wire.topology import ProcessInfo

TITLE_PREFIX = "treadle::"

_ROLES = (
    ("APIServerSupervisor", re.compile(r"APIServerSupervisor$")),
    ("APIServer", re.compile(r"APIServer_(?P<api_server>\d+)$")),
    ("EngineCore", re.compile(r"EngineCore_DP(?P<dp_rank>\d+)$")),
    ("Worker", re.compile(r"Worker_(?:PP(?P<pp_rank>\d+)_)?TP(?P<tp_rank>\d+)$")),
    ("DPCoordinator", re.compile(r"DPCoordinator$")),
    ("Headless", re.compile(r"Headless$")),
)

# pid -> Process (psutil compares CPU times with the previous call on the same object).
_seen: dict[int, psutil.Process] = {}


def host_name() -> str:
    """This host's name in /topology: TREADLE_HOST_IP when set (two "hosts" of one machine
    differ only by it), else the host name."""
    return envs.host_ip() or socket.gethostname()


def parse_title(title: str) -> tuple[str, dict[str, int]]:
    """`"EngineCore_DP1"` -> `("EngineCore", {"dp_rank": 1})`; an unknown title is its own
    role."""
    title = title.removeprefix(TITLE_PREFIX)
    for role, pattern in _ROLES:
        m = pattern.match(title)
        if m:
            return role, {k: int(v) for k, v in m.groupdict().items() if v is not None}
    return title, {}


def title_of(proc: psutil.Process) -> str | None:
    """The treadle title (without the prefix) of a process, or None if it has none."""
    try:
        cmdline = proc.cmdline()
    except (psutil.Error, OSError):
        return None
    if not cmdline or not cmdline[0].startswith(TITLE_PREFIX):
        return None
    return cmdline[0].strip().removeprefix(TITLE_PREFIX)


def _process(pid: int) -> psutil.Process:
    proc = _seen.get(pid)
    if proc is not None and proc.is_running():  # also checks that the pid was not reused
        return proc
    proc = _seen[pid] = psutil.Process(pid)
    if len(_seen) > 256:  # forget the ones that are gone
        for old in [p for p, q in _seen.items() if not q.is_running()]:
            del _seen[old]
    return proc


def process_info(pid: int, title: str | None = None) -> ProcessInfo | None:
    """The process `pid` on this host, or None if it is gone (or not ours to read)."""
    try:
        proc = _process(pid)
        with proc.oneshot():
            title = title or title_of(proc) or proc.name()
            return ProcessInfo(
                title=title,
                pid=pid,
                host=host_name(),
                ppid=proc.ppid(),
                started=proc.create_time(),
                rss_bytes=proc.memory_info().rss,
                cpu_percent=proc.cpu_percent(None),
                status=proc.status(),
            )
    except (psutil.Error, OSError):
        _seen.pop(pid, None)
        return None


def dead_process(title: str, pid: int | None) -> ProcessInfo:
    """A process of ours that is gone, as /topology shows it."""
    return ProcessInfo(title=title, pid=pid or 0, host=host_name(), status="dead")


def treadle_tree(root: int) -> list[ProcessInfo]:
    """`root` and its descendants that carry a treadle title, `root` first."""
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except (psutil.Error, OSError):
        return []
    infos = []
    for proc in procs:
        title = title_of(proc)
        if title is not None and (info := process_info(proc.pid, title)) is not None:
            infos.append(info)
    return infos


def parent_title(pid: int | None = None) -> tuple[int, str | None]:
    """The parent of `pid` (default: this process) and its treadle title."""
    try:
        parent = psutil.Process(pid).parent()
    except (psutil.Error, OSError):
        return 0, None
    if parent is None:
        return 0, None
    return parent.pid, title_of(parent)
