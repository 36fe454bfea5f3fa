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
from treadle.model.lora import (
    Adapter,
    LoRABatch,
    LoRALayer,
    column_share,
    lora_shapes,
    row_share,
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


class MissingLayer(nn.Module):
    """A place held for what another pipeline stage runs (vLLM's `PPMissingLayer`): no
    parameters, so checkpoint names keep their indices and this stage loads none of it."""

    def forward(self, *args: object) -> None:
        raise RuntimeError("this pipeline stage does not run this layer")


class Stage:
    """This process's share of the decoder: layers [start, end) of `num_layers`; the first
    stage embeds, the last runs the final norm and the LM head (the whole model is one stage)."""

    def __init__(self, num_layers: int, start: int, end: int) -> None:
        self.start, self.end, self.num_layers = start, end, num_layers
        self.first, self.last = start == 0, end == num_layers

    @property
    def whole(self) -> bool:
        return self.first and self.last


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int, stage: Stage) -> None:
        super().__init__()
        tied_head_here = stage.last and arch.tie_word_embeddings
        self.embed_tokens: nn.Module = (
            VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
            if stage.first or tied_head_here
            else MissingLayer()
        )
        self.layers = nn.ModuleList(
            DecoderLayer(arch) if stage.start <= i < stage.end else MissingLayer()
            for i in range(arch.num_layers)
        )
        # (typed as the last stage's: the fused path, whole models only, reads its weight)
        self.norm: RMSNorm = (
            RMSNorm(arch.hidden_size, arch.rms_norm_eps) if stage.last else MissingLayer()  # type: ignore[assignment]
        )
        self.rotary = RotaryEmbedding(
            arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling
        )


