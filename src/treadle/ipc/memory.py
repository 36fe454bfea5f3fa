"""What a process holds: its resident set (RSS) and proportional set (PSS: each shared page
split among the processes that map it), read from /proc, and glibc's `malloc_trim`, which hands
the heap's freed pages back to the OS (a start-up's temporaries: tokenizer files, the GGUF
header, imports' garbage; ~30 MiB of the API server's).

The API server logs one line at start-up with its own idle memory beside each engine core's
(`memory_line`), and `benchmarks/memory.py` sums the whole process tree the same way."""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class Memory:
    """One process's memory, bytes (PSS equals RSS where smaps_rollup is not readable)."""

    rss: int
    pss: int


def process_memory(pid: int | None = None) -> Memory | None:
    """RSS and PSS of `pid` (default: this process); None when it is gone or not ours."""
    base = f"/proc/{pid or 'self'}"
    values: dict[str, int] = {}
    try:
        with open(f"{base}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss"):
                    values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    if "Rss" not in values:
        try:
            with open(f"{base}/statm") as f:
                values["Rss"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return None
    return Memory(values["Rss"], values.get("Pss", values["Rss"]))


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


def malloc_trim() -> None:
    """Give the heap's freed pages back to the OS (glibc; nothing elsewhere)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _mib(memory: Memory) -> str:
    return f"{memory.rss / MIB:.0f} MiB RSS ({memory.pss / MIB:.0f} PSS)"


def memory_line(name: str, engines: Sequence[int]) -> str:
    """`"Idle memory: APIServer_0 112 MiB RSS (98 PSS); engine core 0 340 MiB RSS (...)"`:
    this process's and each local engine core's (pid 0 or gone: left out)."""
    own = process_memory()
    parts = [f"{name} {_mib(own)}" if own else f"{name} unknown"]
    for rank, pid in enumerate(engines):
        memory = process_memory(pid) if pid else None
        if memory is not None:
            parts.append(f"engine core {rank} {_mib(memory)}")
    return "Idle memory: " + "; ".join(parts)
