"""LoRA adapters through the offline `LLM` (vLLM's `lora_request=LoRARequest(...)`, issue 40):
adapters made with `peft` on a tiny random Llama give greedy ids identical to PEFT's merged
model, alone and three adapters plus the base in one batch, under --max-loras smaller than
the batch's adapters, with n-gram speculation and under -tp 2; the prefix cache keeps each
adapter's KV apart; every hostile adapter is refused with its reason."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lora_helpers import TARGETS_ATTN, TARGETS_MLP, MergedReference, make_adapter
from treadle import LLM, LoRARequest, SamplingParams
from treadle.validation import InvalidRequest

PROMPTS = ["The capital of France is", "Once upon a time there", "def fib(n):", "1, 2, 3,"]
MAX = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True)


@pytest.fixture(scope="module")
def base(lora_base: Path) -> Path:
    return lora_base


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn8": make_adapter(base, root / "attn8", 8, ["q_proj", "v_proj"], seed=1),
        "all16": make_adapter(base, root / "all16", 16, TARGETS_ATTN + TARGETS_MLP, seed=2),
        "mlp8rs": make_adapter(base, root / "mlp8rs", 8, TARGETS_MLP, seed=3, rslora=True),
    }


@pytest.fixture(scope="module")
def reference(merged_reference: MergedReference) -> MergedReference:
    return merged_reference


@pytest.fixture(scope="module")
def llm(base: Path) -> Iterator[LLM]:
    engine = LLM(str(base), dtype="float32", enable_lora=True, max_loras=4, max_model_len=256)
    yield engine
    engine.shutdown()


def lora(adapters: dict[str, Path], name: str) -> LoRARequest:
    return LoRARequest(name, 1 + sorted(adapters).index(name), str(adapters[name]))


def ids(out) -> list[int]:  # type: ignore[no-untyped-def]
    return list(out.outputs[0].token_ids)


def test_each_adapter_alone_gives_peft_merged_tokens(
    llm: LLM, adapters: dict[str, Path], reference: MergedReference
) -> None:
    for name, path in adapters.items():
        outs = llm.generate(PROMPTS, GREEDY, lora_request=lora(adapters, name))
        for out in outs:
            assert ids(out) == reference.greedy(path, list(out.prompt_token_ids), MAX), name


def test_three_adapters_and_the_base_in_one_batch(
    llm: LLM, adapters: dict[str, Path], reference: MergedReference
) -> None:
    names = [None, "attn8", "all16", "mlp8rs"] * 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    requests = [None if n is None else lora(adapters, n) for n in names]
    outs = llm.generate(prompts, GREEDY, lora_request=requests)
    for out, name in zip(outs, names, strict=True):
        path = None if name is None else adapters[name]
        assert ids(out) == reference.greedy(path, list(out.prompt_token_ids), MAX), name


def test_the_prefix_cache_keeps_each_adapters_kv_apart(llm: LLM, adapters: dict[str, Path]) -> None:
    prompt = "A long shared prefix that fills more than one block of sixteen tokens, twice over."
    llm.generate(prompt, GREEDY, lora_request=lora(adapters, "attn8"))
    [same] = llm.generate(prompt, GREEDY, lora_request=lora(adapters, "attn8"))
    [other] = llm.generate(prompt, GREEDY, lora_request=lora(adapters, "all16"))
    [plain] = llm.generate(prompt, GREEDY)
    assert same.num_cached_tokens >= 16
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0


@pytest.mark.parametrize(
    "layout",
    [
        {"max_loras": 1, "max_cpu_loras": 3},  # one adapter at a time in the steps
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
        {"tensor_parallel_size": 2},  # A and B sharded as the base weights are
    ],
)
def test_adapters_under_other_layouts(
    base: Path, adapters: dict[str, Path], reference: MergedReference, layout: dict[str, object]
) -> None:
    kwargs: dict[str, object] = {"max_loras": 3, **layout}
    engine = LLM(str(base), dtype="float32", enable_lora=True, max_model_len=256, **kwargs)  # type: ignore[arg-type]
    try:
        names = ["attn8", None, "all16", "mlp8rs"]
        requests = [None if n is None else lora(adapters, n) for n in names]
        prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"  # repetitive: n-gram proposals
        outs = engine.generate([prompt] * len(names), GREEDY, lora_request=requests)
    finally:
        engine.shutdown()
    for out, name in zip(outs, names, strict=True):
        path = None if name is None else adapters[name]
        assert ids(out) == reference.greedy(path, list(out.prompt_token_ids), MAX), name


def broken(src: Path, dst: Path, edit: str) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    tensors = dst / "adapter_model.safetensors"
    if edit == "rank":
        config["r"] = 64
    elif edit == "missing":
        tensors.unlink()
    elif edit == "pickle":
        tensors.rename(dst / "adapter_model.bin")
    elif edit == "truncated":
        tensors.write_bytes(tensors.read_bytes()[:100])
    elif edit in ("nan", "shape", "embed"):
        from safetensors.torch import load_file, save_file

        weights = load_file(tensors)
        name = next(iter(weights))
        if edit == "nan":
            weights[name] = torch.full_like(weights[name], float("nan"))
        elif edit == "shape":
            weights[name] = weights[name][:, :7].contiguous()
        else:
            weights["base_model.model.model.embed_tokens.lora_A.weight"] = weights[name].clone()
        save_file(weights, tensors)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        ("rank", "rank"),
        ("missing", "no adapter_model.safetensors"),
        ("pickle", "pickle"),
        ("truncated", "cannot read"),
        ("nan", "not finite"),
        ("shape", "base model takes"),
        ("embed", "treadle takes LoRA weights of"),
    ],
)
def test_hostile_adapters_are_refused_with_their_reason(
    llm: LLM, adapters: dict[str, Path], tmp_path: Path, edit: str, needle: str
) -> None:
    path = broken(adapters["attn8"], tmp_path / edit, edit)
    request = LoRARequest(f"bad-{edit}", 100, str(path))
    with pytest.raises(InvalidRequest, match=needle):
        llm.generate(PROMPTS[0], GREEDY, lora_request=request)
    # nothing else is affected
    assert ids(llm.generate(PROMPTS[0], GREEDY)[0])


def test_adapters_need_enable_lora(base: Path, adapters: dict[str, Path]) -> None:
    engine = LLM(str(base), dtype="float32", max_model_len=64)
    try:
        with pytest.raises(InvalidRequest, match="enable_lora"):
            engine.generate(PROMPTS[0], GREEDY, lora_request=lora(adapters, "attn8"))
    finally:
        engine.shutdown()
