"""The store: where a compaction demotes the slots it evicts, instead of dropping them.

Each (layer, row, KV head) has N store slots in pages of STORE_PAGE, holding demoted keys and
values (int4 by default: kv/quantized.py) and the positions they held. Each page keeps a
summary, the per-channel minimum and maximum of its keys, so that a decode step can pick the
pages it may need (`recall`, below). Once it is full, a demotion overwrites the oldest slots (a
ring), or, for a store that keeps a score per slot, the lowest-scored ones where the newcomers
score higher (per layer, row and KV head). It is allocated once and written in place, so its
memory is bounded, and a compiled step or a CUDA graph keeps pointing at it.
"""

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from kv import STORE_PAGE
from kv.cache import sdpa
from kv.quantized import KV, allocate_keys_and_values, kv_map, kv_nbytes, kv_read, kv_storage, kv_store, kv_unbind
from models.config import ModelConfig
from models.transformer import LayerKV

# What a decode step recalls: each page keeps the per-channel minimum and maximum of its keys (as
# Quest does). From these, q . k over the page has an upper bound: sum over d of
# max(q_d * min_d, q_d * max_d). At each step, each KV group takes the `recall` pages with the
# highest bound for any of its query heads, and attends over the cache's slots and those pages'
# slots in one softmax. Every shape is static: the number of pages recalled is fixed, and empty
# slots are masked.


class StoreLayer(NamedTuple):
    """One layer of the store, as a forward pass reads it."""

    k: KV  # [B, H_kv, N, D] demoted keys after RoPE (codes or floats)
    v: KV  # [B, H_kv, N, D]
    low: torch.Tensor  # [B, H_kv, n_pages, D] float32: each page's smallest key, per channel (0 for an empty page)
    high: torch.Tensor  # [B, H_kv, n_pages, D] float32: its largest
    filled: torch.Tensor  # [B, N] bool: the slots holding a demoted token
    recall: int  # pages each KV group recalls per step


