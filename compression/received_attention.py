"""H2O's statistic, recorded inside the decode step with static shapes and no host sync: the
attention every slot receives. The manager (compression/manager.py) owns the buffer, moves it with
the slots at each compaction and reads it between steps (the queries: compression/query_buffer.py)."""

import math

import torch

from compression.cache import Cache
from models.rope import apply_rope


def accumulate_attention(received: torch.Tensor, cache: Cache, queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Inside the decode step, H2O's statistic: add the softmax attention of this step's queries
    [L, B, H, 1, D] (rotated here by cos/sin [B, D] of their position) over the slots in use, the
    new one included, summed over the heads of each KV group, to `received` [L, B, H_kv, S]. The
    new token's slot starts from zero: it may hold an evicted token's sum."""
    L, B, H, _, D = queries.shape
    _, _, H_kv, S, _ = cache.slot_shape()
    new_slot = cache.length.view(1, B, 1, 1).expand(L, B, H_kv, 1)
    received.scatter_(3, new_slot, 0.0)
    rotated = apply_rope(queries, cos[:, None], sin[:, None])  # [L, B, H, 1, D]: cos/sin broadcast over layers and heads
    grouped = rotated.view(L, B, H_kv, H // H_kv, D).float()
    logits = torch.einsum("lbkgd,lbksd->lbkgs", grouped, cache.all_keys().float()) / math.sqrt(D)  # [L, B, H_kv, G, S]
    readable = torch.arange(S, device=cache.device)[None, :] <= cache.length[:, None]  # [B, S]
    logits = logits.masked_fill(~readable[None, :, None, None, :], float("-inf"))
    received += logits.softmax(dim=-1).sum(dim=3)
