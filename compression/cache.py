"""The part of the engine's KV cache that compression reads and rewrites, in either layout.

Contiguous, K and V are [L, B, H_kv, S, D]; paged, they are pools [L, n_blocks, H_kv, block, D]
and `block_table` [B, max_blocks] says which blocks hold each row's slots. Compression reads
keys through `layer_keys` / `all_keys`, which hand back [.., B, H_kv, S, D] in both layouts, and
moves slots through compaction.compact_cache; it never touches the block table or the pool's
free list (the engine returns the emptied blocks after a compaction).
"""

from typing import Protocol

import torch

from models.pages import gather_pages, read_pages


class Cache(Protocol):
    k: torch.Tensor  # [L, B, H_kv, S, D] keys after RoPE; paged: [L, n_blocks, H_kv, block, D]
    v: torch.Tensor  # like k
    block_table: torch.Tensor | None  # [B, max_blocks] for a paged cache, else None
    length: torch.Tensor  # [B] slots in use
    position: torch.Tensor  # [B] absolute position of the next token
    prompt_length: torch.Tensor  # [B] protected prefix
    slot_ids: torch.Tensor  # [S] 0..S-1

    @property
    def n_slots(self) -> int: ...

    def row(self, b: int) -> "Cache": ...


def slot_shape(cache: Cache) -> tuple[int, int, int, int, int]:
    """(L, B, H_kv, S, D): the cache's slots as the contiguous layout holds them, in either layout."""
    L, _, H_kv, _, D = cache.k.shape
    return L, cache.length.shape[0], H_kv, cache.n_slots, D


def layer_keys(cache: Cache, layer: int, n_slots: int) -> torch.Tensor:
    """One layer's keys of the first n_slots slots of every row, [B, H_kv, n_slots, D]."""
    if cache.block_table is None:
        return cache.k[layer, :, :, :n_slots]
    return gather_pages(cache.k[layer], read_pages(cache.block_table, n_slots, cache.k.shape[2], cache.k.shape[3]))


def all_keys(cache: Cache) -> torch.Tensor:
    """Every layer's keys of every slot, [L, B, H_kv, S, D]."""
    if cache.block_table is None:
        return cache.k
    return gather_pages(cache.k, read_pages(cache.block_table, cache.n_slots, cache.k.shape[2], cache.k.shape[3]))
