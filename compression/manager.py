"""The compression manager: records queries during decoding and compacts the cache on schedule.

Its schedule depends only on how many tokens have been decoded, which the host knows without
reading the device: every row of a batch generates one slot per step, so every row crosses the
budget at the same step. Queries are written into a static buffer from inside the decode step;
everything else happens between steps.
"""

import time
from dataclasses import dataclass, field

import torch

from compression.cache import Cache, slot_shape
from compression.config import PREFIX_SINKS, CompressionConfig
from compression.fps import farthest_point_sampling
from compression.policies import SCORERS, ScoringInputs
from compression.recording import accumulate_attention, record_query
from compression.scoring import rotate_to_position
from models.rope import apply_rope


@dataclass
class CompressionStats:
    compactions: int = 0
    compaction_s: list[float] = field(default_factory=list)
    refresh_s: list[float] = field(default_factory=list)  # BeaconKV's FPS refreshes


class CompressionManager:
    def __init__(
        self, config: CompressionConfig, cache: Cache, n_heads: int, rope_cos: torch.Tensor, rope_sin: torch.Tensor, kv_heads: tuple[int, int] | None = None
    ):
        """n_heads: the query heads whose queries the model hands over; kv_heads: under tensor
        parallelism, the model's KV head the cache's first one is, and the model's count."""
        L, B, H_kv, _, D = slot_shape(cache)
        self.config = config
        self.kv_heads = kv_heads
        self.cache = cache
        self.rope_cos, self.rope_sin = rope_cos, rope_sin  # [max_positions, D]
        self.n_beacon = config.buffered_beacons
        # [L, B, H, n_beacon + n_recent, D]: beacons first, then a ring of recent queries.
        self.queries = torch.zeros(L, B, n_heads, self.n_beacon + config.n_recent, D, dtype=cache.k.dtype, device=cache.k.device)
        self.query_slot = torch.full((1,), self.n_beacon, dtype=torch.int64, device=cache.k.device)
        # [B, n_recent] the position each recent query was issued at: it is scored rotated there,
        # as it attended when it was issued (the beacons are rotated to the current position).
        self.issued_at = torch.zeros(B, config.n_recent, dtype=torch.int64, device=cache.k.device)
        # H2O: [L, B, H_kv, S] the attention each slot has received so far, summed over the steps
        # and the heads of its group; compaction moves it with the slot's K and V.
        self.received: torch.Tensor | None = None
        if config.policy == "h2o":
            self.track_received_attention()
        self.steps = 0  # decode steps so far, each of which recorded one query (host count)
        self.generated = 0  # slots in use after each row's prompt: the same for every row (host count)
        # [L, B, H_kv, budget] positions of the kept slots, valid once `compacted`; rewritten in place.
        self.kept_positions = torch.zeros(L, B, H_kv, config.budget, dtype=torch.int64, device=cache.k.device)
        # Prefix compression: the prompt's last queries [L, B, H, R, D] until they have scored it, and
        # the positions [L, B, H_kv, P] its slots hold afterwards.
        self.prompt_tail: torch.Tensor | None = None
        self.prefix_positions: torch.Tensor | None = None
        self.compacted = False
        self.generator = torch.Generator().manual_seed(config.seed)
        self.stats = CompressionStats()

    def track_received_attention(self) -> None:
        """Accumulate H2O's statistic from the next step on (H2O's own manager does from the start;
        the evaluation's full-cache recorder does it so that H2O can resume from its snapshots)."""
        L, B, H_kv, S, _ = slot_shape(self.cache)
        self.received = torch.zeros(L, B, H_kv, S, dtype=torch.float32, device=self.cache.k.device)

    def reset(self) -> None:
        """Start over with an empty cache (a new conversation), in the same buffers."""
        self.queries.zero_()
        self.issued_at.zero_()
        if self.received is not None:
            self.received.zero_()
        self.query_slot.fill_(self.n_beacon)
        self.prompt_tail = self.prefix_positions = None
        self.steps = self.generated = 0
        self.compacted = False

    def record(self, queries: torch.Tensor, positions: torch.Tensor) -> None:
        """Called inside the decode step with that step's queries [L, B, H, 1, D], issued at positions [B]."""
        record_query(self.queries, self.issued_at, self.query_slot, queries, positions, self.n_beacon, self.config.n_recent)
        if self.received is not None:
            accumulate_attention(self.received, self.cache, queries, self.rope_cos[positions], self.rope_sin[positions])

    def step_state(self) -> list[torch.Tensor]:
        """The tensors record() advances in place inside the decode step."""
        return [self.query_slot] + ([self.received] if self.received is not None else [])

    def seed_layer(self, layer: int, queries: torch.Tensor, prompt_lengths: torch.Tensor) -> None:
        """During prefill, as each layer finishes: its first beacons are the farthest points among
        the prompt's queries [B, H, T, D]. Layer by layer, so a long prompt never holds every
        layer's queries and their FPS temporaries at once."""
        T = queries.shape[2]
        if self.config.prefix_budget:  # the prompt's last queries score its middle once prefill is done
            R = min(self.config.n_recent, T)
            if self.prompt_tail is None:
                self.prompt_tail = torch.zeros(self.queries.shape[0], *queries.shape[:2], R, queries.shape[3], dtype=queries.dtype, device=queries.device)
            last = (prompt_lengths[:, None] - R + torch.arange(R, device=queries.device)).clamp_min(0)  # [B, R]
            self.prompt_tail[layer] = queries.gather(2, last[:, None, :, None].expand(-1, queries.shape[1], -1, queries.shape[3]))
        if self.n_beacon == 0:
            return
        valid = torch.arange(T, device=prompt_lengths.device)[None, :] < prompt_lengths[:, None]  # [B, T]
        self.queries[layer, :, :, : self.n_beacon] = self._farthest(queries, valid[:, None, :])

    def compress_prompt(self) -> None:
        """After a prefill into an empty cache, with a prefix_budget: each prompt longer than
        PREFIX_SINKS + prefix_budget + prefix_tail keeps its first PREFIX_SINKS and last prefix_tail
        tokens and the prefix_budget best-scored of those between (per layer and KV head), scored
        once by the policy with the prompt's last queries (and BeaconKV's first beacons). The kept
        prompt becomes the protected prefix; positions do not move."""
        cache, config = self.cache, self.config
        if not config.prefix_budget:
            return
        L, B, H_kv, _, D = slot_shape(cache)
        T = int(cache.prompt_length.max())
        self.prefix_positions = torch.arange(T, device=cache.k.device).expand(L, B, H_kv, T).clone()
        for b, P in enumerate(cache.prompt_length.tolist()):
            n_candidates = P - PREFIX_SINKS - config.prefix_tail
            if n_candidates <= config.prefix_budget:
                continue
            R = self.prompt_tail.shape[3]
            issued_at = torch.arange(P - R, P, device=cache.k.device)[None]  # [1, R]
            now = torch.tensor([P], device=cache.k.device)
            candidate_slots = PREFIX_SINKS + torch.arange(n_candidates, device=cache.k.device)[None]  # [1, C]
            row = cache.row(b)
            keep = []
            for layer in range(L):
                context = row.keys(layer, P)  # [1, H_kv, P, D]
                keep.append(self._best(
                    config.prefix_budget,
                    beacons=rotate_to_position(self.queries[layer, b : b + 1, :, : self.n_beacon], self.rope_cos[now], self.rope_sin[now]),
                    recent=apply_rope(self.prompt_tail[layer, b : b + 1], self.rope_cos[issued_at], self.rope_sin[issued_at]),
                    keys=context[:, :, PREFIX_SINKS : PREFIX_SINKS + n_candidates],
                    context=context,
                    visible=(torch.arange(P, device=cache.k.device) <= issued_at[0, :, None]).expand(1, H_kv, R, P),
                    in_use=torch.ones(1, P, dtype=torch.bool, device=cache.k.device),
                    candidate_slots=candidate_slots,
                ))
            sinks = torch.tensor([PREFIX_SINKS], device=cache.k.device)
            row.compact([self.prefix_positions[:, b : b + 1]], sinks, torch.stack(keep), n_candidates, config.prefix_tail)
            cache.prompt_length[b] = cache.length[b] = PREFIX_SINKS + config.prefix_budget + config.prefix_tail
        self.prompt_tail = None

    def append(self, last_queries: torch.Tensor, n_new: list[int]) -> None:
        """After a prefill into a cache in use (a chat turn): its tokens join the generated part,
        and its last queries [L, B, H, min(n, n_recent), D] enter the recent ring as decoded ones
        would. The cache is compacted at the next step if the turn took it past the budget."""
        if len(set(n_new)) != 1:
            raise ValueError(f"every row must append the same number of tokens (the schedule is shared), got {n_new}")
        n, kept = n_new[0], last_queries.shape[3]
        if self.received is not None:  # the new slots may hold evicted tokens' sums
            new_slots = self.cache.length[:, None] + torch.arange(n, device=self.cache.k.device)  # [B, n]
            L, B, H_kv = self.received.shape[:3]
            self.received.scatter_(3, new_slots[None, :, None, :].expand(L, B, H_kv, n), 0.0)
        for i in range(kept):
            # Into the ring only: H2O's sums count the attention of decoded tokens alone.
            position = self.cache.position + n - kept + i
            record_query(self.queries, self.issued_at, self.query_slot, last_queries[:, :, :, i : i + 1], position, self.n_beacon, self.config.n_recent)
            self._count_query()
        self.generated += n

    def after_step(self) -> bool:
        """Between steps: one more slot is in use and one more query was recorded. Returns
        whether the cache was compacted (its lengths shrank)."""
        self._count_query()
        self.generated += 1
        if self.generated - self.config.window > self.config.budget_max:
            self._compact()
            return True
        return False

    def _count_query(self) -> None:
        self.steps += 1
        if self.n_beacon and self.steps % self.config.n_recent == 0 and not self.config.lazy_refresh:
            self._refresh_beacons()

    def _farthest(self, candidates: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """The n_beacon farthest points among candidates [..., N, D]: [..., n_beacon, D]."""
        if self.config.fps_per_group:  # one FPS per KV group on its heads' queries side by side; every head takes the same steps
            H_kv = self.cache.k.shape[2]
            H = candidates.shape[-3]
            grouped = candidates.unflatten(-3, (H_kv, H // H_kv)).transpose(-3, -2).flatten(-2)  # [..., H_kv, N, G x D]
            picks = farthest_point_sampling(grouped, self.n_beacon, valid).repeat_interleave(H // H_kv, dim=-2)
        else:
            picks = farthest_point_sampling(candidates, self.n_beacon, valid)  # [..., n_beacon]
        return candidates.gather(-2, picks[..., None].expand(*picks.shape, candidates.shape[-1]))

    def _refresh_beacons(self) -> None:
        """Continual FPS: the beacons and the recent queries of the buffer together yield new
        beacons, each time the ring fills or, with lazy_refresh, once before each compaction."""
        start = time.perf_counter()
        self.queries[:, :, :, : self.n_beacon] = self._farthest(self.queries.clone(), None)
        self._sync()
        self.stats.refresh_s.append(time.perf_counter() - start)

    def recent_queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The last n_recent queries [L, B, H, R, D], oldest first, and the positions [B, R] they
        were issued at: the same number for every policy (fewer only before the ring first fills)."""
        ring = self.queries[:, :, :, self.n_beacon :]
        filled = self.steps % self.config.n_recent  # also the slot the next query goes to
        if self.steps < self.config.n_recent:
            return ring[:, :, :, :filled], self.issued_at[:, :filled]
        return ring.roll(-filled, dims=3), self.issued_at.roll(-filled, dims=1)

    def _compact(self) -> None:
        if self.config.lazy_refresh and self.n_beacon:  # once per compaction, from the queries the ring holds now
            self._refresh_beacons()
        start = time.perf_counter()
        cache, config = self.cache, self.config
        n_candidates = self.generated - config.window
        L, B, H_kv, _, D = slot_shape(cache)
        offsets = torch.arange(n_candidates, device=cache.k.device)
        candidate_slots = cache.prompt_length[:, None] + offsets  # [B, C]
        beacon_cos, beacon_sin = self.rope_cos[cache.position], self.rope_sin[cache.position]  # [B, D]: beacons vote from now
        recent, issued_at = self.recent_queries()
        recent_cos, recent_sin = self.rope_cos[issued_at], self.rope_sin[issued_at]  # [B, R, D]
        positions = self.slot_positions()  # [L, B, H_kv, S]
        S = int(cache.length.max())
        in_use = cache.slot_ids[None, :S] < cache.length[:, None]  # [B, S]
        keep = []
        for layer in range(L):
            context = cache.keys(layer, S)  # [B, H_kv, S, D]
            keys = context.gather(2, candidate_slots[:, None, :, None].expand(B, H_kv, n_candidates, D))
            # A recent query read the keys in use at or before its own position.
            visible = in_use[:, None, None, :] & (positions[layer, :, :, None, :S] <= issued_at[:, None, :, None])  # [B, H_kv, R, S]
            received = None if self.received is None else self.received[layer].gather(2, candidate_slots[:, None, :].expand(B, H_kv, n_candidates))
            keep.append(self._best(
                config.budget,
                received=received,
                beacons=rotate_to_position(self.queries[layer, :, :, : self.n_beacon], beacon_cos, beacon_sin),
                recent=apply_rope(recent[layer], recent_cos, recent_sin),
                keys=keys,
                context=context,
                visible=visible,
                in_use=in_use,
                candidate_slots=candidate_slots,
            ))
        moved = [positions] + ([self.received] if self.received is not None else [])
        cache.compact(moved, cache.prompt_length, torch.stack(keep), n_candidates, config.window)
        kept_slots = cache.prompt_length.view(1, B, 1, 1) + torch.arange(config.budget, device=cache.k.device)
        torch.gather(positions, 3, kept_slots.expand(L, B, H_kv, config.budget), out=self.kept_positions)
        self.compacted = True
        cache.length.copy_(cache.prompt_length + config.budget + config.window)
        self.generated = config.budget + config.window
        self._sync()
        self.stats.compactions += 1
        self.stats.compaction_s.append(time.perf_counter() - start)

    def _best(self, count: int, **layer_inputs: torch.Tensor | None) -> torch.Tensor:
        """One layer's `count` best candidates by the policy's scores, as ascending offsets
        [B, H_kv, count]; `layer_inputs` are the ScoringInputs of that layer, the rest is the manager's."""
        inputs = ScoringInputs(**layer_inputs, config=self.config, generator=self.generator, kv_heads=self.kv_heads)
        return SCORERS[self.config.policy](inputs).topk(count, dim=-1).indices.sort(dim=-1).values

    def snapshot(self) -> dict[str, torch.Tensor | int | None]:
        """What a run resumed from this point needs of the manager, by name (the evaluation keeps
        it beside its snapshots of the full cache); `resume` reads it back."""
        return {
            "queries": self.queries, "issued_at": self.issued_at, "query_slot": self.query_slot, "received": self.received,
            "manager_steps": self.steps, "generated": self.generated,
        }

    def resume(self, saved: dict[str, torch.Tensor | int | None]) -> None:
        """Continue where the manager that took `saved` (a snapshot) was, on a cache in the same
        state. A policy without beacons may resume from BeaconKV's [beacons | ring of recent
        queries]: its own buffer is that ring alone, at the same offsets. H2O's sums come along
        when the snapshot has them; H2O cannot resume from one without."""
        source = saved["queries"]
        skip = source.shape[3] - self.queries.shape[3]  # the beacons the snapshot holds and this manager does not
        if skip < 0 or (skip and self.n_beacon):
            raise ValueError("the snapshot's query buffer does not match the policy's")
        self.queries.copy_(source[:, :, :, skip:])
        self.issued_at.copy_(saved["issued_at"])
        self.query_slot.copy_(saved["query_slot"] - skip)
        if saved["received"] is not None:
            if self.received is None:
                self.track_received_attention()
            self.received.copy_(saved["received"][..., : self.received.shape[3]])
        elif self.received is not None:
            raise ValueError("the snapshot holds no accumulated attention, which H2O resumes from")
        self.steps, self.generated = saved["manager_steps"], saved["generated"]

    def slot_positions(self) -> torch.Tensor:
        """Absolute position held by every slot, [L, B, H_kv, S] (slots past `length` hold garbage).

        The prefix sits at its own positions; after a compaction the kept slots hold what was
        recorded; every slot after them was written in order, one position per step.
        """
        cache = self.cache
        L, B, H_kv, S, _ = slot_shape(cache)
        slots = torch.arange(S, device=cache.k.device)
        positions = (cache.position - cache.length)[:, None] + slots  # [B, S] appended in order
        positions = torch.where(slots < cache.prompt_length[:, None], slots, positions)
        positions = positions[None, :, None, :].expand(L, B, H_kv, S).clone()
        if self.prefix_positions is not None:  # a compressed prompt holds positions of its own
            P = self.prefix_positions.shape[3]
            positions[..., :P] = torch.where(slots[:P] < cache.prompt_length.view(1, B, 1, 1), self.prefix_positions, positions[..., :P])
        if self.compacted:
            kept_slots = cache.prompt_length.view(1, B, 1, 1) + torch.arange(self.config.budget, device=slots.device)
            positions.scatter_(3, kept_slots.expand_as(self.kept_positions), self.kept_positions)
        return positions

    def _sync(self) -> None:
        if self.cache.k.device.type == "cuda":
            torch.cuda.synchronize()  # so that the timings measure the work, not its launch


class PerRowManagers:
    """A continuous batch's compression: one manager per row, each on its own row of the cache.

    Rows join and leave at different steps, so each keeps its own schedule (one manager's is
    shared by all of its rows); a row's manager starts over when a new prompt takes the row."""

    def __init__(
        self, config: CompressionConfig, cache: Cache, n_heads: int, rope_cos: torch.Tensor, rope_sin: torch.Tensor, kv_heads: tuple[int, int] | None = None
    ):
        self.rows = [CompressionManager(config, cache.row(b), n_heads, rope_cos, rope_sin, kv_heads) for b in range(cache.length.shape[0])]

    def record(self, queries: torch.Tensor, positions: torch.Tensor) -> None:
        """Inside the decode step: each row's queries [L, 1, H, 1, D] to its own manager."""
        for b, manager in enumerate(self.rows):
            manager.record(queries[:, b : b + 1], positions[b : b + 1])

    def step_state(self) -> list[torch.Tensor]:
        return [t for manager in self.rows for t in manager.step_state()]

    @property
    def stats(self) -> CompressionStats:
        """Every row's compactions together."""
        total = CompressionStats()
        for manager in self.rows:
            total.compactions += manager.stats.compactions
            total.compaction_s += manager.stats.compaction_s
            total.refresh_s += manager.stats.refresh_s
        return total
