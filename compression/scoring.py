"""What the policies share: queries rotated to now, per-head attention over candidate keys, pooling."""

import math

import torch
import torch.nn.functional as F

from models.rope import apply_rope


def rotate_to_position(queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE for one position per row to every buffered query: [B, H, Q, D] with cos/sin [B, D]."""
    B, _, Q, D = queries.shape
    return apply_rope(queries, cos[:, None, :].expand(B, Q, D), sin[:, None, :].expand(B, Q, D))


def attention_logits(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Scaled dot products [B, H_kv, G, Q, C] of queries [B, H, Q, D] with keys [B, H_kv, C, D].

    Query head h reads KV head h // G (G = H / H_kv), as in the attention itself; the G heads of a
    group stay a separate axis so the policy chooses how to aggregate them.
    """
    B, H, Q, D = queries.shape
    H_kv = keys.shape[1]
    grouped = queries.float().view(B, H_kv, H // H_kv, Q, D)
    return torch.einsum("bkgqd,bkcd->bkgqc", grouped, keys.float()) / math.sqrt(D)


def aggregate(logits: torch.Tensor, how: str, top_m: int = 4, heads_agree: int = 1) -> torch.Tensor:
    """Combine [B, H_kv, G, Q, C] over the group's heads and the queries into [B, H_kv, C].

    heads_agree 1: every (head, query) pair of the group votes together. heads_agree n > 1: each
    head combines its own queries, and a key scores what its n-th most interested head gives it,
    so a key that a single head wants does not survive on that alone. A group of fewer than n
    heads needs all of them (with one head per group, as in multi-head attention, that is 1)."""
    agreeing = min(heads_agree, logits.shape[2])
    if agreeing > 1:
        per_head = _combine(logits, 3, how, top_m)  # [B, H_kv, G, C]
        return per_head.topk(agreeing, dim=2).values[:, :, -1]
    return _combine(logits.flatten(2, 3), 2, how, top_m)  # [B, H_kv, G*Q, C] -> [B, H_kv, C]


def _combine(scores: torch.Tensor, dim: int, how: str, top_m: int) -> torch.Tensor:
    if how == "max":
        return scores.amax(dim)
    if how == "mean":
        return scores.mean(dim)
    return scores.topk(min(top_m, scores.shape[dim]), dim=dim).values.mean(dim)  # "topm": softer than max, sharper than mean


def pool(scores: torch.Tensor, kernel: int, how: str) -> torch.Tensor:
    """Smooth [B, H_kv, C] along the keys so that neighbours of a strong key survive with it."""
    B, H_kv, C = scores.shape
    flat = scores.reshape(B * H_kv, 1, C)
    pooled = F.max_pool1d(flat, kernel, 1, kernel // 2) if how == "max" else F.avg_pool1d(flat, kernel, 1, kernel // 2, count_include_pad=False)
    return pooled.view(B, H_kv, C)
