"""What a decode step recalls from the store of demoted slots (engine/kv_store.py).

A compaction demotes the slots it evicts into a store instead of dropping them. The store is cut
into pages, and each page keeps the per-channel minimum and maximum of its keys (as Quest does).
From these, q . k over the page has an upper bound: sum over d of max(q_d * min_d, q_d * max_d).
At each step, each KV group takes the `recall` pages with the highest bound for any of its query
heads. Attention then runs over the cache's slots and those pages' slots in one softmax. Every
shape is static: the number of pages recalled is fixed, and empty slots are masked.
"""

from typing import NamedTuple

import torch

from models.kv_quant import KV, kv_map, kv_read


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
