"""LoRA adapters on the fused decode path (the default GGUF model's decode steps run whole in
C, `model/fused_decode.py`): each row's adapter update inside the fused call gives the tokens
of the layer-by-layer path, for rows of two adapters and of the base model in one step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from treadle import LLM, LoRARequest, SamplingParams
from treadle.config import resolve_model
from treadle.model.arch import ModelArch
from treadle.model.loader import read_arch
from treadle.model.lora import lora_shapes


def random_adapter(path: Path, arch: ModelArch, rank: int, seed: int) -> Path:
    """A PEFT-format adapter of random A and B on every projection (no peft needed)."""
    path.mkdir()
    torch.manual_seed(seed)
    weights = {}
    for layer in range(arch.num_layers):
        for module, (out, inp) in lora_shapes(arch).items():
            where = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{where}.{module}"
            weights[f"{name}.lora_A.weight"] = 0.05 * torch.randn(rank, inp)
            weights[f"{name}.lora_B.weight"] = 0.05 * torch.randn(out, rank)
    save_file(weights, str(path / "adapter_model.safetensors"))
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(lora_shapes(arch))}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.usefixtures("gguf_block_kernels")  # the fused decode path applies
def test_the_fused_decode_path_adds_each_rows_adapter(
    default_model_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TREADLE_ENABLE_MULTIPROCESSING", "0")
    arch = read_arch(resolve_model(default_model_path))
    adapters = [random_adapter(tmp_path / f"a{i}", arch, 8, i) for i in range(2)]
    llm = LLM(default_model_path, enable_lora=True, max_loras=2, max_model_len=256)
    model = llm.engine_core.executor.worker.runner.model
    assert model.fused is not None, "the default model decodes on the fused path"
    prompts = ["The capital of France is", "Once upon a time", "def fib(n):"]
    requests = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)] + [None]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=requests)]
    fused_decoder, model.fused = model.fused, None  # the layer-by-layer path
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=requests)]
    model.fused = fused_decoder
    assert fused == plain
    # and the adapters change the text (their update is not lost on either path)
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert base[0] != fused[0] and base[1] != fused[1] and base[2] == fused[2]
