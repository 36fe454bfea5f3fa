"""Building treadle's C kernels (`csrc/`) for one ISA level: the compiler flags of each level,
and the cache of built libraries (`TREADLE_CACHE_DIR/kernels`), keyed by the sources, the
level, the flags and the compiler's version. `cpu_kernels.py` picks the level and binds the
library."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from treadle import envs
from treadle.logger import init_logger

logger = init_logger(__name__)

# Compiler flags per level: the psABI level names (GCC >= 11, Clang >= 12), then the same
# feature set spelled out for older compilers.
LEVEL_CC_FLAGS = {
    "avx512vnni": (["-march=x86-64-v4", "-mavx512vnni"],
                   ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni",
                    "-mavx2", "-mfma", "-mf16c"]),
    "avx512": (["-march=x86-64-v4"], ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl",
                                       "-mavx2", "-mfma", "-mf16c"]),
    "avx2vnni": (["-march=x86-64-v3", "-mavxvnni"], ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"]),
    "avx2": (["-march=x86-64-v3"], ["-mavx2", "-mfma", "-mf16c"]),
    "portable": ([], []),
}  # fmt: skip
# -fno-trapping-math: no code here reads the floating-point exception flags, and without it GCC
# keeps every loop with a comparison in it (the clamps of exp_nonpositive: SiLU, softmax) scalar.
COMMON_CC_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]
CSRC = Path(__file__).parent / "csrc"
SOURCES = ("cpu_kernels.c", "common.h", "avx512.h", "avx2.h", "portable.h", "int8.h", "int8_g16.h")


def compiler() -> tuple[str, str]:
    """(the C compiler command, its version line), for the build and the cache key."""
    cc = os.environ.get("CC", "cc")
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=True)
    return cc, out.stdout.partition("\n")[0]


def kernel_dir() -> Path:
    """The kernel cache, or (where it cannot be written, e.g. a read-only home) a private
    directory for this process, so that the kernels still run, only built again next time."""
    path = envs.cache_dir() / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    fallback = Path(tempfile.mkdtemp(prefix="treadle-kernels-"))
    logger.warning(
        "Cannot write the kernel cache %s; building in %s for this process only "
        "(set TREADLE_CACHE_DIR to a writable directory to keep it)",
        path,
        fallback,
    )
    return fallback


def build(isa: str) -> Path:
    """The library for `isa`, compiled into the cache unless it is there already."""
    cc, version = compiler()
    sources = b"".join((CSRC / name).read_bytes() for name in SOURCES)
    last_error: subprocess.CalledProcessError | None = None
    for flags in LEVEL_CC_FLAGS[isa]:
        key = hashlib.sha256(
            b"\0".join(
                [
                    sources,
                    isa.encode(),
                    " ".join(COMMON_CC_FLAGS + flags).encode(),
                    version.encode(),
                ]
            )
        ).hexdigest()[:16]
        target = kernel_dir() / f"cpu_kernels_{isa}_{key}.so"
        if target.exists():
            return target
        logger.info(
            "Compiling treadle's CPU kernels for %s (%s %s)", isa, cc, " ".join(flags) or "-O3"
        )
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / "kernel.so"
            cmd = [cc, *COMMON_CC_FLAGS, *flags, str(CSRC / "cpu_kernels.c"), "-o", str(built)]
            try:
                subprocess.run(cmd, check=True, capture_output=True, timeout=300)
            except subprocess.CalledProcessError as e:
                last_error = e  # e.g. a compiler without -march=x86-64-v3: try the long form
                continue
            os.replace(built, target)  # atomic: a concurrent process sees all of it or nothing
        return target
    assert last_error is not None
    raise last_error
