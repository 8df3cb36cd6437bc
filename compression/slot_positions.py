"""Which absolute position every cache slot holds, for scoring (what a query could see when it
was issued) and for the evaluation. Slots are not positions: after a compaction the kept slots
hold the positions recorded then, and a compressed prompt holds positions of its own."""

import torch

from compression.cache import Cache


class SlotPositions:
    def __init__(self, cache: Cache, budget: int):
        L, B, H_kv, _, _ = cache.slot_shape()
        self.budget = budget
        # [L, B, H_kv, budget] positions of the kept slots, valid once `compacted`; rewritten in place.
        self.kept = torch.zeros(L, B, H_kv, budget, dtype=torch.int64, device=cache.device)
        self.compacted = False
        self.prefix: torch.Tensor | None = None  # [L, B, H_kv, P] the positions a compressed prompt's slots hold

    def of(self, cache: Cache) -> torch.Tensor:
        """Absolute position held by every slot, [L, B, H_kv, S] (slots past `length` hold garbage).

        The prefix sits at its own positions; after a compaction the kept slots hold what was
        recorded; every slot after them was written in order, one position per step.
        """
        L, B, H_kv, S, _ = cache.slot_shape()
        slots = torch.arange(S, device=cache.device)
        positions = (cache.position - cache.length)[:, None] + slots  # [B, S] appended in order
        positions = torch.where(slots < cache.prompt_length[:, None], slots, positions)
        positions = positions[None, :, None, :].expand(L, B, H_kv, S).clone()
        if self.prefix is not None:
            P = self.prefix.shape[3]
            positions[..., :P] = torch.where(slots[:P] < cache.prompt_length.view(1, B, 1, 1), self.prefix, positions[..., :P])
        if self.compacted:
            positions.scatter_(3, self._kept_slots(cache).expand_as(self.kept), self.kept)
        return positions

    def keep(self, cache: Cache, positions: torch.Tensor) -> None:
        """After a compaction that moved `positions` ([L, B, H_kv, S], from `of`) with its slots:
        remember what the kept slots hold."""
        torch.gather(positions, 3, self._kept_slots(cache).expand_as(self.kept), out=self.kept)
        self.compacted = True

    def reset(self) -> None:
        self.compacted = False
        self.prefix = None

    def _kept_slots(self, cache: Cache) -> torch.Tensor:
        B = cache.length.shape[0]
        return cache.prompt_length.view(1, B, 1, 1) + torch.arange(self.budget, device=cache.device)  # [1, B, 1, budget]
