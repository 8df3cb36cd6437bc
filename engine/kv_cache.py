"""The static KV cache: allocated once per run, never resized, compacted in place.

Slots are not positions. Row b holds `length[b]` slots in use; its next token has absolute
position `position[b]`. After a compaction `length` shrinks and `position` does not: RoPE was
applied to the keys before they were stored, so a kept key keeps its rotation.
"""

from dataclasses import dataclass, replace

import torch

from models.config import ModelConfig


@dataclass
class KVCache:
    k: torch.Tensor  # [L, B, H_kv, S, D] keys after RoPE
    v: torch.Tensor  # [L, B, H_kv, S, D]
    length: torch.Tensor  # [B] int64 slots in use
    position: torch.Tensor  # [B] int64 absolute position of the next token
    prompt_length: torch.Tensor  # [B] int64 slots holding the prompt (the protected prefix)
    slot_ids: torch.Tensor  # [S] 0..S-1, kept so that the decode step's mask needs no new index tensor
    block_table = None  # the contiguous cache has none; the paged one's maps slots to blocks (engine/paged_cache.py)

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

    def view(self, n_slots: int | None) -> tuple[torch.Tensor, torch.Tensor, None]:
        """What attention reads for the first n_slots slots of each row (None: the whole buffer)."""
        if n_slots is None:
            return self.k, self.v, None
        return self.k[:, :, :, :n_slots], self.v[:, :, :, :n_slots], None

    def row(self, b: int) -> "KVCache":
        """Row b alone, as a cache of one row: views of this one's buffers and counters."""
        rows = slice(b, b + 1)
        return replace(self, k=self.k[:, rows], v=self.v[:, rows], length=self.length[rows], position=self.position[rows], prompt_length=self.prompt_length[rows])
