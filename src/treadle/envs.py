"""Every TREADLE_* environment variable, read in one place, with its default."""

from __future__ import annotations

import ipaddress
import math
import os
import tempfile
from pathlib import Path


def _int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def _bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


# Read lazily (functions, not constants) so tests and the CLI can set them before use.
def rpc_base_path() -> str:
    return os.environ.get("TREADLE_RPC_BASE_PATH") or tempfile.gettempdir()


def msgpack_zero_copy_threshold() -> int:
    return _int("TREADLE_MSGPACK_ZERO_COPY_THRESHOLD", 256)


def tensor_ipc_shm_threshold() -> int:
    """With --tensor-ipc shm: the smallest tensor (bytes) that goes through the tensor ring."""
    return _int("TREADLE_TENSOR_IPC_SHM_THRESHOLD", 64 << 10)


def tensor_ipc_shm_mb() -> int:
    """With --tensor-ipc shm: the size of each front end's tensor ring in /dev/shm (MiB)."""
    return _int("TREADLE_TENSOR_IPC_SHM_MB", 32)


def allow_insecure_serialization() -> bool:
    return _bool("TREADLE_ALLOW_INSECURE_SERIALIZATION", False)


def zmq_max_msg_bytes() -> int:
    """Largest message part a treadle socket accepts from another process (ZMQ_MAXMSGSIZE; a
    peer that sends more is disconnected); senders refuse to send more. Default 64 MiB."""
    return _int("TREADLE_ZMQ_MAX_MSG_BYTES", 64 << 20)


def mq_max_chunk_bytes() -> int:
    """Chunk size of the executor's broadcast queue, from MiB (fractions allowed, for tests)."""
    value = os.environ.get("TREADLE_MQ_MAX_CHUNK_BYTES_MB")
    return int(float(value if value not in (None, "") else 16) * (1 << 20))


def test_slow_start_s() -> float:
    """Test-only hook, off unless set: an engine core sleeps this many seconds in its
    "loading weights" phase, so that a test can watch a start-up (`/health/startup`)."""
    value = os.environ.get("TREADLE_TEST_SLOW_START_S")
    return float(value) if value else 0.0


def test_crash_on_token() -> int | None:
    """Test-only fault hook, off unless set: an engine core that schedules a request whose
    prompt holds this token id crashes (SIGSEGV), as a kernel bug would (the engine restart
    tests' poison request)."""
    value = os.environ.get("TREADLE_TEST_CRASH_ON_TOKEN")
    return None if value in (None, "") else int(value)


def test_raise_on_token() -> int | None:
    """Test-only fault hook, off unless set: an engine core that schedules a request whose
    prompt holds this token id raises a RuntimeError in its step, as a bug would (the death
    report tests)."""
    value = os.environ.get("TREADLE_TEST_RAISE_ON_TOKEN")
    return None if value in (None, "") else int(value)


def test_fail_restart_rank() -> int | None:
    """Test-only fault hook, off unless set: a restarted engine core of this DP rank (a launch
    after its first) fails its start-up, as a lost GPU would (the tests of an engine whose
    restart fails)."""
    value = os.environ.get("TREADLE_TEST_FAIL_RESTART_RANK")
    return None if value in (None, "") else int(value)


def worker_multiproc_method() -> str | None:
    return os.environ.get("TREADLE_WORKER_MULTIPROC_METHOD") or None


def engine_ready_timeout_s() -> int:
    return _int("TREADLE_ENGINE_READY_TIMEOUT_S", 600)


def scale_join_timeout_s() -> int:
    """How long `POST /scale` waits for the HELLO of another host's engine for a new rank."""
    return _int("TREADLE_SCALE_JOIN_TIMEOUT_S", 300)


def execute_model_timeout_seconds() -> int:
    return _int("TREADLE_EXECUTE_MODEL_TIMEOUT_SECONDS", 300)


def ray_placement_timeout_s() -> float:
    """--distributed-executor-backend ray: how long the workers' placement group may wait for
    room on the cluster before start-up fails (naming `ray status`)."""
    return float(os.environ.get("TREADLE_RAY_PLACEMENT_TIMEOUT_S") or 60)


def pp_layer_partition() -> str | None:
    """vLLM's VLLM_PP_LAYER_PARTITION: decoder layers per pipeline stage, e.g. "10,10,10"."""
    return os.environ.get("TREADLE_PP_LAYER_PARTITION") or None


def server_dev_mode() -> bool:
    """vLLM's VLLM_SERVER_DEV_MODE: development routes (`POST /reset_prefix_cache`)."""
    return _bool("TREADLE_SERVER_DEV_MODE", False)


def enable_multiprocessing() -> bool:
    return _bool("TREADLE_ENABLE_MULTIPROCESSING", True)


def logging_level() -> str:
    return os.environ.get("TREADLE_LOGGING_LEVEL", "INFO").upper()


def ringbuffer_warning_interval() -> float:
    """Seconds between the warnings of a writer that finds no free chunk."""
    value = os.environ.get("TREADLE_RINGBUFFER_WARNING_INTERVAL")
    return 60.0 if value in (None, "") else float(value)


def cpu_kernels() -> bool:
    """Compile and use treadle's C attention kernel on the CPU (needs a C compiler)."""
    return _bool("TREADLE_CPU_KERNELS", True)


def lean_runner() -> bool:
    """Run a model the lean runner reads (a Q4/Q8 GGUF Llama on the CPU, one rank) without
    PyTorch in the engine core (`worker/lean_worker.py`); off: always the torch runner."""
    return _bool("TREADLE_LEAN_RUNNER", True)


