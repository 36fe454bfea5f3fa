"""`--cpu-activation-dtype int8` end to end on the default model (this CPU's best level): every
GGUF-block linear layer and the fused decode step take int8 activations, and greedy output
stays close to the exact float32 path. int8 is not exact: each linear layer's product moves by
~0.6% (the rounding of the activations), enough to flip greedy choices whose logits are close,
so the figures asserted here are loose (benchmarks/quality.py measures them)."""

from __future__ import annotations

import pytest

from treadle import LLM, SamplingParams
from treadle.model import cpu_kernels, linear_method
from treadle.model.lean_model import LeanModel
from treadle.model.linear_method import GGUFLinear
from treadle.model.quantized import KIND_Q4_G16, KIND_Q8_G16

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None or not linear_method.GGUF_MAX_ROWS.get(cpu_kernels.select_isa(), 0),
    reason="no C kernels here, or a level that never runs on the GGUF blocks",
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "To make a cup of tea, first",
]
NEW_TOKENS = 32
LINEARS = ("qkv", "o", "gate_up", "down")


@pytest.fixture(autouse=True)
def _engine_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_ENABLE_MULTIPROCESSING", "0")


def greedy(activations: str) -> tuple[list[list[int]], LLM]:
    llm = LLM(dtype="float32", cpu_activation_dtype=activations)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = [llm.generate(p, params, use_tqdm=False)[0] for p in PROMPTS]
    return [list(o.outputs[0].token_ids) for o in outs], llm


@pytest.mark.slow
def test_int8_activations_generate_close_to_float32() -> None:
    exact, llm = greedy("float32")
    llm.shutdown()
    int8, llm = greedy("int8")
    model = llm.engine_core.executor.worker.runner.model  # type: ignore[union-attr]
    g16 = (KIND_Q4_G16, KIND_Q8_G16)
    if isinstance(model, LeanModel):  # the default model's runner: every layer in one call
        kinds = [getattr(layer, f"{w}_kind") for layer in model.layers for w in LINEARS]
        assert all(k in g16 for k in [*kinds, model.lm_head.kind])
        assert model.spec.int8_activations == 1
    else:
        methods = [
            m.method for m in model.modules() if isinstance(getattr(m, "method", None), GGUFLinear)
        ]
        assert methods and all(m.kernels.activations == "int8" for m in methods)
        # every layer (LM head included) on its blocks laid out 16 wide, for every row count
        assert all(m.quant.kind in g16 and m.beyond is None for m in methods)
        assert model.fused is not None and model.fused._spec.int8_activations == 1
    llm.shutdown()
    firsts = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), NEW_TOKENS)
        for x, y in zip(exact, int8, strict=True)
    ]
    same = sum(a == b for x, y in zip(exact, int8, strict=True) for a, b in zip(x, y, strict=True))
    # On a Zen 4 the first divergence per prompt ranged from token 1 to none in 32 (e.g.
    # [32, 32, 16, 32, 9, 1] at avx2) while prefill ran float32; with prefill in int8 too, a
    # first token can flip where float32's top two are close ("def fibonacci(n):\n": 198 at
    # -1.420 against 1604 at -1.489 in float32, 1604 by 0.004 in int8: [5, 0, 16, 8, 22, 1]).
    assert sum(f >= 1 for f in firsts) >= len(PROMPTS) - 2, firsts
    assert same >= 0.3 * NEW_TOKENS * len(PROMPTS), (same, firsts)
