"""What a KV policy records inside the decode step, with static shapes and no host sync: each
step's queries into a ring buffer (beside the position each was issued at), and for H2O the
attention every slot receives. The manager (compression/manager.py) owns the buffers and reads
them between steps."""

import math

import torch

from compression.cache import Cache
from models.rope import apply_rope


def record_query(
    buffer: torch.Tensor, issued_at: torch.Tensor, slot: torch.Tensor, queries: torch.Tensor, positions: torch.Tensor, n_beacon: int, n_recent: int
) -> None:
    """Inside the decode step: write queries [L, B, H, 1, D] at buffer slot `slot` ([1], on the
    device) and the position each row issued them at ([B]) beside them, then advance the slot
    through the ring of recent slots that follows the beacons."""
    buffer.index_copy_(3, slot, queries.to(buffer.dtype))
    issued_at.index_copy_(1, slot - n_beacon, positions[:, None])
    slot.copy_(n_beacon + (slot - n_beacon + 1) % n_recent)


def accumulate_attention(received: torch.Tensor, cache: Cache, queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Inside the decode step, H2O's statistic: add the softmax attention of this step's queries
    [L, B, H, 1, D] (rotated here by cos/sin [B, D] of their position) over the slots in use, the
    new one included, summed over the heads of each KV group, to `received` [L, B, H_kv, S]. The
    new token's slot starts from zero: it may hold an evicted token's sum."""
    L, B, H, _, D = queries.shape
    H_kv, S = cache.k.shape[2], cache.n_slots
    new_slot = cache.length.view(1, B, 1, 1).expand(L, B, H_kv, 1)
    received.scatter_(3, new_slot, 0.0)
    rotated = apply_rope(queries, cos[:, None], sin[:, None])  # [L, B, H, 1, D]: cos/sin broadcast over layers and heads
    grouped = rotated.view(L, B, H_kv, H // H_kv, D).float()
    logits = torch.einsum("lbkgd,lbksd->lbkgs", grouped, cache.all_keys().float()) / math.sqrt(D)  # [L, B, H_kv, G, S]
    readable = torch.arange(S, device=cache.k.device)[None, :] <= cache.length[:, None]  # [B, S]
    logits = logits.masked_fill(~readable[None, :, None, None, :], float("-inf"))
    received += logits.softmax(dim=-1).sum(dim=3)
