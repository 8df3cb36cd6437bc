"""The scoring rule of each policy. Every rule maps the same inputs to one score per candidate
key, [B, H_kv, C]; the manager keeps the best-scoring candidates and compacts the cache, so the
policies differ here and nowhere else."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from compression.config import CompressionConfig
from compression.scoring import aggregate, attention_logits, pool


@dataclass
class ScoringInputs:
    beacons: torch.Tensor  # [B, H, n_beacon, D] BeaconKV's beacon queries, rotated to the current position
    recent: torch.Tensor  # [B, H, R, D] the most recent queries, oldest first, each rotated to the position it was issued at
    keys: torch.Tensor  # [B, H_kv, C, D] the candidate keys, oldest first
    context: torch.Tensor  # [B, H_kv, S, D] every key in the cache: prompt, candidates, window
    visible: torch.Tensor  # [B, H_kv, R, S] bool: the keys each recent query could read when it was issued
    in_use: torch.Tensor  # [B, S] bool: the context slots that hold a key (rows of a batch differ in length)
    candidate_slots: torch.Tensor  # [B, C] where the candidates sit in `context`
    config: CompressionConfig
    generator: torch.Generator
    received: torch.Tensor | None = None  # [B, H_kv, C] H2O, maxattn: the attention each candidate has received so far
    kv_heads: tuple[int, int] | None = None  # tensor parallelism: the model's KV head the keys' first one is, and the model's count


def beacon(x: ScoringInputs) -> torch.Tensor:
    """BeaconKV: beacons (clusters of past queries) and recent queries vote; by default a key
    scores the votes of its group's second most interested head."""
    logits = attention_logits(torch.cat([x.beacons, x.recent], dim=2), x.keys)  # [B, H_kv, G, n_beacon + R, C]
    return aggregate(logits, x.config.aggregation, x.config.top_m, x.config.heads_agree)


def attention_weights(x: ScoringInputs) -> torch.Tensor:
    """The attention [B, H_kv, G, R, C] each recent query paid to each candidate, its softmax taken,
    as the papers take it, over every key it could read when it was issued (prompt and window too)."""
    logits = attention_logits(x.recent, x.context).masked_fill(~x.visible[:, :, None], float("-inf"))  # [B, H_kv, G, R, S]
    weights = logits.softmax(dim=-1)
    C = x.candidate_slots.shape[1]
    return weights.gather(-1, x.candidate_slots[:, None, None, None, :].expand(*weights.shape[:4], C))


def rpc(x: ScoringInputs) -> torch.Tensor:
    """Reasoning Path Compression: mean attention of the recent queries (the selector window), average-pooled."""
    return pool(attention_weights(x).mean(dim=(2, 3)), kernel=7, how="mean")


def snapkv(x: ScoringInputs) -> torch.Tensor:
    """SnapKV: attention summed over the observation window, averaged over the group, max-pooled."""
    return pool(attention_weights(x).sum(dim=3).mean(dim=2), kernel=7, how="max")


def tova(x: ScoringInputs) -> torch.Tensor:
    """TOVA: the attention of the newest query alone, averaged over the group."""
    return attention_weights(x)[:, :, :, -1].mean(dim=2)


def rkv(x: ScoringInputs, mix: float = 0.07, threshold: float = 0.5) -> torch.Tensor:
    """R-KV, as its reference code scores: mix x importance - (1 - mix) x redundancy.

    Importance: each recent query's logits, max over the group's heads, softmax over the keys it
    could read outside the protected window, mean over the queries, max-pooled. Redundancy: a
    key's mean cosine similarity to every key in the cache, softmax-normalised, where each key
    leaves out of its row the newest key more similar to it than `threshold` (that one is the
    copy worth keeping)."""
    window_start = x.candidate_slots[:, -1:] + 1  # [B, 1]
    S = x.context.shape[2]
    slots = torch.arange(S, device=x.context.device)
    outside_window = slots[None, :] < window_start  # [B, S]
    logits = attention_logits(x.recent, x.context).amax(dim=2)  # [B, H_kv, R, S]
    logits = logits.masked_fill(~(x.visible & outside_window[:, None, None, :]), float("-inf"))
    weights = logits.softmax(dim=-1).mean(dim=2)  # [B, H_kv, S]
    C = x.candidate_slots.shape[1]
    candidates = x.candidate_slots[:, None, :].expand(*weights.shape[:2], C)
    importance = pool(weights.gather(2, candidates), kernel=7, how="max")

    unit = torch.nn.functional.normalize(x.context.float(), dim=-1, eps=1e-8)
    similarity = unit @ unit.transpose(-1, -2)  # [B, H_kv, S, S]
    pair_in_use = x.in_use[:, None, :, None] & x.in_use[:, None, None, :]
    similarity = similarity.masked_fill(~pair_in_use | torch.eye(S, dtype=torch.bool, device=slots.device), 0.0)
    newest_similar = torch.where(similarity > threshold, slots, 0).amax(dim=-1, keepdim=True)  # [B, H_kv, S, 1]
    similarity = similarity.scatter(-1, newest_similar, 0.0)
    n_in_use = x.in_use.sum(dim=-1).view(-1, 1, 1)
    redundancy = (similarity.sum(dim=-2) / n_in_use).masked_fill(~x.in_use[:, None, :], float("-inf")).softmax(dim=-1)
    return mix * importance - (1 - mix) * redundancy.gather(2, candidates)


def attention_received(x: ScoringInputs) -> torch.Tensor:
    """The attention a key has received from every query since it was written, recorded inside the
    decode step: H2O (heavy hitters) scores its sum; maxattn, query-agnostic in the spirit of KVzip,
    its maximum over the steps and the group's heads. KVzip takes that maximum over a pass that
    re-reads the whole context; here the context's own queries stand in for it."""
    return x.received


def streaming(x: ScoringInputs) -> torch.Tensor:
    """StreamingLLM: the prompt (the attention sinks) and the newest tokens; the oldest go first."""
    B, H_kv, C, _ = x.keys.shape
    return torch.arange(C, dtype=torch.float32, device=x.keys.device).expand(B, H_kv, C)


def random(x: ScoringInputs) -> torch.Tensor:
    """Uniformly random eviction: the floor every informed policy must beat."""
    B, H_kv, C, _ = x.keys.shape
    first, total = x.kv_heads or (0, H_kv)  # every rank draws for all the model's KV heads, as one process would, and takes its own
    drawn = torch.rand(B, total, C, generator=x.generator, device="cpu")[:, first : first + H_kv]
    return drawn.to(x.keys.device)


SCORERS: dict[str, Callable[[ScoringInputs], torch.Tensor]] = {
    "beacon": beacon,
    "streaming": streaming,
    "rpc": rpc,
    "snapkv": snapkv,
    "tova": tova,
    "rkv": rkv,
    "h2o": attention_received,
    "maxattn": attention_received,
    "random": random,
}
