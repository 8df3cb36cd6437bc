"""The decoder-only transformer of Llama, Mistral, Qwen2 and Qwen3, in one file.

The model owns no cache. Every forward pass is told where its keys and values live (the
engine's static cache buffers, or a pool of blocks and each row's block table), which cache slot
each new token is written to, and which slots each query may read (a boolean mask). Prefill and
decode are the same code path.

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
from models.flash_attention import flash_decode, flash_decode_supported
from models.linear import Linear
from models.pages import Pages, gather_pages, page_address, read_pages
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

    def forward(
        self,
        x: torch.Tensor,  # [B, T, C]
        cos: torch.Tensor,  # [B, T, D]
        sin: torch.Tensor,  # [B, T, D]
        k_cache: torch.Tensor,  # [B, H_kv, S, D] this layer's keys, written in place; paged: [n_blocks, H_kv, block, D]
        v_cache: torch.Tensor,  # like k_cache
        write_slots: torch.Tensor,  # [B, T] cache slot of each new token
        mask: torch.Tensor | None,  # [B, 1, T, S] True where a query may read a slot; None: causal, S == T
        pages: Pages | None = None,  # with a paged cache: its block table, and where the slots read lie
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output [B, T, C] and the queries before RoPE [B, H, T, D] (for compression)."""
        B, T, _ = x.shape
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.wqkv(x).split([H * D, H_kv * D, H_kv * D], dim=-1)
        q = q.view(B, T, H, D)
        k = k.view(B, T, H_kv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q_before_rope = q.transpose(1, 2)  # [B, H, T, D]
        q = apply_rope(q_before_rope, cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, H_kv, T, D]
        v = v.view(B, T, H_kv, D).transpose(1, 2)  # [B, H_kv, T, D]

        # Keys are cached after RoPE: a key keeps its rotation wherever its slot moves later.
        if pages is None:
            rows = torch.arange(B, device=x.device)[:, None]  # [B, 1]
            k_cache[rows, :, write_slots] = k.transpose(1, 2)  # [B, T, H_kv, D] into slots [B, T]
            v_cache[rows, :, write_slots] = v.transpose(1, 2)
            out = attend(q, k_cache, v_cache, write_slots, mask)  # [B, H, T, D]
        else:
            blocks, offsets = page_address(pages.table, write_slots, k_cache.shape[2])  # [B, T] each
            k_cache[blocks, :, offsets] = k.transpose(1, 2)  # [B, T, H_kv, D] into their blocks
            v_cache[blocks, :, offsets] = v.transpose(1, 2)
            out = attend_pages(q, k_cache, v_cache, pages, write_slots, mask)
        return reduce_sum(self.wo(out.transpose(1, 2).reshape(B, T, H * D)), self.parallel), q_before_rope


def attend(
    q: torch.Tensor,  # [B, H, T, D] after RoPE
    k_cache: torch.Tensor,  # [B, H_kv, S, D] one layer's keys, the new ones written
    v_cache: torch.Tensor,  # [B, H_kv, S, D]
    write_slots: torch.Tensor,  # [B, T]
    mask: torch.Tensor | None,  # [B, 1, T, S]; None: causal over slots 0..T-1, no padding
) -> torch.Tensor:
    """Attention over the cache, [B, H, T, D], by the fastest kernel that applies."""
    B, H, T, D = q.shape
    if T == 1 and flash_decode_supported(k_cache):
        # flash-attn reads only each row's slots in use (the new token's slot + 1).
        return flash_decode(q, k_cache, v_cache, write_slots[:, 0] + 1)
    if mask is None:
        # SDPA's causal kernel skips the blocks above the diagonal and pairs query heads with
        # their KV head itself (docs/performance.md).
        return F.scaled_dot_product_attention(q, k_cache, v_cache, is_causal=True, enable_gqa=True)
    # GQA without copying K/V: the G query heads sharing a KV head become G*T query rows.
    H_kv = k_cache.shape[1]
    G = H // H_kv
    if T > 1:
        mask = mask.unsqueeze(2).expand(B, 1, G, T, mask.shape[-1]).reshape(B, 1, G * T, -1)
    out = F.scaled_dot_product_attention(q.reshape(B, H_kv, G * T, D), k_cache, v_cache, attn_mask=mask)  # [B, H_kv, G*T, D]
    return out.view(B, H, T, D)


def attend_pages(
    q: torch.Tensor,  # [B, H, T, D] after RoPE
    k_pool: torch.Tensor,  # [n_blocks, H_kv, block, D] one layer's pool, the new keys written
    v_pool: torch.Tensor,  # [n_blocks, H_kv, block, D]
    pages: Pages,
    write_slots: torch.Tensor,  # [B, T]
    mask: torch.Tensor | None,  # [B, 1, T, S]; None: causal over slots 0..T-1, no padding
) -> torch.Tensor:
    """Attention over a paged cache, [B, H, T, D]: flash-attn reads the blocks through the table
    itself; otherwise each row's first S slots are gathered into one tensor for SDPA."""
    if q.shape[2] == 1 and flash_decode_supported(k_pool, paged=True):
        return flash_decode(q, k_pool, v_pool, write_slots[:, 0] + 1, pages.table)
    return attend(q, gather_pages(k_pool, pages), gather_pages(v_pool, pages), write_slots, mask)


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

    def forward(
        self,
        x: torch.Tensor,  # [B, T, C]
        cos: torch.Tensor,  # [B, T, D]
        sin: torch.Tensor,  # [B, T, D]
        k_cache: torch.Tensor,  # [B, H_kv, S, D] this layer's; paged: [n_blocks, H_kv, block, D]
        v_cache: torch.Tensor,  # like k_cache
        write_slots: torch.Tensor,  # [B, T]
        mask: torch.Tensor | None,  # [B, 1, T, S]
        pages: Pages | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output [B, T, C] and its queries before RoPE [B, H, T, D]."""
        attended, queries = self.attn(
            self.attn_norm(x), cos, sin, k_cache=k_cache, v_cache=v_cache, write_slots=write_slots, mask=mask,
            pages=pages,
        )
        x = x + attended
        return x + self.mlp(self.mlp_norm(x)), queries


def run_blocks(
    blocks: Sequence[Block],
    x: torch.Tensor,  # [B, T, C]
    cos: torch.Tensor,  # [B, T, D]
    sin: torch.Tensor,  # [B, T, D]
    k_caches: Sequence[torch.Tensor],  # each block's layer of the cache, [B, H_kv, S, D] (paged: [n_blocks, H_kv, block, D])
    v_caches: Sequence[torch.Tensor],
    write_slots: torch.Tensor,  # [B, T]
    mask: torch.Tensor | None,  # [B, 1, T, S]
    pages: Pages | None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Consecutive blocks: their output [B, T, C] and each one's queries before RoPE [B, H, T, D]."""
    queries = []
    for block, k_cache, v_cache in zip(blocks, k_caches, v_caches):
        x, q = block(x, cos, sin, k_cache=k_cache, v_cache=v_cache, write_slots=write_slots, mask=mask, pages=pages)
        queries.append(q)
    return x, queries


class BlockGroups(NamedTuple):
    """How a forward pass runs its blocks: `size` consecutive ones per call of `run`, which takes
    and returns what run_blocks does (the compiled decode step's, engine/compile.py)."""

    run: Callable[..., tuple[torch.Tensor, list[torch.Tensor]]]
    size: int


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, parallel: TensorParallel | None = None):
        """The whole model of `config`, or with `parallel` this rank's part of it: then self.config
        is the part's (models.parallel.shard_config), the vocabulary whole."""
        super().__init__()
        self.parallel = parallel
        self.kv_heads = None  # [first, of the model's count]: this rank's KV heads, for the KV policies' random draws
        if parallel is not None:
            self.kv_heads = (parallel.block(config.n_kv_heads)[0], config.n_kv_heads)
            config = shard_config(config, parallel)
        self.config = config
        first, end = (0, config.vocab_size) if parallel is None else parallel.vocab_rows(config.vocab_size)
        vocab_rows = end - first
        # Handed its table, the embedding skips its random init: every weight comes from the
        # checkpoint, and that init imports torch's compiler (1.1 s of a process's start).
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
        k_cache: torch.Tensor,  # [L, B, H_kv, S, D]; paged: [L, n_blocks, H_kv, block, D]
        v_cache: torch.Tensor,  # like k_cache
        write_slots: torch.Tensor,  # [B, T]
        mask: torch.Tensor | None,  # [B, 1, T, S]; None: causal over slots 0..T-1 (S == T), no padding
        logit_index: torch.Tensor | None = None,  # [B]: the one position per row that needs logits
        on_queries: Callable[[int, torch.Tensor], None] | None = None,
        block_table: torch.Tensor | None = None,  # [B, max_blocks]: k_cache/v_cache are pools of blocks
        groups: BlockGroups | None = None,  # default: one block at a time, eager
    ) -> torch.Tensor:
        """Logits [B, V] at logit_index, or [B, T, V] for every position when it is None.
        on_queries(layer, queries before RoPE [B, H, T, D]) is called as each group of layers
        finishes, for a KV policy: it keeps what it needs, so that in a prefill (one layer per
        group) no layer's queries (a view that pins its whole q/k/v output) outlive that layer."""
        x = self.embed_tokens(tokens)  # [B, T, C]
        # Cast once here, not in each layer: every cast is an op, and a decode step is hundreds of small ops.
        cos, sin = rope_cos_sin(self.config, self.rope_cos, self.rope_sin, positions)  # [B, T, D]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        pages = None  # a paged cache: where each row's slots lie, worked out once for every layer
        if block_table is not None:
            n_read = tokens.shape[1] if mask is None else mask.shape[-1]
            pages = read_pages(block_table, n_read, k_cache.shape[2], k_cache.shape[3])
        run, size = BlockGroups(run_blocks, 1) if groups is None else groups
        blocks = list(self.layers)
        k_caches, v_caches = k_cache.unbind(0), v_cache.unbind(0)  # each layer's view: what a block writes lands in the cache
        for first in range(0, len(blocks), size):
            end = first + size
            x, queries = run(blocks[first:end], x, cos, sin, k_caches[first:end], v_caches[first:end], write_slots, mask, pages)
            if on_queries is not None:
                for layer, q in enumerate(queries, start=first):
                    on_queries(layer, q)
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
