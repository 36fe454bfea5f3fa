"""LoRA adapters made with `peft` on a base model directory (random, non-zero A and B), and
PEFT's own merged model as the reference for treadle's outputs."""

from __future__ import annotations

from pathlib import Path

import torch

TARGETS_ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGETS_MLP = ["gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: Path, out: Path, rank: int, targets: list[str], seed: int, rslora: bool = False
) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=targets,
        lora_dropout=0.0,
        use_rslora=rslora,
        init_lora_weights=False,
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.05 * torch.randn_like(param))
    peft_model.save_pretrained(out)
    return out


class MergedReference:
    """transformers' greedy ids of the base model with an adapter merged in (PEFT's
    `merge_and_unload`), or of the base alone."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self._models: dict[str | None, torch.nn.Module] = {}

    def model(self, adapter: Path | None) -> torch.nn.Module:
        key = None if adapter is None else str(adapter)
        if key not in self._models:
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32)
            if adapter is not None:
                model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
            self._models[key] = model.eval()
        return self._models[key]

    def greedy(self, adapter: Path | None, prompt_ids: list[int], max_tokens: int) -> list[int]:
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = self.model(adapter).generate(  # type: ignore[operator]
                ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
            )
        return out[0, ids.shape[1] :].tolist()