class LlamaForCausalLM(nn.Module):
    """`forward` maps a flat batch of tokens to last hidden states; `compute_logits` maps the
    rows that need sampling to vocabulary logits."""

    def __init__(self, arch: ModelArch, max_positions: int, stage: Stage | None = None) -> None:
        """`stage`: this pipeline stage's layers (default: the whole model)."""
        super().__init__()
        self.arch = arch
        self.stage = stage or Stage(arch.num_layers, 0, arch.num_layers)
        # This rank's share of the KV cache shape (KV heads replicate when TP > KV heads).
        self.num_kv_heads = max(1, arch.num_kv_heads // tp_size())
        self.head_dim = arch.head_dim
        self.num_layers = self.stage.end - self.stage.start  # the layers (and KV) held here
        self.model = LlamaModel(arch, max_positions, self.stage)
        self.lm_head: nn.Module = (
            MissingLayer()
            if not self.stage.last
            else self.model.embed_tokens
            if arch.tie_word_embeddings
            else VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        )
        self.fused: FusedDecoder | None = None
        self.kernels: Kernels | None = None  # the C kernels it runs on (the sampler's too)
        self.lora_batch: LoRABatch | None = None  # with adapters: the step's rows per slot

    def decoder_layers(self) -> list[DecoderLayer]:
        """This stage's decoder layers (all of them without pipeline parallelism)."""
        layers = list(self.model.layers)[self.stage.start : self.stage.end]
        return layers  # type: ignore[return-value]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The final norm's output (the whole model, or the last pipeline stage).
        `embeds`: (rows of the batch, their input embeddings in the model's dtype), which
        replace the lookup of those rows' token ids (a prompt given as `prompt_embeds`);
        `intermediate`: the previous stage's (hidden, residual)."""
        out = self.forward_layers(input_ids, positions, kv_caches, meta, embeds, intermediate)
        if isinstance(out, torch.Tensor):  # the fused path ends with the final norm
            return out
        return self.model.norm(*out)

    def forward_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """This stage's layers: (their last MLP output, the residual stream), which the next
        stage takes as `intermediate`; or, on the fused path (the whole model only), the final
        norm's output."""
        residual: torch.Tensor | None = None
        if self.stage.first:
            x = self.model.embed_tokens(input_ids)
            if embeds is not None:
                x[embeds[0]] = embeds[1]
        else:
            if intermediate is None:
                raise ValueError("a pipeline stage after the first needs the previous one's output")
            x, residual = intermediate
        cos_sin = self.model.rotary.cos_sin(positions, x.dtype)
        if self.fused is not None and self.fused.applies(meta):  # (adapters' updates too)
            return self.fused.forward(x, cos_sin, kv_caches, meta)
        for layer, kv_cache in zip(self.decoder_layers(), kv_caches, strict=True):
            x, residual = layer(x, residual, cos_sin, kv_cache, meta)
        assert residual is not None
        return x, residual

    # -- LoRA adapters (`model/lora.py`) --------------------------------------------------

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """Each module an adapter may target: its full (out, in) in the checkpoint."""
        return lora_shapes(self.arch)

    def enable_lora(self, max_loras: int, max_rank: int) -> LoRABatch:
        """Give every linear layer of this stage a `LoRALayer` of `max_loras` slots of rank
        up to `max_rank`; returns the step's rows per slot, which they all read (the model
        runner sets them around a step)."""
        batch = LoRABatch(max_loras, self.kernels)
        for layer in self.decoder_layers():
            attn, mlp = layer.self_attn, layer.mlp
            # (a weight held as GGUF blocks has no float32 matrix to read sizes from)
            norm = layer.input_layernorm.weight
            dtype, device = norm.dtype, norm.device
            for column in (attn.qkv_proj, mlp.gate_up_proj):
                width = len(column.local_sizes) * max_rank
                out = sum(column.local_sizes)
                column.lora = LoRALayer(batch, width, column.in_features, out, dtype, device)
            for row in (attn.o_proj, mlp.down_proj):
                row.lora = LoRALayer(batch, max_rank, row.local_in, row.out_features, dtype, device)
        self.lora_batch = batch
        return batch

    def set_lora(self, slot: int, adapter: Adapter | None) -> None:
        """Put `adapter` (None: nothing) in `slot` of every target layer of this stage, each
        layer keeping its tensor-parallel share."""
        layers = self.decoder_layers()
        dtype = layers[0].input_layernorm.weight.dtype
        for i, layer in enumerate(layers, start=self.stage.start):
            attn, mlp = layer.self_attn, layer.mlp
            for linear, names in (
                (attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
                (mlp.gate_up_proj, ("gate_proj", "up_proj")),
            ):
                assert linear.lora is not None, "enable_lora first"
                pieces = (
                    []
                    if adapter is None
                    else [
                        (shard, *adapter.weights[(i, name)])
                        for shard, name in enumerate(names)
                        if (i, name) in adapter.weights
                    ]
                )
                linear.lora.set_slot(
                    slot,
                    column_share(
                        pieces, linear.local_sizes, linear.shard_sources(), adapter.scale, dtype
                    )
                    if pieces and adapter is not None
                    else None,
                )
            for row, name in ((attn.o_proj, "o_proj"), (mlp.down_proj, "down_proj")):
                assert row.lora is not None, "enable_lora first"
                share = None
                if adapter is not None and (i, name) in adapter.weights:
                    a, b = adapter.weights[(i, name)]
                    start = row.tp_rank * row.local_in
                    share = row_share(a, b, start, row.local_in, adapter.scale, dtype)
                row.lora.set_slot(slot, share)

    @property
    def attention_backend(self) -> AttentionBackend:
        return self.decoder_layers()[0].self_attn.backend

    def prepare(self, kernels: Kernels | None) -> None:
        """After loading, once every layer has chosen its implementation: the LM head chooses
        how to multiply (the embedding table is only looked up by row, so an untied one
        forgets its GGUF blocks), and decode steps take the fused path where it applies."""
        self.kernels = kernels
        embed, head = self.model.embed_tokens, self.lm_head
        if isinstance(head, VocabParallelEmbedding):
            head.prepare_lm_head(kernels)
        if isinstance(embed, VocabParallelEmbedding) and embed is not head:
            if self.arch.tie_word_embeddings:  # a first stage without the LM head
                embed.keep_for_lookup(kernels)
            else:
                embed.drop_gguf_blocks()
        # A pipeline stage runs its layers on the modules (the C call ends with the final norm).
        self.fused = FusedDecoder.build(kernels, self) if self.stage.whole else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        assert isinstance(head, VocabParallelEmbedding), "only the last stage has the LM head"
        return head.logits(hidden)

    def wants(self, name: str) -> bool:
        """Whether a checkpoint tensor (Hugging Face name) belongs to this stage: the loaders
        skip the others before reading them."""
        if self.stage.whole:
            return True
        if name.startswith("model.layers."):
            return self.stage.start <= int(name.split(".")[2]) < self.stage.end
        if name.startswith("model.embed_tokens."):
            return isinstance(self.model.embed_tokens, VocabParallelEmbedding)
        if name.startswith("model.norm."):
            return self.stage.last
        if name.startswith("lm_head."):
            return self.stage.last
        return True

    def own_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters `load_weights` fills (a subclass's own modules excluded)."""
        return dict(self.named_parameters())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors; each parameter's loader takes its own shard."""
        params = self.own_parameters()
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or not self.wants(name):
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
