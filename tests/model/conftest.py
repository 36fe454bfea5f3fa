"""Fixtures of the model tests."""

from __future__ import annotations

import pytest

from treadle.model import cpu_kernels, linear_method
from treadle.model.cpu_kernels import Kernels


@pytest.fixture
def gguf_block_kernels() -> Kernels:
    """This process's kernels (`cpu_kernels.load`, what the loader gives a float32 CPU model),
    where they put a GGUF model's linear layers on its blocks: `linear_method.choose` makes a
    layer a `GGUFLinear` only where `GGUF_MAX_ROWS[isa] >= 1`, and `FusedDecoder.build` takes
    the fused decode path only where every layer is one. Elsewhere the test skips, saying
    which level does not and which do."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip(
            "no C kernels (no compiler, or TREADLE_CPU_KERNELS=0): no linear layer on GGUF "
            "blocks, so no fused GGUF decode path"
        )
    if linear_method.GGUF_MAX_ROWS[kernels.isa] < 1:
        levels = [isa for isa in cpu_kernels.ISA_LEVELS if linear_method.GGUF_MAX_ROWS[isa] >= 1]
        pytest.skip(
            f"the {kernels.isa} kernels put no linear layer on their GGUF blocks "
            f"(linear_method.GGUF_MAX_ROWS[{kernels.isa!r}] == 0), so there is no fused GGUF "
            f"decode path; runs at {', '.join(levels)} (TREADLE_CPU_ISA unset on a CPU that "
            "runs one, or set to one)"
        )
    return kernels
