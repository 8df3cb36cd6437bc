"""Compaction: move the kept slots to the front of the same cache buffers, per (layer, row, KV head).
Each cache calls this on its own buffers (its `compact`); a paged one moves its slots through
its block table with the same moves."""

import torch

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # the integer type of each element size


def compaction_moves(prompt_length: torch.Tensor, keep: torch.Tensor, n_candidates: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The source and target slot of every kept slot and of the window, [L, B, H_kv, K + W] each."""
    L, B, H_kv, K = keep.shape
    window_offsets = torch.arange(n_candidates, n_candidates + window, device=keep.device).expand(L, B, H_kv, window)
    base = prompt_length.view(1, B, 1, 1)
    source = base + torch.cat([keep, window_offsets], dim=-1)
    target = (base + torch.arange(K + window, device=keep.device)).expand_as(source)
    return source, target


def evicted_offsets(keep: torch.Tensor, n_candidates: int) -> torch.Tensor:
    """The candidates a compaction does not keep, ascending: [L, B, H_kv, C - K] offsets after the
    prefix, for keep [L, B, H_kv, K] (ascending, distinct)."""
    kept = torch.zeros(*keep.shape[:-1], n_candidates, dtype=torch.bool, device=keep.device).scatter_(-1, keep, True)
    order = torch.sort(kept.to(torch.uint8), dim=-1, stable=True).indices  # the evicted first, each part in offset order
    return order[..., : n_candidates - keep.shape[-1]]


def compact_in_place(
    buffers: list[torch.Tensor],  # each [L, B, H_kv, S, ...], rewritten in place
    prompt_length: torch.Tensor,  # [B] the protected prefix of each row, which does not move
    keep: torch.Tensor,  # [L, B, H_kv, K] kept candidates, as offsets after the prefix, ascending
    n_candidates: int,  # candidates per row; the window follows them
    window: int,
) -> None:
    """[prefix | candidates | window] becomes [prefix | kept | window | free slots].

    Kept offsets are ascending, so each one moves towards the front or stays: gathering all of a
    layer's before writing any makes the in-place move safe. One layer at a time, so the copy in
    flight is one layer's kept part, not the whole model's.
    """
    source, target = compaction_moves(prompt_length, keep, n_candidates, window)  # [L, B, H_kv, K + W] each
    L = keep.shape[0]
    for buffer in buffers:
        sources, targets = _broadcast_to(source, buffer), _broadcast_to(target, buffer)
        for layer in range(L):
            moved = buffer[layer].gather(2, sources[layer])  # [B, H_kv, K + W, ...]
            scatter_bits_(buffer[layer], 2, targets[layer], moved)


def _broadcast_to(index: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """Slot indices [L, B, H_kv, N] repeated over the buffer's trailing dims (the head dim of K/V)."""
    return _expand(index, buffer.shape[4:])


def scatter_bits_(buffer: torch.Tensor, dim: int, index: torch.Tensor, values: torch.Tensor) -> None:
    """buffer.scatter_(dim, index, values), moving the values' bits as same-sized integers.

    On CPU, scatter_ has no fast kernel for bfloat16/float16 and rewrites the whole buffer
    (docs/performance.md); integers take the fast path, exactly.
    """
    bits = BITS[buffer.element_size()]
    buffer.view(bits).scatter_(dim, index, values.to(buffer.dtype).view(bits))


def _expand(index: torch.Tensor, trailing: torch.Size) -> torch.Tensor:
    """Indices [..., N] repeated over trailing dims (the head dim of K/V, or none)."""
    return index.view(*index.shape, *(1,) * len(trailing)).expand(*index.shape, *trailing)
