"""The static KV cache: allocated once per run, never resized, compacted in place.

Slots are not positions. Row b holds `length[b]` slots in use; its next token has absolute
position `position[b]`. After a compaction `length` shrinks and `position` does not: RoPE was
applied to the keys before they were stored, so a kept key keeps its rotation.

The buffers hold floats, or 8- or 4-bit codes with their scales (models/kv_quant.py); the cache
hands out each layer's buffers as they are and its keys read back as floats.
"""

from dataclasses import dataclass, replace

import torch

from compression.compaction import compact_in_place
from engine.kv_store import KVStore
from models.config import ModelConfig
from models.kv_layers import RowsLayer
from models.kv_quant import KV, allocate_keys_and_values, kv_map, kv_nbytes, kv_parts, kv_read, kv_shape, kv_unbind


@dataclass
class KVCache:
    k: KV  # [L, B, H_kv, S, D] keys after RoPE
    v: KV  # [L, B, H_kv, S, D]
    length: torch.Tensor  # [B] int64 slots in use
    position: torch.Tensor  # [B] int64 absolute position of the next token
    prompt_length: torch.Tensor  # [B] int64 slots holding the prompt (the protected prefix)
    slot_ids: torch.Tensor  # [S] 0..S-1, kept so that the decode step's mask needs no new index tensor
    dtype: torch.dtype  # what the keys and values read back as: the buffers' own, or a quantized cache's model dtype
    store: KVStore | None = None  # where compactions demote what they evict (engine/kv_store.py)

    @classmethod
    def allocate(
        cls, config: ModelConfig, batch: int, n_slots: int, dtype: torch.dtype, device: torch.device, *, bits: tuple[int, int] | None = None
    ) -> "KVCache":
        """Buffers of `dtype`, or with `bits` (the keys' and the values', 8 or 4) quantized ones read back in `dtype`."""
        shape = (config.n_layers, batch, config.n_kv_heads, n_slots, config.head_dim)
        counters = [torch.zeros(batch, dtype=torch.int64, device=device) for _ in range(3)]
        return cls(
            *allocate_keys_and_values(shape, dtype, bits, device),
            *counters,
            torch.arange(n_slots, device=device),
            dtype,
        )

    @property
    def n_slots(self) -> int:
        return self.slot_ids.shape[0]

    @property
    def device(self) -> torch.device:
        return self.slot_ids.device

    def slot_shape(self) -> tuple[int, int, int, int, int]:
        """(L, B, H_kv, S, D): the slots of every layer and row."""
        return tuple(kv_shape(self.k))

    @property
    def nbytes(self) -> int:
        """K and V, their scales, and the store's bytes."""
        return kv_nbytes(self.k) + kv_nbytes(self.v) + (0 if self.store is None else self.store.nbytes)

    @property
    def peak_bytes(self) -> int:
        """Every slot is held for the whole run."""
        return self.nbytes

    def layers(self, n_slots: int | None) -> list[RowsLayer]:
        """Each layer's view of the first n_slots slots of every row (None: the whole buffer), for
        a forward pass: what it writes lands in the cache."""
        k, v = self.k, self.v
        if n_slots is not None:
            k, v = (kv_map(kv, lambda t: t[:, :, :, :n_slots]) for kv in (k, v))
        stores = [None] * self.slot_shape()[0] if self.store is None else self.store.layers()
        return [RowsLayer(*layer) for layer in zip(kv_unbind(k), kv_unbind(v), stores)]

    def keys(self, layer: int, n_slots: int) -> torch.Tensor:
        """One layer's keys of the first n_slots slots of every row, [B, H_kv, n_slots, D]."""
        return kv_read(kv_map(self.k, lambda t: t[layer, :, :, :n_slots]), self.dtype)

    def all_keys(self) -> torch.Tensor:
        """Every layer's keys of every slot, [L, B, H_kv, S, D]."""
        return kv_read(self.k, self.dtype)

    def demote(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Copy the slots [L, B, H_kv, E] about to be evicted, and the positions they hold, into the store."""
        def gather(part: torch.Tensor) -> torch.Tensor:
            return part.gather(3, slots[..., None].expand(*slots.shape, part.shape[-1]))

        k, v = (kv_read(kv_map(kv, gather), self.dtype) for kv in (self.k, self.v))
        self.store.demote(k, v, positions)

    def compact(self, buffers: list[torch.Tensor], prompt_length: torch.Tensor, keep: torch.Tensor, n_candidates: int, window: int) -> None:
        """Move each (layer, row, KV head)'s kept slots to the front, and the same slots of the
        caller's own per-slot buffers [L, B, H_kv, S, ...] (compression.compaction.compact_in_place)."""
        compact_in_place([*kv_parts(self.k), *kv_parts(self.v), *buffers], prompt_length, keep, n_candidates, window)

    def reserve(self, row: int, n_slots: int) -> None:
        """Every slot is allocated from the start: a row of n_slots needs nothing more, if it fits."""
        if n_slots > self.n_slots:
            raise ValueError(f"a row needs {n_slots} slots but the cache's rows hold {self.n_slots}")

    def shrink(self, row: int, n_slots: int) -> None:
        """Nothing to return: the contiguous cache holds every slot for the whole run."""

    def row(self, b: int) -> "KVCache":
        """Row b alone, as a cache of one row: views of this one's buffers and counters."""
        rows = slice(b, b + 1)
        k, v = (kv_map(kv, lambda t: t[:, rows]) for kv in (self.k, self.v))
        store = None if self.store is None else self.store.row(b)
        return replace(self, k=k, v=v, store=store, length=self.length[rows], position=self.position[rows], prompt_length=self.prompt_length[rows])
