"""What one forward pass sees of the KV cache: each layer's keys and values, where the new tokens
are written, and which slots each query reads. The model calls three verbs on a layer, `write`,
`attend` and `hand_over_queries` (to a KV policy, when the view has a tap); which layout holds
the slots (contiguous rows, or a pool of blocks through a block table, models/pages.py) is
decided here and nowhere else in the model.

The engine's caches make these views (engine/kv_cache.py, engine/paged_cache.py): a layer's
view is its slice of the cache's buffers, so what a block writes lands in the cache itself. A
quantized cache's buffers (models/kv_quant.py) are written as codes and read back dequantized,
in the queries' dtype, just before attention.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from models.flash_attention import flash_decode, why_not_flash
from models.kv_quant import KV, QuantizedKV, kv_map, kv_parts, kv_read, kv_store
from models.pages import Pages, gather_pages, page_address
from models.recall import StoreLayer, recall


# Where a layer hands its queries before RoPE [B, H, T, D] for a KV policy to score with: a decode
# step's static buffer [B, H, 1, D], written in place (inside a compiled step or a CUDA graph), or in
# a prefill a function that takes them as the layer finishes, so that none outlives its layer.
QueryTap = torch.Tensor | Callable[[torch.Tensor], None]


class RowsLayer(NamedTuple):
    """One layer of the contiguous cache: row b's slot s is k[b, :, s]."""

    k: KV  # [B, H_kv, S, D] keys after RoPE
    v: KV  # [B, H_kv, S, D]
    store: StoreLayer | None = None  # the slots demoted from this layer, which a decode step recalls from
    queries: QueryTap | None = None


class PagedLayer(NamedTuple):
    """One layer of the paged cache: row b's slot s lies in block pages.table[b, s // block]."""

    k: KV  # [n_blocks, H_kv, block, D] the layer's pool
    v: KV  # [n_blocks, H_kv, block, D]
    pages: Pages  # the block table, and where the slots read lie (worked out once per forward)
    store: StoreLayer | None = None
    queries: QueryTap | None = None


LayerKV = RowsLayer | PagedLayer


class CacheRead(NamedTuple):
    """The cache as one forward pass reads and writes it; the same for every layer but `layers`."""

    layers: list[LayerKV]  # one per model layer
    write_slots: torch.Tensor  # [B, T] the cache slot of each new token
    mask: torch.Tensor | None  # [B, 1, T, S] True where a query may read a slot; None: causal, S == T, no padding


def tapped(layers: list[LayerKV], taps: list[QueryTap]) -> list[LayerKV]:
    """The layers' views, each handing its queries to its tap."""
    return [layer._replace(queries=tap) for layer, tap in zip(layers, taps)]


def hand_over_queries(layer: LayerKV, q: torch.Tensor) -> None:
    """The layer's queries before RoPE [B, H, T, D] to its tap, if it has one."""
    if isinstance(layer.queries, torch.Tensor):
        layer.queries.copy_(q)
    elif layer.queries is not None:
        layer.queries(q)


def write(layer: LayerKV, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store the new keys and values [B, H_kv, T, D] at the slots [B, T] of their rows."""
    if isinstance(layer, PagedLayer):
        block_size = kv_parts(layer.k)[0].shape[2]
        blocks, offsets = page_address(layer.pages.table, slots, block_size)  # [B, T] each
        index = (blocks, slice(None), offsets)  # [B, T, H_kv, D] into their blocks
    else:
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1]
        index = (rows, slice(None), slots)  # [B, T, H_kv, D] into slots [B, T]
    kv_store(layer.k, index, k.transpose(1, 2))
    kv_store(layer.v, index, v.transpose(1, 2))


def attend(layer: LayerKV, q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of the queries [B, H, T, D] (after RoPE) over the layer's slots, [B, H, T, D],
    by the fastest kernel that applies. flash-attn reads only each row's slots in use (the new
    token's slot + 1), through the block table itself for a paged layer; otherwise a paged row's
    first S slots are gathered into one tensor, and SDPA runs as on the contiguous cache. A
    quantized layer's slots are dequantized for it, in the queries' dtype. A decode step with a
    store attends over the pages it recalls too (models/recall.py)."""
    paged = isinstance(layer, PagedLayer)
    decode = q.shape[2] == 1
    if decode and flash_fits(layer, q):
        return flash_decode(q, layer.k, layer.v, slots[:, 0] + 1, layer.pages.table if paged else None)
    k, v = layer.k, layer.v
    if paged:
        k, v = (kv_map(kv, lambda pool: gather_pages(pool, layer.pages)) for kv in (k, v))
    k, v = kv_read(k, q.dtype), kv_read(v, q.dtype)
    if decode and layer.store is not None:  # one softmax over the cache's slots and the recalled ones
        recalled_k, recalled_v, recalled = recall(layer.store, q)
        k, v = torch.cat([k, recalled_k], dim=2), torch.cat([v, recalled_v], dim=2)
        B, H_kv = recalled.shape[:2]
        resident = torch.ones(B, 1, 1, k.shape[2] - recalled.shape[3], dtype=torch.bool, device=q.device) if mask is None else mask
        mask = torch.cat([resident.expand(B, H_kv, 1, -1), recalled], dim=3)  # [B, H_kv, 1, S + R]
    return sdpa(q, k, v, mask)


def flash_fits(layer: LayerKV, q: torch.Tensor) -> bool:
    """Whether flash-attn can read this layer for the queries [B, H, 1, D] (models/flash_attention.py)."""
    cache_dtype = None if isinstance(layer.k, QuantizedKV) else layer.k.dtype
    block_size = kv_parts(layer.k)[0].shape[2] if isinstance(layer, PagedLayer) else None
    return why_not_flash(q.device, q.dtype, cache_dtype, q.shape[-1], block_size, layer.store is not None) is None


def slots_read(layer: LayerKV) -> list[tuple[torch.Tensor, int]]:
    """The layer's tensors whose size along a dimension is the number of slots read, with that
    dimension (what a compiled step takes as a variable size)."""
    if isinstance(layer, PagedLayer):
        return [(layer.pages.blocks, 2), (layer.pages.offsets, 2)]  # [B, 1, S] each
    return [(part, 2) for part in kv_parts(layer.k) + kv_parts(layer.v)]  # [B, H_kv, S, ...]


def sdpa(
    q: torch.Tensor,  # [B, H, T, D] after RoPE
    k: torch.Tensor,  # [B, H_kv, S, D] one layer's keys, the new ones written
    v: torch.Tensor,  # [B, H_kv, S, D]
    mask: torch.Tensor | None,  # [B, 1, T, S], or [B, H_kv, 1, S] per KV head; None: causal over slots 0..T-1, no padding
) -> torch.Tensor:
    B, H, T, D = q.shape
    if mask is None:
        # SDPA's causal kernel skips the blocks above the diagonal and pairs query heads with
        # their KV head itself (docs/performance.md).
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    # GQA without copying K/V: the G query heads sharing a KV head become G*T query rows.
    H_kv = k.shape[1]
    G = H // H_kv
    if T > 1:
        mask = mask.unsqueeze(2).expand(B, 1, G, T, mask.shape[-1]).reshape(B, 1, G * T, -1)
    out = F.scaled_dot_product_attention(q.reshape(B, H_kv, G * T, D), k, v, attn_mask=mask)  # [B, H_kv, G*T, D]
    return out.view(B, H, T, D)
