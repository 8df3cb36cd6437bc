"""Addressing a paged KV cache: a row's slot s lives in block block_table[row, s // block_size],
at offset s % block_size. The pool holds every row's blocks, [L, n_blocks, H_kv, block_size, D].

The model writes new keys and values through the table and reads a row's slots back as one
contiguous [B, H_kv, S, D] tensor, a single gather: SDPA then runs exactly as it does on the
contiguous cache, over the first S slots of each row. Where those slots lie is worked out once
per forward pass (`read_pages`), not once per layer.
"""

from typing import NamedTuple

import torch


class Pages(NamedTuple):
    """A paged cache as one forward pass reads it."""

    table: torch.Tensor  # [B, max_blocks] the pool block of each row's slots s // block_size
    blocks: torch.Tensor  # [B, 1, S] the pool block of each slot read
    heads: torch.Tensor  # [1, H_kv, 1]
    offsets: torch.Tensor  # [B, 1, S] its offset in the block


def page_address(block_table: torch.Tensor, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool block and the offset in it of each slot [B, ...] of each row: two [B, ...] tensors."""
    blocks = block_table.gather(1, (slots // block_size).flatten(1)).view(slots.shape)
    return blocks, slots % block_size


def read_pages(block_table: torch.Tensor, n_slots: int, n_kv_heads: int, block_size: int) -> Pages:
    """Where the first n_slots slots of every row lie in the pool."""
    slots = torch.arange(n_slots, device=block_table.device).expand(block_table.shape[0], n_slots)  # [B, S]
    blocks, offsets = page_address(block_table, slots, block_size)
    return Pages(block_table, blocks[:, None], torch.arange(n_kv_heads, device=block_table.device)[None, :, None], offsets[:, None])


def gather_pages(pool: torch.Tensor, pages: Pages) -> torch.Tensor:
    """The slots `pages` reads, [..., B, H_kv, S, D], from a pool [..., n_blocks, H_kv, block_size, D]
    (one layer's, or every layer's)."""
    return pool[..., pages.blocks, pages.heads, pages.offsets, :]
