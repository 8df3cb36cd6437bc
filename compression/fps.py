"""Farthest-point sampling by cosine similarity: pick a few queries that cover all directions."""

import torch


def farthest_point_sampling(points: torch.Tensor, k: int, valid: torch.Tensor | None = None, density_m: int = 0) -> torch.Tensor:
    """Indices [..., k] of k points chosen from points [..., N, D], batched over the leading dims.

    Start with the point least similar on average to the others; then repeatedly add the point
    whose highest similarity to the chosen ones is lowest. With density_m > 0 each point's
    distance (1 - similarity) is weighted by its local density, so that an isolated outlier is not
    chosen for being far from everything. Points where valid [..., N] is False are never chosen;
    when fewer than k are valid, chosen points repeat.
    """
    unit = torch.nn.functional.normalize(points.float(), dim=-1)  # [..., N, D]
    if valid is None:
        valid = torch.ones(unit.shape[:-1], dtype=torch.bool, device=unit.device)
    valid = valid.expand(unit.shape[:-1])
    unit = unit * valid.unsqueeze(-1)  # invalid points add nothing to the mean
    # Mean similarity to all points = dot with the mean vector: no N x N matrix is built.
    mean_similarity = (unit @ unit.sum(-2, keepdim=True).transpose(-1, -2)).squeeze(-1)  # [..., N]
    if density_m:
        return _density_weighted(unit, k, valid, mean_similarity, local_density(unit, valid, density_m))
    first = mean_similarity.masked_fill(~valid, float("inf")).argmin(-1)  # [...]
    chosen = [first]
    closest = torch.full_like(mean_similarity, -float("inf")).masked_fill(~valid, float("inf"))
    for _ in range(k - 1):
        newest = unit.gather(-2, chosen[-1][..., None, None].expand(*unit.shape[:-2], 1, unit.shape[-1]))  # [..., 1, D]
        closest = torch.maximum(closest, (unit * newest).sum(-1))
        chosen.append(closest.argmin(-1))
    return torch.stack(chosen, dim=-1)


def local_density(unit: torch.Tensor, valid: torch.Tensor, m: int, rows_per_chunk: int = 256) -> torch.Tensor:
    """[..., N] in [0, 1]: (1 + the mean cosine similarity of each point to its m most similar
    other valid points) / 2; a missing neighbour counts as similarity -1. Rows go through in chunks,
    so a long prompt never builds its whole N x N matrix."""
    N = unit.shape[-2]
    m = min(m, N - 1)
    if m < 1:
        return torch.ones(unit.shape[:-1], device=unit.device)
    chunks = []
    for start in range(0, N, rows_per_chunk):
        rows = unit[..., start : start + rows_per_chunk, :]  # [..., r, D]
        similarity = rows @ unit.transpose(-1, -2)  # [..., r, N]
        itself = torch.arange(start, start + rows.shape[-2], device=unit.device)[:, None] == torch.arange(N, device=unit.device)  # [r, N]
        similarity = similarity.masked_fill(itself | ~valid[..., None, :], -1.0)
        chunks.append(similarity.topk(m, dim=-1).values.mean(-1))
    return (1 + torch.cat(chunks, dim=-1)) / 2


def _density_weighted(unit: torch.Tensor, k: int, valid: torch.Tensor, mean_similarity: torch.Tensor, density: torch.Tensor) -> torch.Tensor:
    """FPS where a point's pick score is its distance from the chosen ones times its density."""
    first = ((1 - mean_similarity / valid.sum(-1, keepdim=True).clamp_min(1)) * density).masked_fill(~valid, -float("inf")).argmax(-1)
    chosen = [first]
    closest = torch.full_like(mean_similarity, -1.0)  # highest similarity to a chosen point so far
    for _ in range(k - 1):
        newest = unit.gather(-2, chosen[-1][..., None, None].expand(*unit.shape[:-2], 1, unit.shape[-1]))  # [..., 1, D]
        closest = torch.maximum(closest, (unit * newest).sum(-1))
        chosen.append(((1 - closest) * density).masked_fill(~valid, -float("inf")).argmax(-1))
    return torch.stack(chosen, dim=-1)
