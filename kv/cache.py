"""The static KV cache: allocated once per run, never resized, compacted in place.

Slots are not positions (docs/design.md). Row b holds `length[b]` slots in use; its next token
has absolute position `position[b]`. After a compaction `length` shrinks and `position` does not.

This is the plain cache kind: contiguous rows of floats. The other kinds (kv/quantized.py,
kv/paged.py, kv/flash.py) keep its counters and its verbs: a forward pass gets one view per
layer (`layers`) and calls `write` and `attend` on it; the engine calls `fit` between steps; a
KV policy reads keys and moves slots through `keys`, `gather` and `compact`.
"""

from dataclasses import dataclass, replace
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F

from kv.compaction import compact_in_place
from models.config import ModelConfig


class RowsView(NamedTuple):
    """One layer of a contiguous cache: row b's slot s is k[b, :, s]."""

    k: torch.Tensor  # [B, H_kv, S, D] keys after RoPE
    v: torch.Tensor  # [B, H_kv, S, D]

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store the new keys and values [B, H_kv, T, D] at the slots [B, T] of their rows."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1]
        self.k[rows, :, slots] = k.transpose(1, 2).to(self.k.dtype)  # [B, T, H_kv, D] into slots [B, T]
        self.v[rows, :, slots] = v.transpose(1, 2).to(self.v.dtype)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the slots viewed, [B, H_kv, S, D] each, in `dtype`."""
        return self.k.to(dtype), self.v.to(dtype)

    def attend(self, q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, before_rope: torch.Tensor) -> torch.Tensor:
        """Attention of the queries [B, H, T, D] (after RoPE) over the viewed slots: [B, H, T, D].
        `before_rope` (the same queries unrotated) is for views that keep them (a KV policy's)."""
        return sdpa(q, *self.read(q.dtype), mask)

    def slots_read(self) -> list[tuple[torch.Tensor, int]]:
        """The tensors whose size along a dimension is the number of slots read, with that
        dimension (what a compiled step takes as a variable size)."""
        return [(self.k, 2), (self.v, 2)]


def sdpa(
    q: torch.Tensor,  # [B, H, T, D] after RoPE
    k: torch.Tensor,  # [B, H_kv, S, D] one layer's keys, the new ones written
    v: torch.Tensor,  # [B, H_kv, S, D]
    mask: torch.Tensor | None,  # [B, 1, T, S], or [B, H_kv, 1, S] per KV head; None: causal over slots 0..T-1, no padding
) -> torch.Tensor:
    B, H, T, D = q.shape
    if mask is None:
        # SDPA's causal kernel skips the blocks above the diagonal and pairs query heads with
        # their KV head itself.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    # GQA without copying K/V: the G query heads sharing a KV head become G*T query rows.
    H_kv = k.shape[1]
    G = H // H_kv
    if T > 1:
        mask = mask.unsqueeze(2).expand(B, 1, G, T, mask.shape[-1]).reshape(B, 1, G * T, -1)
    out = F.scaled_dot_product_attention(q.reshape(B, H_kv, G * T, D), k, v, attn_mask=mask)  # [B, H_kv, G*T, D]
    return out.view(B, H, T, D)


@dataclass
class KVCache:
    k: torch.Tensor  # [L, B, H_kv, S, D] keys after RoPE
    v: torch.Tensor  # [L, B, H_kv, S, D]
    length: torch.Tensor  # [B] int64 slots in use
    position: torch.Tensor  # [B] int64 absolute position of the next token
    prompt_length: torch.Tensor  # [B] int64 slots holding the prompt (the protected prefix)
    slot_ids: torch.Tensor  # [S] 0..S-1, kept so that the decode step's mask needs no new index tensor
    dtype: torch.dtype  # what the keys and values read back as

    view: ClassVar[type] = RowsView  # what `layers` hands the model, one per layer

    @classmethod
    def allocate(cls, config: ModelConfig, batch: int, n_slots: int, dtype: torch.dtype, device: torch.device) -> "KVCache":
        shape = (config.n_layers, batch, config.n_kv_heads, n_slots, config.head_dim)
        k, v = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        return cls(k, v, *counters(batch, device), torch.arange(n_slots, device=device), dtype)

    @property
    def n_slots(self) -> int:
        return self.slot_ids.shape[0]

    @property
    def device(self) -> torch.device:
        return self.slot_ids.device

    def slot_shape(self) -> tuple[int, int, int, int, int]:
        """(L, B, H_kv, S, D): the slots of every layer and row."""
        return tuple(self.k.shape)

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers())

    @property
    def peak_bytes(self) -> int:
        """Every slot is held for the whole run."""
        return self.nbytes

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor indexed by slot, [L, B, H_kv, S, ...]: what a compaction moves."""
        return [self.k, self.v]

    def layers(self, n_slots: int | None) -> list[RowsView]:
        """Each layer's view of the first n_slots slots of every row (None: the whole buffer), for
        a forward pass: what it writes lands in the cache."""
        k, v = self.k, self.v
        if n_slots is not None:
            k, v = k[:, :, :, :n_slots], v[:, :, :, :n_slots]
        return [self.view(*layer) for layer in zip(k.unbind(0), v.unbind(0))]

    def keys(self, layer: int, n_slots: int) -> torch.Tensor:
        """One layer's keys of the first n_slots slots of every row, [B, H_kv, n_slots, D]."""
        return self.k[layer, :, :, :n_slots].to(self.dtype)

    def all_keys(self) -> torch.Tensor:
        """Every layer's keys of every slot, [L, B, H_kv, S, D]."""
        return self.k.to(self.dtype)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the slots [L, B, H_kv, E], [L, B, H_kv, E, D] each."""
        index = slots[..., None].expand(*slots.shape, self.k.shape[-1])
        return self.k.gather(3, index).to(self.dtype), self.v.gather(3, index).to(self.dtype)

    def compact(self, buffers: list[torch.Tensor], prompt_length: torch.Tensor, keep: torch.Tensor, n_candidates: int, window: int) -> None:
        """Move each (layer, row, KV head)'s kept slots to the front, and the same slots of the
        caller's own per-slot buffers [L, B, H_kv, S, ...] (kv.compaction.compact_in_place)."""
        compact_in_place([*self.buffers(), *buffers], prompt_length, keep, n_candidates, window)

    def fit(self, row: int, n_slots: int) -> None:
        """Before a step: the row is about to hold n_slots slots. Every slot is allocated from the
        start, so this only checks that they fit."""
        if n_slots > self.n_slots:
            raise ValueError(f"a row needs {n_slots} slots but the cache's rows hold {self.n_slots}")

    def row(self, b: int) -> "KVCache":
        """Row b alone, as a cache of one row: views of this one's buffers and counters."""
        rows = slice(b, b + 1)
        return replace(
            self, k=self.k[:, rows], v=self.v[:, rows], length=self.length[rows], position=self.position[rows], prompt_length=self.prompt_length[rows]
        )


def counters(batch: int, device: torch.device) -> list[torch.Tensor]:
    """length, position and prompt_length of every row: zeros, [B] int64 each."""
    return [torch.zeros(batch, dtype=torch.int64, device=device) for _ in range(3)]
