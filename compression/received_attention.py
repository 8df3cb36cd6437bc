"""The attention every slot receives, recorded inside the decode step with static shapes and no
host sync: H2O's sum, or the maximum that maxattn and a store that drops the least attended
score by. The manager (compression/manager.py) owns the records, moves them with the slots at
each compaction and reads them between steps (the queries: compression/query_buffer.py)."""

import math

import torch

from compression.cache import Cache
from compression.config import CompressionConfig
from models.rope import apply_rope


POLICY_RECORD = {"h2o": "sum", "maxattn": "max"}  # the policies that score by the attention received, and the record each reads


def attention_records(config: CompressionConfig) -> set[str]:
    """The records of the attention each slot receives that the manager keeps for `config`: its
    policy's, and the "max" a store that drops the least attended scores by."""
    records = {POLICY_RECORD[config.policy]} if config.policy in POLICY_RECORD else set()
    return records | ({"max"} if config.store_slots and config.store_drops == "least_attended" else set())


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
