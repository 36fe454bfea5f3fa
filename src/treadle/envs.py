"""Every TREADLE_* environment variable, read in one place, with its default."""

from __future__ import annotations

import os
import tempfile


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


def allow_insecure_serialization() -> bool:
    return _bool("TREADLE_ALLOW_INSECURE_SERIALIZATION", False)


def mq_max_chunk_bytes() -> int:
    """Chunk size of the executor's broadcast queue, from MiB (fractions allowed, for tests)."""
    value = os.environ.get("TREADLE_MQ_MAX_CHUNK_BYTES_MB")
    return int(float(value if value not in (None, "") else 16) * (1 << 20))


def worker_multiproc_method() -> str | None:
    return os.environ.get("TREADLE_WORKER_MULTIPROC_METHOD") or None


def engine_ready_timeout_s() -> int:
    return _int("TREADLE_ENGINE_READY_TIMEOUT_S", 600)


def execute_model_timeout_seconds() -> int:
    return _int("TREADLE_EXECUTE_MODEL_TIMEOUT_SECONDS", 300)


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
