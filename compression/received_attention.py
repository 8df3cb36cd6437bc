"""The attention every slot receives, recorded inside the decode step with static shapes and no
host sync: H2O's sum and the max-attention policy's maximum. The manager (compression/manager.py) owns the buffer, moves it with
the slots at each compaction and reads it between steps (the queries: compression/query_buffer.py)."""

import math

import torch

from compression.cache import Cache
from errors import UserError
from models.rope import apply_rope

# The policies that score a slot by the attention it has received, and how each combines the steps.
RECEIVED_STATISTIC = {"h2o": "sum", "maxattn": "max"}


def received_statistic(policies: tuple[str, ...]) -> str | None:
    """How the attention received must be recorded for these policy specs to resume from one
    record ("sum", "max" or None); a single record cannot serve both."""
    wanted = {RECEIVED_STATISTIC[p.split(":")[0]] for p in policies if p.split(":")[0] in RECEIVED_STATISTIC}
    if len(wanted) > 1:
        raise UserError("h2o and maxattn each resume from their own record of the attention received: evaluate them in separate runs")
    return wanted.pop() if wanted else None


def accumulate_attention(
    received: torch.Tensor, cache: Cache, queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, how: str
) -> None:
    """Inside the decode step: fold the softmax attention of this step's queries [L, B, H, 1, D]
    (rotated here by cos/sin [B, D] of their position) over the slots in use, the new one included,
    into `received` [L, B, H_kv, S]: "sum" adds it summed over the heads of each KV group (H2O),
    "max" keeps the most any head of the group has paid. The new token's slot starts from zero: it
    may hold an evicted token's record."""
    L, B, H, _, D = queries.shape
    _, _, H_kv, S, _ = cache.slot_shape()
    new_slot = cache.length.view(1, B, 1, 1).expand(L, B, H_kv, 1)
    received.scatter_(3, new_slot, 0.0)
    rotated = apply_rope(queries, cos[:, None], sin[:, None])  # [L, B, H, 1, D]: cos/sin broadcast over layers and heads
    grouped = rotated.view(L, B, H_kv, H // H_kv, D).float()
    logits = torch.einsum("lbkgd,lbksd->lbkgs", grouped, cache.all_keys().float()) / math.sqrt(D)  # [L, B, H_kv, G, S]
    readable = torch.arange(S, device=cache.device)[None, :] <= cache.length[:, None]  # [B, S]
    logits = logits.masked_fill(~readable[None, :, None, None, :], float("-inf"))
    weights = logits.softmax(dim=-1)  # [L, B, H_kv, G, S]
    if how == "sum":
        received += weights.sum(dim=3)
    else:
        received.copy_(torch.maximum(received, weights.amax(dim=3)))
