"""The queries a KV policy scores with, in one static buffer per layer and query head: BeaconKV's
beacons first, then a ring of the most recent queries beside the position each was issued at.

The decode step writes into it on the device, with static shapes and no host sync (`record`); the
host counts what was recorded (`advance`) and reads it between steps (`recent`, `beacons`).
"""

import torch


class QueryBuffer:
    def __init__(self, n_layers: int, batch: int, n_heads: int, head_dim: int, n_beacon: int, n_recent: int, dtype: torch.dtype, device: torch.device):
        self.n_beacon, self.n_recent = n_beacon, n_recent
        # [L, B, H, n_beacon + n_recent, D]: beacons first, then the ring of recent queries.
        self.queries = torch.zeros(n_layers, batch, n_heads, n_beacon + n_recent, head_dim, dtype=dtype, device=device)
        self.slot = torch.full((1,), n_beacon, dtype=torch.int64, device=device)  # where the next query goes
        # [B, n_recent] the position each recent query was issued at: it is scored rotated there,
        # as it attended when it was issued (the beacons are rotated to the current position).
        self.issued_at = torch.zeros(batch, n_recent, dtype=torch.int64, device=device)
        self.recorded = 0  # queries recorded so far (host count)

    @property
    def beacons(self) -> torch.Tensor:
        """[L, B, H, n_beacon, D], a view: writing to it sets the beacons."""
        return self.queries[:, :, :, : self.n_beacon]

    def record(self, queries: torch.Tensor, positions: torch.Tensor) -> None:
        """Inside the decode step: write queries [L, B, H, 1, D] at the ring's next slot and the
        position each row issued them at ([B]) beside them, then advance the slot (on the device)."""
        self.queries.index_copy_(3, self.slot, queries.to(self.queries.dtype))
        self.issued_at.index_copy_(1, self.slot - self.n_beacon, positions[:, None])
        self.slot.copy_(self.n_beacon + (self.slot - self.n_beacon + 1) % self.n_recent)

    def advance(self) -> bool:
        """Between steps, on the host: count one recorded query; returns whether the ring has just filled."""
        self.recorded += 1
        return self.recorded % self.n_recent == 0

    def recent(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The last n_recent queries [L, B, H, R, D], oldest first, and the positions [B, R] they
        were issued at: the same number for every policy (fewer only before the ring first fills)."""
        ring = self.queries[:, :, :, self.n_beacon :]
        filled = self.recorded % self.n_recent  # also the slot the next query goes to
        if self.recorded < self.n_recent:
            return ring[:, :, :, :filled], self.issued_at[:, :filled]
        return ring.roll(-filled, dims=3), self.issued_at.roll(-filled, dims=1)

    def reset(self) -> None:
        self.queries.zero_()
        self.issued_at.zero_()
        self.slot.fill_(self.n_beacon)
        self.recorded = 0

    def snapshot(self) -> dict[str, torch.Tensor | int]:
        # The names the evaluation's saved full-cache passes hold (evaluation/full_pass.py).
        return {"queries": self.queries, "issued_at": self.issued_at, "query_slot": self.slot, "manager_steps": self.recorded}

    def resume(self, saved: dict[str, torch.Tensor | int]) -> None:
        """Continue from a snapshot. A buffer without beacons may resume from one with them:
        its ring is the same, at the same offsets after them."""
        source = saved["queries"]
        skip = source.shape[3] - self.queries.shape[3]  # the beacons the snapshot holds and this buffer does not
        if skip < 0 or (skip and self.n_beacon):
            raise ValueError("the snapshot's query buffer does not match the policy's")
        self.queries.copy_(source[:, :, :, skip:])
        self.issued_at.copy_(saved["issued_at"])
        self.slot.copy_(saved["query_slot"] - skip)
        self.recorded = saved["manager_steps"]
