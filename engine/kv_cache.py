"""The static KV cache: allocated once per run, never resized, compacted in place.

Slots are not positions. Row b holds `length[b]` slots in use; its next token has absolute
position `position[b]`. After a compaction `length` shrinks and `position` does not: RoPE was
applied to the keys before they were stored, so a kept key keeps its rotation.
"""

from dataclasses import dataclass

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