def packed_gguf_weights() -> bool:
    """Keep oneDNN's packed float32 copy of each GGUF-block weight, for products of more rows
    than the blocks' crossover (prefill, large decode batches): 4 bytes a weight more (~520 MB
    for the default model) for a prefill a few percent faster (`linear_method.py`); off: the
    blocks, expanded into a scratch buffer for many rows."""
    return _bool("TREADLE_PACKED_GGUF_WEIGHTS", False)


def cpu_isa() -> str | None:
    """Force the CPU kernels' ISA level (avx512vnni, avx512, avx2vnni, avx2, portable); unset:
    the CPU's best."""
    value = os.environ.get("TREADLE_CPU_ISA", "").strip().lower()
    return value or None


def usable_cpus(root: str = "/") -> int:
    """CPUs this process may use: its affinity set, capped by its cgroup's CPU quota
    (cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), rounded up."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = _cgroup_cpu_quota(root)
    if quota is not None:
        return max(1, min(count or 1, math.ceil(quota)))
    return count or 1


def _cgroup_cpu_quota(root: str) -> float | None:
    """The cgroup CPU quota in CPUs, or None: none set, or not readable."""
    base = os.path.join(root, "sys", "fs", "cgroup")
    try:
        with open(os.path.join(root, "proc", "self", "cgroup")) as f:
            lines = f.read().splitlines()
        for line in lines:
            _, controllers, path = line.split(":", 2)
            rel = path.lstrip("/")
            if controllers == "":  # v2: "0::/path"
                name = os.path.join(base, rel, "cpu.max")
                if os.path.exists(name):
                    with open(name) as f:
                        limit, period = f.read().split()
                    return None if limit == "max" else int(limit) / int(period)
            elif "cpu" in controllers.split(","):  # v1
                d = os.path.join(base, "cpu", rel)
                if not os.path.exists(d):
                    d = os.path.join(base, "cpu")
                with open(os.path.join(d, "cpu.cfs_quota_us")) as f:
                    limit_us = int(f.read())
                with open(os.path.join(d, "cpu.cfs_period_us")) as f:
                    period_us = int(f.read())
                return None if limit_us <= 0 else limit_us / period_us
    except (OSError, ValueError):
        return None
    return None


def cpu_threads() -> int | None:
    """Threads per engine core (or TP worker) for the model; unset: cores / local engines."""
    value = os.environ.get("TREADLE_CPU_THREADS", "").strip()
    if not value:
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= 6) or int(value) < 1:
        raise ValueError(f"TREADLE_CPU_THREADS={value!r}: give a number of threads, 1 or more")
    return int(value)


def host_ip() -> str | None:
    """TREADLE_HOST_IP (vLLM's VLLM_HOST_IP): this host's address as the other hosts reach it.
    Set, it is the source of every tcp connection treadle makes and the host name that
    /topology shows (two "hosts" on one machine: 127.0.0.1 and 127.0.0.2)."""
    value = os.environ.get("TREADLE_HOST_IP", "").strip()
    if not value:
        return None
    try:
        return str(ipaddress.ip_address(value.strip("[]")))
    except ValueError:
        raise ValueError(
            f"TREADLE_HOST_IP={value!r}: give this host's IP address (e.g. 10.0.0.2)"
        ) from None


def cache_dir() -> Path:
    """Where treadle caches what it builds (kernels, tokenizer files): TREADLE_CACHE_DIR, else
    $XDG_CACHE_HOME/treadle, else ~/.cache/treadle."""
    value = os.environ.get("TREADLE_CACHE_DIR")
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "treadle"


# What TREADLE_CPU_ISA also tells PyTorch's own kernels and oneDNN, so that a process forced to
# a lower level behaves as it would on such a CPU (their own variables win where set).
_ISA_CAPS = {
    "avx2vnni": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "portable": {
        "ATEN_CPU_CAPABILITY": "default",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    },
}


def apply_cpu_isa_caps() -> None:
    """Called when treadle is imported, before PyTorch picks its kernels; children inherit."""
    for name, value in _ISA_CAPS.get(cpu_isa() or "", {}).items():
        os.environ.setdefault(name, value)


def node_heartbeat_timeout_s() -> float:
    """TREADLE_NODE_HEARTBEAT_TIMEOUT_S (10): with --nnodes > 1, a rank on another node whose
    heartbeat (every 0.5 s, through the rendezvous store) stops for this long is a dead worker."""
    value = float(os.environ.get("TREADLE_NODE_HEARTBEAT_TIMEOUT_S", "10"))
    if value <= 0:
        raise ValueError("TREADLE_NODE_HEARTBEAT_TIMEOUT_S must be positive")
    return value


def media_allow_private_addresses() -> bool:
    """TREADLE_MEDIA_ALLOW_PRIVATE_ADDRESSES=1: image URLs of `--allowed-media-domains` may
    resolve to loopback, private and link-local addresses (a test on one machine, a
    deployment inside a private network); off by default (SSRF)."""
    return _bool("TREADLE_MEDIA_ALLOW_PRIVATE_ADDRESSES", False)


def allow_runtime_lora_updating() -> bool:
    """TREADLE_ALLOW_RUNTIME_LORA_UPDATING=1 (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=1):
    the API takes POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""
    return _bool("TREADLE_ALLOW_RUNTIME_LORA_UPDATING", False) or _bool(
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING", False
    )
