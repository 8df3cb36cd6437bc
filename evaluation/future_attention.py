"""Task 2, future-attention recall: the attention of the queries that follow a compaction,
computed offline with the full cache, and the share of it that lands on the positions kept."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from compression.manager import QueryTap
from engine.decode import prefill
from kv.cache import KVCache
from evaluation.runs import CPU, Compaction
from models.rope import apply_rope
from models.transformer import Transformer


class _QueryCatcher:
    """Stands in for the compression manager in prefill, to keep every layer's queries it is handed."""

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.queries: torch.Tensor | None = None  # [L, B, H, P, D]

    def seed_layer(self, layer: int, queries: torch.Tensor, prompt_lengths: torch.Tensor) -> None:
        if self.queries is None:
            self.queries = torch.empty(self.n_layers, *queries.shape, dtype=torch.float32)
        self.queries[layer] = queries

    def prefill_views(self, layers: list, prompt_lengths: torch.Tensor, fresh: bool) -> list[QueryTap]:
        return [QueryTap(layer, partial(self.seed_layer, i, prompt_lengths=prompt_lengths)) for i, layer in enumerate(layers)]

    def prefilled(self, n_new: list[int], fresh: bool) -> None:
        """The streams are kept whole."""


@dataclass
class FullAttention:
    """Pre-RoPE queries [L, B, H, P, D] and post-RoPE keys [L, B, H_kv, P, D] of whole streams."""

    queries: torch.Tensor
    keys: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    lengths: torch.Tensor  # [B] tokens per stream

    @classmethod
    def of(cls, model: Transformer, sequences: list[list[int]]) -> FullAttention:
        cache = KVCache.allocate(model.config, len(sequences), max(map(len, sequences)), model.dtype, CPU)
        catcher = _QueryCatcher(model.config.n_layers)
        prefill(model, cache, sequences, policy=catcher)
        return cls(catcher.queries, cache.k.float(), model.rope_cos, model.rope_sin, cache.length.clone())

    def probabilities(self, first: torch.Tensor, n_queries: int) -> torch.Tensor:
        """softmax(q_rot . k / sqrt(D)) [L, B, H_kv, G, K, P] of the queries at positions
        first .. first + K - 1 (first: [B]) over the positions up to each query's own."""
        L, B, H, P, D = self.queries.shape
        H_kv = self.keys.shape[2]
        at = first[:, None] + torch.arange(n_queries)  # [B, K]
        q = self.queries.gather(3, at[None, :, None, :, None].expand(L, B, H, n_queries, D))
        q = apply_rope(q, self.rope_cos[at], self.rope_sin[at])  # cos/sin [B, K, D] broadcast over L and H
        q = q.view(L, B, H_kv, H // H_kv, n_queries, D)  # query head h reads KV head h // G
        logits = torch.einsum("lbkgqd,lbkpd->lbkgqp", q, self.keys) / math.sqrt(D)
        visible = torch.arange(P)[None, None, :] <= at[:, :, None]  # [B, K, P]
        return logits.masked_fill(~visible[None, :, None, None], float("-inf")).softmax(-1)


def attention_recall(probabilities: torch.Tensor, kept: torch.Tensor, region: torch.Tensor) -> torch.Tensor:
    """Share of each query's attention inside `region` [B, P] that falls on `kept` positions
    [L, B, H_kv, P]: [L, B, H_kv, G, K] for probabilities [L, B, H_kv, G, K, P]."""
    inside = probabilities * region[None, :, None, None, None, :]
    return (inside * kept[:, :, :, None, None, :]).sum(-1) / inside.sum(-1).clamp_min(1e-30)


@dataclass
class RecallShares:
    context: float  # share of the attention on all positions before the compaction
    evictable: float  # the same on the positions between the prompt and the recent window
    n_compactions: int


def future_attention_recall(full: FullAttention, compactions: list[Compaction], rows: list[int], prompt_lengths: torch.Tensor, window: int, n_queries: int) -> RecallShares:
    """Mean over compactions, the given rows (of the batch, and of `full` in that order), layers,
    query heads and the next n_queries queries."""
    context, evictable = [], []
    for c in compactions:
        if c.kept is None:
            continue  # not one of the sampled compactions
        next_position = c.next_position[rows]
        if bool((next_position + n_queries > full.lengths).any()):
            continue  # fewer than n_queries queries follow
        probs = full.probabilities(next_position, n_queries)
        positions = torch.arange(probs.shape[-1])[None, :]
        old = positions < next_position[:, None]  # [B, P]
        middle = old & (positions >= prompt_lengths[rows, None]) & (positions < (next_position - window)[:, None])
        kept = c.kept[:, rows, :, : probs.shape[-1]]
        context.append(attention_recall(probs, kept, old).mean())
        evictable.append(attention_recall(probs, kept, middle).mean())
    if not context:
        return RecallShares(float("nan"), float("nan"), 0)
    return RecallShares(torch.stack(context).mean().item(), torch.stack(evictable).mean().item(), len(context))


def full_cache_compactions(like: list[Compaction]) -> list[Compaction]:
    """The full cache seen at the moments of another run's compactions: every past position is kept."""
    out = []
    for c in like:
        if c.kept is not None:
            P = c.kept.shape[-1]
            kept = (torch.arange(P)[None, :] < c.next_position[:, None])[None, :, None, :].expand_as(c.kept)
            out.append(Compaction(c.step, c.next_position, torch.ones_like(c.watched), kept))
    return out
