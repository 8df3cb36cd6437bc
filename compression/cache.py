"""What compression needs of the engine's KV cache, of any kind (kv/): the counters, the keys of a layer or of every layer as
[.., B, H_kv, S, D] in floats, and a compaction that moves kept slots to the front. Compression
never learns how the slots are laid out or stored (floats or codes), and never touches a block
table or the pool's free list (the engine returns the emptied blocks after a compaction).
"""

from typing import Protocol

import torch


class Cache(Protocol):
    length: torch.Tensor  # [B] slots in use
    position: torch.Tensor  # [B] absolute position of the next token
    prompt_length: torch.Tensor  # [B] protected prefix
    slot_ids: torch.Tensor  # [S] 0..S-1
    dtype: torch.dtype  # what keys read back as (a quantized cache dequantizes them)

    @property
    def n_slots(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def slot_shape(self) -> tuple[int, int, int, int, int]:
        """(L, B, H_kv, S, D): the slots as the contiguous layout holds them, in either layout."""

    def row(self, b: int) -> "Cache": ...

    def keys(self, layer: int, n_slots: int) -> torch.Tensor:
        """One layer's keys of the first n_slots slots of every row, [B, H_kv, n_slots, D]."""

    def all_keys(self) -> torch.Tensor:
        """Every layer's keys of every slot, [L, B, H_kv, S, D]."""

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the slots [L, B, H_kv, E], [L, B, H_kv, E, D] each, in floats
        (what a store takes in before a compaction evicts them)."""

    def compact(self, buffers: list[torch.Tensor], prompt_length: torch.Tensor, keep: torch.Tensor, n_candidates: int, window: int) -> None:
        """[prefix | candidates | window] -> [prefix | kept | window] for K, V and the caller's
        per-slot buffers [L, B, H_kv, S, ...]; keep [L, B, H_kv, K] as offsets after the prefix."""

