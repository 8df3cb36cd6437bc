"""Addressing a paged KV cache: a row's slot s lives in block block_table[row, s // block_size],
at offset s % block_size. The pool holds every row's blocks, [L, n_blocks, H_kv, block_size, D].

The model writes new keys and values through the table and reads a row's slots back as one
contiguous [B, H_kv, S, D] tensor, a single gather: SDPA then runs exactly as it does on the
contiguous cache, over the first S slots of each row.
"""

import torch


def page_address(block_table: torch.Tensor, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool block and the offset in it of each slot [B, ...] of each row: two [B, ...] tensors."""
    blocks = block_table.gather(1, (slots // block_size).flatten(1)).view(slots.shape)
    return blocks, slots % block_size


def gather_pages(pool: torch.Tensor, block_table: torch.Tensor, n_slots: int) -> torch.Tensor:
    """The first n_slots slots of every row, [..., B, H_kv, n_slots, D], from a pool
    [..., n_blocks, H_kv, block_size, D] (one layer's, or every layer's) and the table [B, max_blocks]."""
    H_kv, block_size = pool.shape[-3], pool.shape[-2]
    slots = torch.arange(n_slots, device=pool.device).expand(block_table.shape[0], n_slots)  # [B, S]
    blocks, offsets = page_address(block_table, slots, block_size)
    heads = torch.arange(H_kv, device=pool.device)[None, :, None]  # [1, H_kv, 1]
    return pool[..., blocks[:, None], heads, offsets[:, None], :]