def page_bound(q: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """The highest q . k can be for a key of each page: q [B, H, D] against low/high
    [B, H_kv, n_pages, D] -> [B, H, n_pages] (query head h reads KV head h // G)."""
    B, H, D = q.shape
    H_kv = low.shape[1]
    grouped = q.float().view(B, H_kv, H // H_kv, 1, D)  # [B, H_kv, G, 1, D]
    bound = torch.maximum(grouped * low[:, :, None], grouped * high[:, :, None]).sum(-1)  # [B, H_kv, G, n_pages]
    return bound.flatten(1, 2)


def recall(store: StoreLayer, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For one step's queries q [B, H, 1, D]: the recalled keys and values [B, H_kv, R, D] in q's
    dtype and which of them hold a token, [B, H_kv, 1, R] (R = recall x page slots)."""
    B, H, _, D = q.shape
    H_kv, n_pages = store.low.shape[1], store.low.shape[2]
    page = store.filled.shape[1] // n_pages
    held = store.filled.view(B, 1, n_pages, page).any(-1)  # [B, 1, n_pages]
    bound = page_bound(q[:, :, 0], store.low, store.high).view(B, H_kv, H // H_kv, n_pages).amax(2)  # [B, H_kv, n_pages]
    pages = bound.masked_fill(~held, float("-inf")).topk(store.recall, dim=-1).indices  # [B, H_kv, recall]
    slots = (pages[..., None] * page + torch.arange(page, device=q.device)).flatten(-2)  # [B, H_kv, R]

    def gather(part: torch.Tensor) -> torch.Tensor:
        return part.gather(2, slots[..., None].expand(*slots.shape, part.shape[-1]))

    k, v = (kv_read(kv_map(kv, gather), q.dtype) for kv in (store.k, store.v))
    mask = store.filled[:, None].expand(B, H_kv, -1).gather(2, slots)[:, :, None]  # [B, H_kv, 1, R]
    return k, v, mask


class RecallView(NamedTuple):
    """A layer's view of the cache (any kind) that, in a decode step, also attends over the pages
    it recalls from the store."""

    inner: LayerKV  # the cache kind's own view of the layer
    store: StoreLayer

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.inner.write(k, v, slots)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.read(dtype)

    def attend(self, q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, before_rope: torch.Tensor) -> torch.Tensor:
        if q.shape[2] != 1:  # a prefill recalls nothing
            return self.inner.attend(q, slots, mask, before_rope)
        k, v = self.inner.read(q.dtype)
        recalled_k, recalled_v, recalled = recall(self.store, q)
        k, v = torch.cat([k, recalled_k], dim=2), torch.cat([v, recalled_v], dim=2)
        B, H_kv = recalled.shape[:2]
        resident = torch.ones(B, 1, 1, k.shape[2] - recalled.shape[3], dtype=torch.bool, device=q.device) if mask is None else mask
        mask = torch.cat([resident.expand(B, H_kv, 1, -1), recalled], dim=3)  # [B, H_kv, 1, S + R]
        return sdpa(q, k, v, mask)

    def slots_read(self) -> list[tuple[torch.Tensor, int]]:
        return self.inner.slots_read()


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
    score: torch.Tensor | None = None  # [L, B, H_kv, N] float32: what each slot scored when demoted; None for a ring

    @classmethod
    def allocate(
        cls, config: ModelConfig, batch: int, n_slots: int, store_dtype: str, model_dtype: torch.dtype, recall: int, device: torch.device,
        scored: bool = False,
    ) -> "KVStore":
        dtype, bits, group = kv_storage(store_dtype, model_dtype)
        shape = (config.n_layers, batch, config.n_kv_heads, n_slots, config.head_dim)
        pages = (config.n_layers, batch, config.n_kv_heads, n_slots // STORE_PAGE, config.head_dim)
        return cls(
            *allocate_keys_and_values(shape, dtype, bits, device, rotate_keys=not config.qkv_bias, group=group),
            torch.zeros(shape[:-1], dtype=torch.int64, device=device),
            torch.zeros(pages, dtype=torch.float32, device=device),
            torch.zeros(pages, dtype=torch.float32, device=device),
            torch.zeros(batch, n_slots, dtype=torch.bool, device=device),
            torch.zeros(batch, dtype=torch.int64),
            recall,
            torch.zeros(shape[:-1], dtype=torch.float32, device=device) if scored else None,
        )

    def views(self, layers: list[LayerKV]) -> list[RecallView]:
        """The cache's views of each layer, each recalling from this store's layer."""
        return [RecallView(layer, store) for layer, store in zip(layers, self.layers())]

    @property
    def n_slots(self) -> int:
        return self.filled.shape[1]

    @property
    def nbytes(self) -> int:
        """Keys, values, their scales, the page summaries and the scores (the positions are bookkeeping)."""
        scores = 0 if self.score is None else self.score.nbytes
        return kv_nbytes(self.k) + kv_nbytes(self.v) + self.low.nbytes + self.high.nbytes + scores

    def layers(self) -> list[StoreLayer]:
        return [StoreLayer(k, v, low, high, self.filled, self.recall) for k, v, low, high in zip(kv_unbind(self.k), kv_unbind(self.v), self.low, self.high)]

    def row(self, b: int) -> "KVStore":
        """Row b alone: views of this store's buffers and cursor."""
        rows = slice(b, b + 1)
        k, v = (kv_map(kv, lambda t: t[:, rows]) for kv in (self.k, self.v))
        return replace(
            self, k=k, v=v, positions=self.positions[:, rows], low=self.low[:, rows], high=self.high[:, rows],
            filled=self.filled[rows], next=self.next[rows], score=None if self.score is None else self.score[:, rows],
        )

    def demote(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor | None = None) -> None:
        """Take in the evicted slots of every row: keys and values [L, B, H_kv, E, D], the same
        count E for every row, their positions [L, B, H_kv, E] and, for a scored store, their
        scores [L, B, H_kv, E]. A ring overwrites its oldest slots (of E > N, only the last N
        stay); a full scored store keeps the N best-scored of what it holds and the newcomers."""
        if self.score is None:
            self._append(k, v, positions)
        else:
            for start in range(0, k.shape[3], self.n_slots):
                chunk = slice(start, start + self.n_slots)
                self._take_best(k[..., chunk, :], v[..., chunk, :], positions[..., chunk], scores[..., chunk])
        self._summarize()

    def _take_best(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor) -> None:
        """E <= N newcomers: the first fill the empty slots in order; each of the rest replaces one
        of the weakest slots held, the strongest newcomer the weakest slot, wherever it scores higher
        (which keeps the N best of the two sets)."""
        n_empty = self.n_slots - int(self.filled.sum(dim=1).max())
        if n_empty:
            self._append(k[..., :n_empty, :], v[..., :n_empty, :], positions[..., :n_empty], scores[..., :n_empty])
        k, v, positions, scores = k[..., n_empty:, :], v[..., n_empty:, :], positions[..., n_empty:], scores[..., n_empty:]
        if scores.shape[-1] == 0:
            return
        ranked, order = scores.sort(dim=-1, descending=True)  # [L, B, H_kv, R]
        weakest, targets = self.score.topk(scores.shape[-1], dim=-1, largest=False)  # ascending
        layer, row, head, rank = (ranked > weakest).nonzero(as_tuple=True)  # the pairs where the newcomer wins
        index, newcomer = (layer, row, head, targets[layer, row, head, rank]), (layer, row, head, order[layer, row, head, rank])
        kv_store(self.k, index, k[newcomer])
        kv_store(self.v, index, v[newcomer])
        self.positions[index] = positions[newcomer]
        self.score[index] = scores[newcomer]

    def _append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor | None = None) -> None:
        """Write E slots in order from the ring's cursor, over its oldest (of E > N, the last N)."""
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
            if scores is not None:
                self.score[index] = scores[layer, ..., -E:].transpose(1, 2)
        self.filled[rows, slots] = True
        self.next.copy_((self.next + E) % N)

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
