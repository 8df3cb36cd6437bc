"""The decoder-only transformer of Llama, Mistral, Qwen2 and Qwen3, in one file.

The model owns no cache. Every forward pass is handed a view of one (CacheRead): for each
layer an object with two verbs, `write` (the new keys and values into their slots) and `attend`
(the queries over the slots), plus which cache slot each new token is written to and which slots
each query may read (a boolean mask). Which kind of cache is behind a view (kv/) is the view's
business. Prefill and decode are the same code path.

Projections are fused at load time: one matmul computes q, k and v, one computes gate and up.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.linear import Linear
from models.rope import apply_rope, rope_cos_sin, rope_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the model dtype: the rounding transformers uses.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LayerKV(Protocol):
    """One layer's view of the KV cache (kv/cache.py's RowsView is the plain one)."""

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """The new keys and values [B, H_kv, T, D] into the slots [B, T] of their rows."""

    def attend(self, q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, before_rope: torch.Tensor) -> torch.Tensor:
        """The attention output [B, H, T, D] of the queries [B, H, T, D] after RoPE; `before_rope`
        holds them unrotated, for a view that keeps them (what a KV policy scores with)."""


class CacheRead(NamedTuple):
    """The cache as one forward pass reads and writes it; the same for every layer but `layers`."""

    layers: list[LayerKV]  # one per model layer
    write_slots: torch.Tensor  # [B, T] the cache slot of each new token
    mask: torch.Tensor | None  # [B, 1, T, S] True where a query may read a slot; None: causal, S == T, no padding


class LayerInputs(NamedTuple):
    """What every layer of one forward pass reads besides its weights and its cache layer."""

    cos: torch.Tensor  # [B, T, D] RoPE rows of each token's position
    sin: torch.Tensor  # [B, T, D]
    write_slots: torch.Tensor  # [B, T] the cache slot of each new token
    mask: torch.Tensor | None  # [B, 1, T, S] True where a query may read a slot; None: causal, S == T


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        qkv_out = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.wqkv = Linear(config.hidden_size, qkv_out, bias=config.qkv_bias)
        self.wo = Linear(config.n_heads * config.head_dim, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, inputs: LayerInputs, kv: LayerKV) -> torch.Tensor:
        """The attention output [B, T, C] for x [B, T, C]."""
        B, T, _ = x.shape
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.wqkv(x).split([H * D, H_kv * D, H_kv * D], dim=-1)
        q = q.view(B, T, H, D)
        k = k.view(B, T, H_kv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.transpose(1, 2)  # [B, H, T, D]
        k = apply_rope(k.transpose(1, 2), inputs.cos, inputs.sin)  # [B, H_kv, T, D]
        v = v.view(B, T, H_kv, D).transpose(1, 2)  # [B, H_kv, T, D]
        # Keys are cached after RoPE: a key keeps its rotation wherever its slot moves later.
        kv.write(k, v, inputs.write_slots)
        out = kv.attend(apply_rope(q, inputs.cos, inputs.sin), inputs.write_slots, inputs.mask, q)  # [B, H, T, D]
        return self.wo(out.transpose(1, 2).reshape(B, T, H * D))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w_gate_up = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.w_down = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, inputs: LayerInputs, kv: LayerKV) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), inputs, kv)
        return x + self.mlp(self.mlp_norm(x))


def run_blocks(blocks: Sequence[Block], x: torch.Tensor, inputs: LayerInputs, kvs: Sequence[LayerKV]) -> torch.Tensor:
    """Consecutive blocks, each on its cache layer: their output [B, T, C]."""
    for block, kv in zip(blocks, kvs):
        x = block(x, inputs, kv)
    return x


class BlockGroups(NamedTuple):
    """How a forward pass runs its blocks: `size` consecutive ones per call of `run`, which takes
    and returns what run_blocks does (the compiled decode step's, engine/compile.py)."""

    run: Callable[..., torch.Tensor]
    size: int


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        vocab_rows = config.vocab_size
        # Handed its table, the embedding skips its random init: every weight comes from the
        # checkpoint, and that init would import torch's compiler.
        self.embed = nn.Embedding(vocab_rows, config.hidden_size, _weight=torch.empty(vocab_rows, config.hidden_size))
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, vocab_rows, bias=False)
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype, which the KV cache shares (the weights may be stored quantized)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T] absolute positions, for RoPE
        cache: CacheRead,
        *,
        logit_index: torch.Tensor | None = None,  # [B]: the one position per row that needs logits
        groups: BlockGroups | None = None,  # default: one block at a time, eager
    ) -> torch.Tensor:
        """Logits [B, V] at logit_index, or [B, T, V] for every position when it is None."""
        x = self.embed(tokens)  # [B, T, C]
        # Cast once here, not in each layer: every cast is an op, and a decode step is hundreds of small ops.
        cos, sin = rope_cos_sin(self.config, self.rope_cos, self.rope_sin, positions)  # [B, T, D]
        inputs = LayerInputs(cos.to(x.dtype), sin.to(x.dtype), cache.write_slots, cache.mask)
        run, size = BlockGroups(run_blocks, 1) if groups is None else groups
        blocks = list(self.layers)
        for first in range(0, len(blocks), size):
            x = run(blocks[first : first + size], x, inputs, cache.layers[first : first + size])
        if logit_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logit_index]  # [B, C]
        return self.lm_head(self.norm(x))
