"""Farthest-point sampling by cosine similarity: pick a few queries that cover all directions."""

import torch


def farthest_point_sampling(points: torch.Tensor, k: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Indices [..., k] of k points chosen from points [..., N, D], batched over the leading dims.

    Start with the point least similar on average to the others; then repeatedly add the point
    whose highest similarity to the chosen ones is lowest. Points where valid [..., N] is False
    are never chosen; when fewer than k are valid, chosen points repeat.
    """
    unit = torch.nn.functional.normalize(points.float(), dim=-1)  # [..., N, D]
    if valid is None:
        valid = torch.ones(unit.shape[:-1], dtype=torch.bool, device=unit.device)
    valid = valid.expand(unit.shape[:-1])
    unit = unit * valid.unsqueeze(-1)  # invalid points add nothing to the mean
    # Highest similarity to a chosen point so far; an invalid point is never the least similar.
    closest = torch.full(unit.shape[:-1], -float("inf"), device=unit.device).masked_fill(~valid, float("inf"))
    # Mean similarity to all points = dot with the summed vector: no N x N matrix is built.
    summed_similarity = (unit @ unit.sum(-2, keepdim=True).transpose(-1, -2)).squeeze(-1)  # [..., N]
    chosen = [summed_similarity.masked_fill(~valid, float("inf")).argmin(-1)]
    while len(chosen) < k:
        closest = torch.maximum(closest, _similarity_to(unit, chosen[-1]))
        chosen.append(closest.argmin(-1))
    return torch.stack(chosen, dim=-1)


def _similarity_to(unit: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Cosine similarity [..., N] of every point to the point `index` [...] names."""
    newest = unit.gather(-2, index[..., None, None].expand(*unit.shape[:-2], 1, unit.shape[-1]))  # [..., 1, D]
    return (unit * newest).sum(-1)


def farthest_queries(candidates: torch.Tensor, k: int, n_kv_heads: int | None = None, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The k farthest points among each head's queries, candidates [..., H, N, D] -> [..., H, k, D].

    With n_kv_heads, one FPS per KV group on its heads' queries side by side: every head of a
    group takes the same steps. valid [..., 1 or H, N] as farthest_point_sampling's."""
    if n_kv_heads is None:
        picks = farthest_point_sampling(candidates, k, valid)  # [..., H, k]
    else:
        H = candidates.shape[-3]
        grouped = candidates.unflatten(-3, (n_kv_heads, H // n_kv_heads)).transpose(-3, -2).flatten(-2)  # [..., H_kv, N, G x D]
        picks = farthest_point_sampling(grouped, k, valid).repeat_interleave(H // n_kv_heads, dim=-2)
    return candidates.gather(-2, picks[..., None].expand(*picks.shape, candidates.shape[-1]))
