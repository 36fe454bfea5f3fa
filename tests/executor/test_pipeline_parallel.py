"""Pipeline parallelism: the layer split, stage workers that hold only their layers, and the
same greedy tokens as one process for -pp 2, -pp 3 (a remainder) and -tp 2 -pp 2."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from treadle import LLM, SamplingParams
from treadle.engine_args import EngineArgs
from treadle.model.arch import ModelArch
from treadle.parallel_config import ParallelConfig, pp_layer_partition, pp_layer_range
from treadle.sampling_params import StructuredOutputsParams
from treadle.worker.start_checks import check_parallel_layout

LAYERS = 5  # -pp 3 leaves a remainder: [2, 2, 1]
PROMPTS = [
    {"prompt_token_ids": [5, 6, 7, 8, 9]},
    {"prompt_token_ids": list(range(100, 140))},
    {"prompt_token_ids": list(range(300, 303))},
    {"prompt_token_ids": list(range(1000, 1070))},
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
# Seeded sampling under a grammar with prompt logprobs: sampled on the last stage only.
SEEDED = SamplingParams(
    temperature=0.8,
    seed=7,
    max_tokens=16,
    prompt_logprobs=1,
    structured_outputs=StructuredOutputsParams(regex="[a-z ]{4,20}"),
)


@pytest.mark.parametrize(
    ("layers", "pp", "parts"),
    [(30, 2, [15, 15]), (5, 3, [2, 2, 1]), (4, 3, [1, 2, 1]), (30, 4, [7, 8, 8, 7]),
     (61, 4, [15, 15, 16, 15]), (7, 1, [7])],
)  # fmt: skip
def test_layers_split_as_vllm_get_pp_indices(layers: int, pp: int, parts: list[int]) -> None:
    assert pp_layer_partition(layers, pp) == parts
    ranges = [pp_layer_range(layers, r, pp) for r in range(pp)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_the_partition_variable_overrides_and_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_PP_LAYER_PARTITION", "1,3,1")
    assert pp_layer_partition(5, 3) == [1, 3, 1]
    assert pp_layer_range(5, 1, 3) == (1, 4)
    for text, says in [
        ("2,3", "has 2 stages, but --pipeline-parallel-size is 3"),
        ("1,1,1", "sums to 3, but the model has 5 layers"),
        ("0,4,1", "every stage needs at least 1 layer"),
        ("2,x,1", "not a comma-separated list"),
    ]:
        monkeypatch.setenv("TREADLE_PP_LAYER_PARTITION", text)
        with pytest.raises(ValueError, match=says):
            pp_layer_partition(5, 3)
    # The form is checked with the other flags, before the model is read.
    monkeypatch.setenv("TREADLE_PP_LAYER_PARTITION", "2,3")
    with pytest.raises(ValueError, match="has 2 stages"):
        ParallelConfig(pipeline_parallel_size=3).check()


def test_impossible_layouts_are_refused_before_any_process(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    arch = ModelArch.from_hf_dir(str(tiny_model_factory("llama")))  # 2 layers
    with pytest.raises(ValueError, match="would leave a stage without one"):
        check_parallel_layout(arch, 1, 3)
    with pytest.raises(ValueError, match="--pipeline-parallel-size must be at least 1"):
        ParallelConfig(pipeline_parallel_size=0).check()
    args = EngineArgs(
        model=str(tiny_model_factory("llama")),
        pipeline_parallel_size=2,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
    )
    with pytest.raises(ValueError, match="--speculative-config does not work with"):
        args.create_engine_config()


@pytest.fixture(scope="module")
def model5(tmp_path_factory: pytest.TempPathFactory, tiny_model_builder) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_builder(tmp_path_factory.mktemp("tiny5"), "llama", num_hidden_layers=LAYERS)


def _run(model: Path, **kwargs: int) -> tuple[list, list[int], list[str]]:  # type: ignore[type-arg]
    """(outputs of both parameter sets, each rank's weight bytes, worker titles)."""
    llm = LLM(str(model), dtype="float32", **kwargs)  # type: ignore[arg-type]
    try:
        titles = sorted(
            t
            for p in psutil.Process().children(recursive=True)
            if (t := (p.cmdline() or [""])[0].strip()).startswith("treadle::Worker")
        )
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        outs += llm.generate(PROMPTS, SEEDED, use_tqdm=False)
        return outs, llm.collective_rpc("weight_bytes"), titles
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def reference(model5: Path) -> tuple[list, int]:  # type: ignore[type-arg]
    outs, weights, _ = _run(model5)
    return outs, weights[0]


def _same(ours: list, ref: list) -> None:  # type: ignore[type-arg]
    for a, b in zip(ours, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            assert x.keys() == y.keys()
            assert max(abs(x[k].logprob - y[k].logprob) for k in x) < 1e-4
        for x, y in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True):
            assert (x is None) == (y is None)
            if x is not None and y is not None:
                assert max(abs(x[k].logprob - y[k].logprob) for k in x) < 1e-4


@pytest.mark.parametrize(
    ("tp", "pp", "extra"),
    [(1, 2, {}), (1, 3, {"max_num_batched_tokens": 16}), (2, 2, {})],
    ids=["pp2", "pp3-chunked-prefill", "tp2-pp2"],
)
def test_pipeline_stages_give_one_process_tokens(model5: Path, reference, tp, pp, extra) -> None:  # type: ignore[no-untyped-def]
    ref_outs, whole = reference
    outs, weights, titles = _run(
        model5, tensor_parallel_size=tp, pipeline_parallel_size=pp, **extra
    )
    assert titles == [f"treadle::Worker_PP{p}_TP{t}" for p in range(pp) for t in range(tp)]
    _same(outs, ref_outs)
    if tp == 1:
        # Each stage holds its own layers only: the tiny model's weights are mostly the
        # embedding (first stage) and the LM head (last stage), half each.
        assert abs(sum(weights) - whole) < 0.02 * whole
        if pp == 2:
            assert all(0.4 * whole < w < 0.6 * whole for w in weights), (weights, whole)
        else:  # the middle stage holds two small layers
            assert weights[1] < 0.05 * whole, (weights, whole)


@pytest.mark.slow
def test_default_model_pp2_and_pp3_give_one_process_tokens() -> None:
    """The acceptance check on SmolLM2 (30 layers, Q4_1 GGUF, tied embedding): greedy fp32
    tokens of -pp 2 and -pp 3 equal one process's; each -pp 2 stage holds its 15 layers and
    the tied table (the first to embed, the last as LM head; Q8_0, ~30 of the 101 MB): 67 MB
    each, measured."""
    prompts = [
        {"prompt_token_ids": [(13 * i + j) % 30000 + 100 for j in range(24)]} for i in range(6)
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for pp in (1, 2, 3):
        llm = LLM(None, dtype="float32", pipeline_parallel_size=pp)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[pp] = (
                [o.outputs[0].token_ids for o in outs],
                llm.collective_rpc("weight_bytes"),
            )
        finally:
            llm.shutdown()
    assert results[2][0] == results[1][0]
    assert results[3][0] == results[1][0]
    whole, halves = results[1][1][0], results[2][1]
    assert all(w < 0.7 * whole for w in halves), (halves, whole)
    assert abs(halves[0] - halves[1]) < 0.02 * whole, (halves, whole)
