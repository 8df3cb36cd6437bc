"""The decoder-only transformer of Llama, Mistral, Qwen2 and Qwen3, in one file.

The model owns no cache. Every forward pass is handed a view of one (models/kv_layers.py): each
layer's keys and values, which cache slot each new token is written to, and which slots each
query may read (a boolean mask). A layer only writes and attends through its view; whether the
cache is contiguous or paged is the view's business. Prefill and decode are the same code path.

Projections are fused at load time: one matmul computes q, k and v, one computes gate and up.
Under tensor parallelism (models/parallel.py) each rank runs this same model on its share of the
heads, the MLP width and the vocabulary; a sum after the embedding, two per layer and one gather
of the logits join the ranks' parts.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.kv_layers import CacheRead, LayerKV, attend, hand_over_queries, write
from models.linear import Linear
from models.parallel import TensorParallel, gather_vocab, reduce_sum, shard_config
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


class LayerInputs(NamedTuple):
    """What every layer of one forward pass reads besides its weights and its cache layer."""

    cos: torch.Tensor  # [B, T, D] RoPE rows of each token's position
    sin: torch.Tensor  # [B, T, D]
    write_slots: torch.Tensor  # [B, T] the cache slot of each new token
    mask: torch.Tensor | None  # [B, 1, T, S] True where a query may read a slot; None: causal, S == T


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, parallel: TensorParallel | None = None):
        super().__init__()
        self.parallel = parallel
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        qkv_out = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.wqkv = Linear(config.hidden_size, qkv_out, bias=config.qkv_bias)
        self.wo = Linear(config.n_heads * config.head_dim, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, inputs: LayerInputs, kv: LayerKV) -> torch.Tensor:
        """The attention output [B, T, C] for x [B, T, C]. The queries before RoPE go to the cache
        view's tap, if it has one (what a KV policy scores with)."""
        B, T, _ = x.shape
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.wqkv(x).split([H * D, H_kv * D, H_kv * D], dim=-1)
        q = q.view(B, T, H, D)
        k = k.view(B, T, H_kv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.transpose(1, 2)  # [B, H, T, D]
        hand_over_queries(kv, q)
        q = apply_rope(q, inputs.cos, inputs.sin)
        k = apply_rope(k.transpose(1, 2), inputs.cos, inputs.sin)  # [B, H_kv, T, D]
        v = v.view(B, T, H_kv, D).transpose(1, 2)  # [B, H_kv, T, D]
        # Keys are cached after RoPE: a key keeps its rotation wherever its slot moves later.
        write(kv, k, v, inputs.write_slots)
        out = attend(kv, q, inputs.write_slots, inputs.mask)  # [B, H, T, D]
        return reduce_sum(self.wo(out.transpose(1, 2).reshape(B, T, H * D)), self.parallel)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, parallel: TensorParallel | None = None):
        super().__init__()
        self.parallel = parallel
        self.w_gate_up = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.w_down = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return reduce_sum(self.w_down(F.silu(gate) * up), self.parallel)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, parallel: TensorParallel | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, parallel)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, parallel)

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
    def __init__(self, config: ModelConfig, parallel: TensorParallel | None = None):
        """The whole model of `config`, or with `parallel` this rank's part of it: then self.config
        is the part's (models.parallel.shard_config), the vocabulary whole."""
        super().__init__()
        self.parallel = parallel
        if parallel is not None:
            config = shard_config(config, parallel)
        self.config = config
        first, end = (0, config.vocab_size) if parallel is None else parallel.vocab_rows(config.vocab_size)
        vocab_rows = end - first
        # Handed its table, the embedding skips its random init: every weight comes from the
        # checkpoint, and that init imports torch's compiler, a second of a process's start (docs/performance.md).
        self.embed = nn.Embedding(vocab_rows, config.hidden_size, _weight=torch.empty(vocab_rows, config.hidden_size))
        self.layers = nn.ModuleList(Block(config, parallel) for _ in range(config.n_layers))
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
        x = self.embed_tokens(tokens)  # [B, T, C]
        # Cast once here, not in each layer: every cast is an op, and a decode step is hundreds of small ops.
        cos, sin = rope_cos_sin(self.config, self.rope_cos, self.rope_sin, positions)  # [B, T, D]
        inputs = LayerInputs(cos.to(x.dtype), sin.to(x.dtype), cache.write_slots, cache.mask)
        run, size = BlockGroups(run_blocks, 1) if groups is None else groups
        blocks = list(self.layers)
        for first in range(0, len(blocks), size):
            x = run(blocks[first : first + size], x, inputs, cache.layers[first : first + size])
        if logit_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logit_index]  # [B, C]
        return gather_vocab(self.lm_head(self.norm(x)), self.parallel)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] -> [B, T, C]. Split by vocabulary, each rank looks up the tokens it holds and
        contributes zeros for the others: the sum over ranks is every token's row, exactly."""
        if self.parallel is None:
            return self.embed(tokens)
        first, end = self.parallel.vocab_rows(self.config.vocab_size)
        held = (tokens >= first) & (tokens < end)  # [B, T]
        rows = self.embed(torch.where(held, tokens - first, 0))  # [B, T, C]
        return reduce_sum(rows * held.unsqueeze(-1).to(rows.dtype), self.parallel)
