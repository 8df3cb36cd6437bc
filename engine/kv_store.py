"""The store: where a compaction demotes the slots it evicts, instead of dropping them.

Each (layer, row, KV head) has N store slots in pages of STORE_PAGE, holding demoted keys and
values (int4 by default: models/kv_quant.py) and the positions they held. Each page keeps a
summary, the per-channel minimum and maximum of its keys, so that a decode step can pick the
pages it may need (models/recall.py). The store is a ring: once it is full, a demotion overwrites
the oldest slots. It is allocated once and written in place, so its memory is bounded, and a
compiled step or a CUDA graph keeps pointing at it.
"""

from dataclasses import dataclass, replace

import torch

from compression.config import STORE_PAGE, CompressionConfig
from models.config import ModelConfig
from models.kv_quant import KV, allocate_keys_and_values, kv_map, kv_nbytes, kv_read, kv_storage, kv_store, kv_unbind
from models.recall import StoreLayer


@dataclass
class KVStore:
    k: KV  # [L, B, H_kv, N, D] demoted keys after RoPE
    v: KV  # [L, B, H_kv, N, D]
    positions: torch.Tensor  # [L, B, H_kv, N] int64: the position each demoted slot held
    low: torch.Tensor  # [L, B, H_kv, N / STORE_PAGE, D] float32: each page's smallest key per channel (0 when empty)
    high: torch.Tensor  # [L, B, H_kv, N / STORE_PAGE, D] float32: its largest
    filled: torch.Tensor  # [B, N] bool: the store slots holding a token
    next: torch.Tensor  # [B] int64, on the host: the slot the next demotion starts at
    recall: int  # pages each KV group recalls per step

    @classmethod
    def allocate(
        cls, config: ModelConfig, batch: int, n_slots: int, store_dtype: str, model_dtype: torch.dtype, recall: int, device: torch.device
    ) -> "KVStore":
        dtype, bits = kv_storage(store_dtype, model_dtype)
        shape = (config.n_layers, batch, config.n_kv_heads, n_slots, config.head_dim)
        pages = (config.n_layers, batch, config.n_kv_heads, n_slots // STORE_PAGE, config.head_dim)
        return cls(
            *allocate_keys_and_values(shape, dtype, bits, device),
            torch.zeros(shape[:-1], dtype=torch.int64, device=device),
            torch.zeros(pages, dtype=torch.float32, device=device),
            torch.zeros(pages, dtype=torch.float32, device=device),
            torch.zeros(batch, n_slots, dtype=torch.bool, device=device),
            torch.zeros(batch, dtype=torch.int64),
            recall,
        )

    @classmethod
    def for_compression(cls, config: ModelConfig, batch: int, compression: CompressionConfig, model_dtype: torch.dtype, device: torch.device) -> "KVStore | None":
        """The store a compression config asks for (--kv-store), or None."""
        if not compression.store_slots:
            return None
        return cls.allocate(config, batch, compression.store_slots, compression.store_dtype, model_dtype, compression.recall_pages, device)

    @property
    def n_slots(self) -> int:
        return self.filled.shape[1]

    @property
    def nbytes(self) -> int:
        """Keys, values, their scales and the page summaries (the positions are bookkeeping)."""
        return kv_nbytes(self.k) + kv_nbytes(self.v) + self.low.nbytes + self.high.nbytes

    def layers(self) -> list[StoreLayer]:
        return [StoreLayer(k, v, low, high, self.filled, self.recall) for k, v, low, high in zip(kv_unbind(self.k), kv_unbind(self.v), self.low, self.high)]

    def row(self, b: int) -> "KVStore":
        """Row b alone: views of this store's buffers and cursor."""
        rows = slice(b, b + 1)
        k, v = (kv_map(kv, lambda t: t[:, rows]) for kv in (self.k, self.v))
        return replace(
            self, k=k, v=v, positions=self.positions[:, rows], low=self.low[:, rows], high=self.high[:, rows],
            filled=self.filled[rows], next=self.next[rows],
        )

    def demote(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Take in the evicted slots of every row: keys and values [L, B, H_kv, E, D], the same
        count E for every row, and their positions [L, B, H_kv, E]. Past the ring's size, the
        oldest are overwritten (of E > N, only the last N stay)."""
        N = self.n_slots
        E = min(k.shape[3], N)
        k, v, positions = k[..., -E:, :], v[..., -E:, :], positions[..., -E:]
        B = self.filled.shape[0]
        slots = ((self.next[:, None] + torch.arange(E)) % N).to(self.filled.device)  # [B, E]
        rows = torch.arange(B, device=slots.device)[:, None]  # [B, 1]
        for layer in range(k.shape[0]):
            index = (layer, rows, slice(None), slots)  # [B, E, H_kv, ...] into slots [B, E]
            kv_store(self.k, index, k[layer].transpose(1, 2))
            kv_store(self.v, index, v[layer].transpose(1, 2))
            self.positions[index] = positions[layer].transpose(1, 2)
        self.filled[rows, slots] = True
        self.next.copy_((self.next + E) % N)
        self._summarize()

    def _summarize(self) -> None:
        """Every page's per-channel minimum and maximum key, over the slots it holds."""
        L, B, H_kv, n_pages, D = self.low.shape
        keys = kv_read(self.k, torch.float32).view(L, B, H_kv, n_pages, STORE_PAGE, D)
        filled = self.filled.view(1, B, 1, n_pages, STORE_PAGE, 1)
        held = filled.any(-2)  # [1, B, 1, n_pages, 1]
        self.low.copy_(torch.where(filled, keys, float("inf")).amin(-2).where(held, 0.0))
        self.high.copy_(torch.where(filled, keys, float("-inf")).amax(-2).where(held, 0.0))

    def reset(self) -> None:
        """Empty (a new prompt in this row, a new conversation)."""
        self.filled.fill_(False)
        self.next.zero_()
        self.low.zero_()
        self.high.zero_()
