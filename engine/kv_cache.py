"""The static KV cache: allocated once per run, never resized, compacted in place.

Slots are not positions. Row b holds `length[b]` slots in use; its next token has absolute
position `position[b]`. After a compaction `length` shrinks and `position` does not: RoPE was
applied to the keys before they were stored, so a kept key keeps its rotation.
"""

from dataclasses import dataclass, replace

import torch

from compression.compaction import compact_in_place
from models.config import ModelConfig
from models.kv_layers import RowsLayer


@dataclass
class KVCache:
    k: torch.Tensor  # [L, B, H_kv, S, D] keys after RoPE
    v: torch.Tensor  # [L, B, H_kv, S, D]
    length: torch.Tensor  # [B] int64 slots in use
    position: torch.Tensor  # [B] int64 absolute position of the next token
    prompt_length: torch.Tensor  # [B] int64 slots holding the prompt (the protected prefix)
    slot_ids: torch.Tensor  # [S] 0..S-1, kept so that the decode step's mask needs no new index tensor

    @classmethod
    def allocate(cls, config: ModelConfig, batch: int, n_slots: int, dtype: torch.dtype, device: torch.device) -> "KVCache":
        shape = (config.n_layers, batch, config.n_kv_heads, n_slots, config.head_dim)
        counters = [torch.zeros(batch, dtype=torch.int64, device=device) for _ in range(3)]
        return cls(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
            *counters,
            torch.arange(n_slots, device=device),
        )

    @property
    def n_slots(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def peak_bytes(self) -> int:
        """Every slot is held for the whole run."""
        return self.nbytes

    def layers(self, n_slots: int | None) -> list[RowsLayer]:
        """Each layer's view of the first n_slots slots of every row (None: the whole buffer), for
        a forward pass: what it writes lands in the cache."""
        k, v = (self.k, self.v) if n_slots is None else (self.k[:, :, :, :n_slots], self.v[:, :, :, :n_slots])
        return [RowsLayer(*layer) for layer in zip(k.unbind(0), v.unbind(0))]

    def keys(self, layer: int, n_slots: int) -> torch.Tensor:
        """One layer's keys of the first n_slots slots of every row, [B, H_kv, n_slots, D]."""
        return self.k[layer, :, :, :n_slots]

    def all_keys(self) -> torch.Tensor:
        """Every layer's keys of every slot, [L, B, H_kv, S, D]."""
        return self.k

    def compact(self, buffers: list[torch.Tensor], prompt_length: torch.Tensor, keep: torch.Tensor, n_candidates: int, window: int) -> None:
        """Move each (layer, row, KV head)'s kept slots to the front, and the same slots of the
        caller's own per-slot buffers [L, B, H_kv, S, ...] (compression.compaction.compact_in_place)."""
        compact_in_place([self.k, self.v, *buffers], prompt_length, keep, n_candidates, window)

    def reserve(self, row: int, n_slots: int) -> None:
        """Every slot is allocated from the start: a row of n_slots needs nothing more, if it fits."""
        if n_slots > self.n_slots:
            raise ValueError(f"a row needs {n_slots} slots but the cache's rows hold {self.n_slots}")

    def shrink(self, row: int, n_slots: int) -> None:
        """Nothing to return: the contiguous cache holds every slot for the whole run."""

    def row(self, b: int) -> "KVCache":
        """Row b alone, as a cache of one row: views of this one's buffers and counters."""
        rows = slice(b, b + 1)
        return replace(self, k=self.k[:, rows], v=self.v[:, rows], length=self.length[rows], position=self.position[rows], prompt_length=self.prompt_length[rows])
