"""Farthest-point sampling by cosine similarity: pick a few queries that cover all directions."""

import torch


def farthest_point_sampling(
    points: torch.Tensor, k: int, valid: torch.Tensor | None = None, density_m: int = 0, start: torch.Tensor | None = None
) -> torch.Tensor:
    """Indices [..., k] of k points chosen from points [..., N, D], batched over the leading dims.

    Start with the point least similar on average to the others (or with the points `start`
    [..., u] names, which come first in the result); then repeatedly add the point whose highest
    similarity to the chosen ones is lowest. With density_m > 0 each point's distance
    (1 - similarity) is weighted by its local density, so that an isolated outlier is not chosen
    for being far from everything. Points where valid [..., N] is False are never chosen; when
    fewer than k are valid, chosen points repeat.
    """
    unit = torch.nn.functional.normalize(points.float(), dim=-1)  # [..., N, D]
    if valid is None:
        valid = torch.ones(unit.shape[:-1], dtype=torch.bool, device=unit.device)
    valid = valid.expand(unit.shape[:-1])
    unit = unit * valid.unsqueeze(-1)  # invalid points add nothing to the mean
    density = local_density(unit, valid, density_m) if density_m else None
    if density is None:  # highest similarity to a chosen point so far; an invalid point is never the least similar
        closest = torch.full(unit.shape[:-1], -float("inf"), device=unit.device).masked_fill(~valid, float("inf"))
    else:
        closest = torch.full(unit.shape[:-1], -1.0, device=unit.device)
    if start is None:
        # Mean similarity to all points = dot with the summed vector: no N x N matrix is built.
        summed_similarity = (unit @ unit.sum(-2, keepdim=True).transpose(-1, -2)).squeeze(-1)  # [..., N]
        if density is not None:
            distance = 1 - summed_similarity / valid.sum(-1, keepdim=True).clamp_min(1)
            first = (distance * density).masked_fill(~valid, -float("inf")).argmax(-1)
        else:
            first = summed_similarity.masked_fill(~valid, float("inf")).argmin(-1)
        start = first[..., None]
    chosen = list(start.unbind(-1))
    for newest_index in chosen[:-1]:
        closest = torch.maximum(closest, _similarity_to(unit, newest_index))
    while len(chosen) < k:
        closest = torch.maximum(closest, _similarity_to(unit, chosen[-1]))
        chosen.append(_farthest_from(closest, density, valid))
    return torch.stack(chosen, dim=-1)


def _farthest_from(closest: torch.Tensor, density: torch.Tensor | None, valid: torch.Tensor) -> torch.Tensor:
    """The next pick [...]: the lowest highest-similarity, or with densities the largest distance x density."""
    if density is None:
        return closest.argmin(-1)
    return ((1 - closest) * density).masked_fill(~valid, -float("inf")).argmax(-1)


def _similarity_to(unit: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Cosine similarity [..., N] of every point to the point `index` [...] names."""
    newest = unit.gather(-2, index[..., None, None].expand(*unit.shape[:-2], 1, unit.shape[-1]))  # [..., 1, D]
    return (unit * newest).sum(-1)


def local_density(unit: torch.Tensor, valid: torch.Tensor, m: int, rows_per_chunk: int = 256) -> torch.Tensor:
    """[..., N] in [0, 1]: (1 + the mean cosine similarity of each point to its m most similar
    other valid points) / 2; a missing neighbour counts as similarity -1. Rows go through in chunks,
    so a long prompt never builds its whole N x N matrix."""
    N = unit.shape[-2]
    m = min(m, N - 1)
    if m < 1:
        return torch.ones(unit.shape[:-1], device=unit.device)
    chunks = []
    for first in range(0, N, rows_per_chunk):
        rows = unit[..., first : first + rows_per_chunk, :]  # [..., r, D]
        similarity = rows @ unit.transpose(-1, -2)  # [..., r, N]
        itself = torch.arange(first, first + rows.shape[-2], device=unit.device)[:, None] == torch.arange(N, device=unit.device)  # [r, N]
        similarity = similarity.masked_fill(itself | ~valid[..., None, :], -1.0)
        chunks.append(similarity.topk(m, dim=-1).values.mean(-1))
    return (1 + torch.cat(chunks, dim=-1)) / 2
