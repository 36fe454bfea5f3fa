"""The Llama-family decoder (Llama, SmolLM, Mistral, Qwen2, Qwen3) over a paged KV cache."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from treadle.model.arch import ModelArch
from treadle.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchAttention,
    select_backend,
)
from treadle.model.cpu_kernels import Kernels
from treadle.model.fused_decode import FusedDecoder
from treadle.model.layers import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary,
)
from treadle.model.parallel import tp_size

# Checkpoint name fragment -> (our parameter name fragment, shard index in a packed matrix).
PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        tp = tp_size()
        self.head_dim = arch.head_dim
        self.num_heads = arch.num_heads // tp
        self.num_kv_heads = max(1, arch.num_kv_heads // tp)
        self.scale = arch.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.qkv_bias
        )
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.kernels: Kernels | None = None
        self.backend: AttentionBackend = TorchAttention()

    def prepare(self, kernels: Kernels | None) -> None:
        """After loading: RoPE and attention on the C kernels or on PyTorch."""
        self.kernels = kernels
        self.backend = select_backend(kernels)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin, self.kernels), apply_rotary(k, cos, sin, self.kernels)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            arch.hidden_size, [arch.intermediate_size, arch.intermediate_size]
        )
        self.down_proj = RowParallelLinear(arch.intermediate_size, arch.hidden_size)
        self.kernels: Kernels | None = None

    def prepare(self, kernels: Kernels | None) -> None:
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None:
            return self.down_proj(self.kernels.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the previous sublayer's output, the residual stream) -> this layer's MLP output
        and the residual stream, which each norm adds the previous output into, in place."""
        if residual is None:  # the first layer: x is the embeddings
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos_sin, kv_cache, meta)
        h = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling
        )


class LlamaForCausalLM(nn.Module):
    """`forward` maps a flat batch of tokens to last hidden states; `compute_logits` maps the
    rows that need sampling to vocabulary logits."""

    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        # This rank's share of the KV cache shape (KV heads replicate when TP > KV heads).
        self.num_kv_heads = max(1, arch.num_kv_heads // tp_size())
        self.head_dim = arch.head_dim
        self.num_layers = arch.num_layers
        self.model = LlamaModel(arch, max_positions)
        self.lm_head = (
            self.model.embed_tokens
            if arch.tie_word_embeddings
            else VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        )
        self.fused: FusedDecoder | None = None
        self.kernels: Kernels | None = None  # the C kernels it runs on (the sampler's too)

    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.model.layers)  # type: ignore[arg-type]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`embeds`: (rows of the batch, their input embeddings in the model's dtype), which
        replace the lookup of those rows' token ids (a prompt given as `prompt_embeds`)."""
        x = self.model.embed_tokens(input_ids)
        if embeds is not None:
            x[embeds[0]] = embeds[1]
        cos_sin = self.model.rotary.cos_sin(positions, x.dtype)
        if self.fused is not None and self.fused.applies(meta):
            return self.fused.forward(x, cos_sin, kv_caches, meta)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos_sin, kv_cache, meta)
        return self.model.norm(x, residual)

    @property
    def attention_backend(self) -> AttentionBackend:
        return self.decoder_layers()[0].self_attn.backend

    def prepare(self, kernels: Kernels | None) -> None:
        """After loading, once every layer has chosen its implementation: the LM head chooses
        how to multiply (the embedding table is only looked up by row, so an untied one
        forgets its GGUF blocks), and decode steps take the fused path where it applies."""
        self.kernels = kernels
        self.lm_head.prepare_lm_head(kernels)
        if self.lm_head is not self.model.embed_tokens:
            self.model.embed_tokens.drop_gguf_blocks()
        self.fused = FusedDecoder.build(kernels, self)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors; each parameter's loader takes its own shard."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            shard = None
            for ckpt, (ours, index) in PACKED.items():
                if f".{ckpt}." in name:
                    name, shard = name.replace(ckpt, ours), index
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {self.arch.architecture}"
                )
            loader = param.weight_loader  # type: ignore[attr-defined]
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(name)
        missing = set(params) - loaded
        if self.arch.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
