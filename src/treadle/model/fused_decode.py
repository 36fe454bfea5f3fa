"""A decode step's decoder layers as one C call (`decode_layers_f32` in `csrc/cpu_kernels.c`).

In a decode step of a few requests on the CPU, Python's dispatch of ~12 kernel calls per layer
(module calls, tensor views, ctypes argument conversion) costs about as much as the arithmetic:
~4 ms of a ~12 ms single-stream step for the default model's 30 layers. Where every piece of a
layer already runs on treadle's C kernels, the model hands the whole stack to one C function
that calls the same kernels in the same order (so the results are the same bits, float32 or
int8 activations as `Kernels.activations` says), the way
vLLM replays a CUDA graph for decode steps on a GPU.

It applies (`FusedDecoder.build`) when the model runs on the C kernels, at TP 1 (no
all-reduce between the layers), without per-head q/k norms (Qwen3), and every linear layer is
on its GGUF blocks; then steps of decode tokens only, up to the blocks' row limit, take it
(`LlamaForCausalLM.forward`), and everything else (prefill chunks, more rows) the modules.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from treadle.model.attention import AttentionMetadata
from treadle.model.cpu_kernels import Kernels, kv_type
from treadle.model.kernel_lib import INT8_ACTIVATIONS, DecodeLayer, DecodeModel
from treadle.model.linear_method import GGUFLinear
from treadle.model.parallel import tp_size

if TYPE_CHECKING:
    from treadle.model.llama import LlamaForCausalLM


class FusedDecoder:
    def __init__(self, kernels: Kernels, model: LlamaForCausalLM, max_rows: int) -> None:
        self.kernels = kernels
        self.max_rows = max_rows
        self._model = model
        self._layers: ctypes.Array[DecodeLayer] | None = None
        self._bound_to: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._spec = DecodeModel()
        self._lora_bound = False  # the layers' LoRA slots are in the bound pointers

    @classmethod
    def build(cls, kernels: Kernels | None, model: LlamaForCausalLM) -> FusedDecoder | None:
        """The fused path for a loaded model, or None where it does not apply (see above)."""
        if kernels is None or tp_size() != 1 or model.arch.qk_norm:
            return None
        methods = [
            linear.method
            for layer in model.decoder_layers()
            for linear in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        ]
        if not all(isinstance(m, GGUFLinear) for m in methods):
            return None
        for layer in model.decoder_layers():
            if layer.self_attn.o_proj.bias is not None or layer.mlp.down_proj.bias is not None:
                return None
        return cls(kernels, model, min(m.max_rows for m in methods))  # type: ignore[attr-defined]

    def _bind(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> ctypes.Array[DecodeLayer]:
        """The per-layer pointers, made once for a set of KV caches (they live as long)."""
        if self._layers is not None and self._bound_to is kv_caches:
            return self._layers
        m = self._model
        layers = (DecodeLayer * m.num_layers)()
        lora_wtype = 0
        for spec, layer, (k_cache, v_cache) in zip(
            layers, m.decoder_layers(), kv_caches, strict=True
        ):
            attn, mlp = layer.self_attn, layer.mlp
            spec.input_norm = layer.input_layernorm.weight.data_ptr()
            spec.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            for name, linear in (
                ("qkv", attn.qkv_proj),
                ("o", attn.o_proj),
                ("gate_up", mlp.gate_up_proj),
                ("down", mlp.down_proj),
            ):
                method = linear.method
                assert isinstance(method, GGUFLinear)
                setattr(spec, name, method.quant.tiles.data_ptr())
                setattr(spec, f"{name}_kind", method.quant.kind)
                lora = linear.lora  # adapters' slots (`model/lora.py`), if enabled
                if lora is not None and lora.tiled and lora.a.numel():
                    setattr(spec, f"{name}_lora_a", lora.a.data_ptr())
                    setattr(spec, f"{name}_lora_b", lora.b.data_ptr())
                    setattr(spec, f"{name}_lora_ends", lora.ends.data_ptr())
                    setattr(spec, f"{name}_lora_as", lora.a_scale.data_ptr())
                    setattr(spec, f"{name}_lora_bs", lora.b_scale.data_ptr())
                    setattr(spec, f"{name}_lora_rank", lora.rank)
                    setattr(spec, f"{name}_lora_shards", lora.shards)
                    lora_wtype = lora.wtype
                    self._lora_bound = True
            bias = attn.qkv_proj.bias
            spec.qkv_bias = bias.data_ptr() if bias is not None else None
            spec.k_cache, spec.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        arch, first = m.arch, m.decoder_layers()[0]
        k_cache = kv_caches[0][0]
        self._spec = DecodeModel(
            hidden=arch.hidden_size,
            heads=first.self_attn.num_heads,
            kv_heads=first.self_attn.num_kv_heads,
            head_dim=arch.head_dim,
            intermediate=first.mlp.gate_up_proj.local_sizes[0],
            num_layers=m.num_layers,
            num_blocks=k_cache.shape[1],
            block_size=k_cache.shape[2],
            eps=first.input_layernorm.eps,
            scale=first.self_attn.scale,
            final_norm=m.model.norm.weight.data_ptr(),
            int8_activations=INT8_ACTIVATIONS[self.kernels.activations],
            kv_type=kv_type(k_cache),
            lora_wtype=lora_wtype,
        )
        self._layers, self._bound_to = layers, kv_caches
        return layers

    def applies(self, meta: AttentionMetadata) -> bool:
        return not meta.prefills and 0 < meta.num_decodes <= self.max_rows

    def forward(
        self,
        embeddings: torch.Tensor,  # [M, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # [M, 1, head_dim] each
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The final norm's output for the step's M decode tokens, [M, hidden]."""
        layers = self._bind(kv_caches)
        assert meta.decode_block_table is not None and meta.decode_lens is not None
        embeddings = embeddings.contiguous()
        out = torch.empty_like(embeddings)
        cos, sin = cos_sin
        table = meta.decode_block_table
        lora = self._model.lora_batch  # each row's adapter slot, when the step has adapters
        rows = lora.slot_of_row if lora is not None and lora.rows else None
        if rows is not None and rows.shape[0] != embeddings.shape[0]:
            raise ValueError(f"{rows.shape[0]} LoRA rows for {embeddings.shape[0]} tokens")
        if rows is not None and not self._lora_bound:
            raise ValueError("a step with LoRA rows, but no layer's LoRA slots are allocated")
        self._spec.lora_slot = None if rows is None else rows.data_ptr()
        self.kernels.decode_layers(
            ctypes.addressof(self._spec), ctypes.addressof(layers), embeddings.data_ptr(),
            embeddings.shape[0],
            cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(), table.data_ptr(),
            table.stride(0), meta.decode_lens.data_ptr(), meta.decode_max_len, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out
