"""CLIP's vision transformer and LLaVA's projector: pixels [images, 3, S, S] -> rows of the
language model's input embeddings [images, tokens, hidden].

Replicated on every tensor-parallel rank (it is small beside the language model: CLIP
ViT-L/14-336 is 0.3 B parameters), so that each rank computes the same rows it writes into
its own share of the step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treadle.model.arch import VisionArch


def activation(name: str) -> nn.Module:
    if name == "quick_gelu":
        return QuickGELU()
    if name == "gelu":
        return nn.GELU()
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return nn.GELU(approximate="tanh")
    if name == "silu":
        return nn.SiLU()
    raise ValueError(f"unsupported activation {name!r}")


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class VisionEmbeddings(nn.Module):
    """Patches (a convolution of stride `patch_size`), a class token before them, and a
    learned position per token."""

    def __init__(self, arch: VisionArch) -> None:
        super().__init__()
        self.patch_size = arch.patch_size
        self.class_embedding = nn.Parameter(torch.empty(arch.hidden_size))
        self.patch_embedding = nn.Conv2d(
            3, arch.hidden_size, arch.patch_size, stride=arch.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(arch.num_patches + 1, arch.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # [images, patches, hidden]
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, arch: VisionArch) -> None:
        super().__init__()
        hidden = arch.hidden_size
        self.num_heads = arch.num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.num_heads, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)  # every token sees every token
        return self.out_proj(out.transpose(1, 2).reshape(b, n, hidden))


class VisionMLP(nn.Module):
    def __init__(self, arch: VisionArch) -> None:
        super().__init__()
        self.fc1 = nn.Linear(arch.hidden_size, arch.intermediate_size)
        self.act = activation(arch.hidden_act)
        self.fc2 = nn.Linear(arch.intermediate_size, arch.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, arch: VisionArch) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)
        self.self_attn = VisionAttention(arch)
        self.layer_norm2 = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)
        self.mlp = VisionMLP(arch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, arch: VisionArch) -> None:
        super().__init__()
        # Only the layers up to the feature layer: the rest would be computed and thrown away.
        self.layers = nn.ModuleList(VisionLayer(arch) for _ in range(arch.layers_needed))


class CLIPVisionTower(nn.Module):
    """Hugging Face's `CLIPVisionTransformer` up to `arch.feature_layer` (its `post_layernorm`
    is not read by LLaVA, so it is neither built nor loaded)."""

    def __init__(self, arch: VisionArch) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(arch)
        self.pre_layrnorm = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)
        self.encoder = VisionEncoder(arch)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.encoder.layers:
            x = layer(x)
        return x


class Projector(nn.Module):
    """LLaVA's two-layer MLP from the vision width to the language model's."""

    def __init__(self, arch: VisionArch, text_hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(arch.hidden_size, text_hidden, bias=arch.projector_bias)
        self.act = activation(arch.projector_act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=arch.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))
