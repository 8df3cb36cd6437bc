"""The compression manager: the schedule, and the compaction it calls for.

Its schedule depends only on how many tokens have been decoded, which the host knows without
reading the device: every row of a batch generates one slot per step, so every row crosses the
budget at the same step. Inside the decode step the manager only records (the queries into
compression/query_buffer.py, the attention received through compression/received_attention.py); it scores and
compacts between steps, where it also keeps which position each slot holds
(compression/slot_positions.py).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch

from compression.cache import Cache
from kv.compaction import evicted_offsets
from compression.config import CompressionConfig
from compression.fps import farthest_queries
from compression.policies import SCORERS, ScoringInputs
from compression.prompt_compression import compress_prompt
from compression.query_buffer import QueryBuffer
from compression.received_attention import POLICY_RECORD, accumulate_attention, attention_records
from compression.scoring import rotate_to_position
from compression.slot_positions import SlotPositions
from kv.store import KVStore
from models.config import ModelConfig
from models.transformer import LayerKV
from models.rope import apply_rope


@dataclass
class CompressionStats:
    compactions: int = 0
    compaction_s: list[float] = field(default_factory=list)
    refresh_s: list[float] = field(default_factory=list)  # BeaconKV's FPS refreshes


def step_queries(n_layers: int, batch: int, n_heads: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """[L, B, H, 1, D]: where each layer of a decode step writes its queries before RoPE (the
    model's views tap it), the same buffer every step. float32 holds any dtype's queries exactly."""
    return torch.zeros(n_layers, batch, n_heads, 1, head_dim, dtype=torch.float32, device=device)


class QueryTap(NamedTuple):
    """A layer's view of the cache that hands the queries before RoPE [B, H, T, D] to a KV policy as
    it attends: into a decode step's static buffer [B, H, 1, D], written in place (inside a
    compiled step or a CUDA graph), or in a prefill to a function that takes them as the layer
    finishes, so that none outlives its layer."""

    inner: LayerKV  # the view it wraps
    tap: torch.Tensor | Callable[[torch.Tensor], None]

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.inner.write(k, v, slots)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.read(dtype)

    def attend(self, q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, before_rope: torch.Tensor) -> torch.Tensor:
        if isinstance(self.tap, torch.Tensor):
            self.tap.copy_(before_rope)
        else:
            self.tap(before_rope)
        return self.inner.attend(q, slots, mask, before_rope)

    def slots_read(self) -> list[tuple[torch.Tensor, int]]:
        return self.inner.slots_read()


class CompressionManager:
    """A KV policy inside the engine's loop (engine/decode.py calls prefill_views, prefilled,
    decode_views and after_decode; engine/generation.py after_step, reset and step_state)."""

    def __init__(self, config: CompressionConfig, cache: Cache, n_heads: int, rope_cos: torch.Tensor, rope_sin: torch.Tensor, store: KVStore | None = None):
        """n_heads: the query heads whose queries the model hands over. store: where compactions
        demote what they evict, which decode steps recall from (None: eviction is final)."""
        L, B, H_kv, _, D = cache.slot_shape()
        self.config = config
        self.cache = cache
        self.store = store
        self._tails: list[torch.Tensor] | None = None  # a chat turn's prefill: each layer's last queries, for the recent ring
        self.rope_cos, self.rope_sin = rope_cos, rope_sin  # [max_positions, D]
        self.n_beacon = config.buffered_beacons
        self.buffer = QueryBuffer(L, B, n_heads, D, self.n_beacon, config.n_recent, cache.dtype, cache.device)
        self.step_queries = step_queries(L, B, n_heads, D, cache.device)
        self.positions = SlotPositions(cache, config.budget)
        # H2O, maxattn, a store that drops the least attended: "sum" or "max" -> [L, B, H_kv, S] the
        # attention each slot has received so far, over the steps and the heads of its group;
        # compaction moves it with the slot.
        self.received: dict[str, torch.Tensor] = {}
        for how in sorted(attention_records(config)):
            self.track_received_attention(how)
        self.generated = 0  # slots in use after each row's prompt: the same for every row (host count)
        self.prompt_tail: torch.Tensor | None = None  # [L, B, H, R, D] the prompt's last queries, until they have scored it
        self.generator = torch.Generator().manual_seed(config.seed)
        self.stats = CompressionStats()

    def track_received_attention(self, how: str) -> None:
        """Record the attention received ("sum" or "max") from the next step on (H2O's and
        maxattn's own managers do from the start; the evaluation's full-cache recorder does it so
        that they can resume from its snapshots)."""
        L, B, H_kv, S, _ = self.cache.slot_shape()
        self.received[how] = torch.zeros(L, B, H_kv, S, dtype=torch.float32, device=self.cache.device)

    def reset(self) -> None:
        """Start over with an empty cache (a new conversation), in the same buffers."""
        if self.store is not None:
            self.store.reset()
        self.buffer.reset()
        self.positions.reset()
        for record in self.received.values():
            record.zero_()
        self.prompt_tail = None
        self.generated = 0

    @property
    def nbytes(self) -> int:
        """What the policy holds beside the cache that counts as KV memory: the store."""
        return 0 if self.store is None else self.store.nbytes

    def decode_views(self, layers: list) -> list[QueryTap]:
        """A decode step's views: each layer recalls from the store, if any, and writes its
        queries into this manager's static buffer."""
        return decode_views(layers, self.store, self.step_queries)

    def after_decode(self, positions: torch.Tensor) -> None:
        """Inside the decode step, after the forward: record its queries, issued at positions [B]."""
        self.record(self.step_queries, positions)

    def prefill_views(self, layers: list, prompt_lengths: torch.Tensor, fresh: bool) -> list[QueryTap]:
        """A prefill's views. Into an empty cache each layer's queries seed the policy as the layer
        finishes; after a conversation so far, each layer's last queries are kept for the ring."""
        if fresh:
            return [QueryTap(layer, partial(self.seed_layer, i, prompt_lengths=prompt_lengths)) for i, layer in enumerate(layers)]
        self._tails = []
        return [QueryTap(layer, self._keep_tail) for layer in layers]

    def _keep_tail(self, queries: torch.Tensor) -> None:
        self._tails.append(queries[:, :, -self.config.n_recent :].clone())  # a copy: a slice would pin the layer's q/k/v

    def prefilled(self, n_new: list[int], fresh: bool) -> None:
        """After a prefill, the counters advanced: a new prompt may be compressed now; a chat
        turn's tokens join the generated part."""
        if fresh:
            self.compress_prompt()
        else:
            tails, self._tails = torch.stack(self._tails), None
            self.append(tails, n_new)

    def record(self, queries: torch.Tensor, positions: torch.Tensor) -> None:
        """Called inside the decode step with that step's queries [L, B, H, 1, D], issued at positions [B]."""
        self.buffer.record(queries, positions)
        for how, record in self.received.items():
            accumulate_attention(record, self.cache, queries, self.rope_cos[positions], self.rope_sin[positions], how)

    def step_state(self) -> list[torch.Tensor]:
        """The tensors record() advances in place inside the decode step."""
        return [self.buffer.slot, *self.received.values()]

    def seed_layer(self, layer: int, queries: torch.Tensor, prompt_lengths: torch.Tensor) -> None:
        """During prefill, as each layer finishes: its first beacons are the farthest points among
        the prompt's queries [B, H, T, D]. Layer by layer, so a long prompt never holds every
        layer's queries and their FPS temporaries at once."""
        T = queries.shape[2]
        if self.config.prefix_budget:  # the prompt's last queries score its middle once prefill is done
            R = min(self.config.n_recent, T)
            if self.prompt_tail is None:
                L = self.buffer.queries.shape[0]
                self.prompt_tail = torch.zeros(L, *queries.shape[:2], R, queries.shape[3], dtype=queries.dtype, device=queries.device)
            last = (prompt_lengths[:, None] - R + torch.arange(R, device=queries.device)).clamp_min(0)  # [B, R]
            self.prompt_tail[layer] = queries.gather(2, last[:, None, :, None].expand(-1, queries.shape[1], -1, queries.shape[3]))
        if self.n_beacon == 0:
            return
        valid = torch.arange(T, device=prompt_lengths.device)[None, :] < prompt_lengths[:, None]  # [B, T]
        self.buffer.beacons[layer] = self._farthest(queries, valid[:, None, :])

    def compress_prompt(self) -> None:
        """After a prefill into an empty cache, with a prefix_budget: compressing the long prompts
        (compression/prompt_compression.py) ends the prefill."""
        if self.config.prefix_budget:
            self.positions.prefix = compress_prompt(self.cache, self.config, self.buffer.beacons, self.prompt_tail, self.rope_cos, self.rope_sin, self._best)
            self.prompt_tail = None

    def append(self, last_queries: torch.Tensor, n_new: list[int]) -> None:
        """After a prefill into a cache in use (a chat turn), the counters advanced past its tokens:
        they join the generated part, and its last queries [L, B, H, min(n, n_recent), D] enter the
        recent ring as decoded ones would. The cache is compacted at the next step if the turn took
        it past the budget."""
        if len(set(n_new)) != 1:
            raise ValueError(f"every row must append the same number of tokens (the schedule is shared), got {n_new}")
        n, kept = n_new[0], last_queries.shape[3]
        new_slots = self.cache.length[:, None] - n + torch.arange(n, device=self.cache.device)  # [B, n]
        for record in self.received.values():  # the new slots may hold evicted tokens' records
            L, B, H_kv = record.shape[:3]
            record.scatter_(3, new_slots[None, :, None, :].expand(L, B, H_kv, n), 0.0)
        for i in range(kept):
            # Into the ring only: H2O's sums count the attention of decoded tokens alone.
            self.buffer.record(last_queries[:, :, :, i : i + 1], self.cache.position - kept + i)
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
        ring_filled = self.buffer.advance()
        if self.n_beacon and ring_filled and not self.config.lazy_refresh:
            self._refresh_beacons()

    def _farthest(self, candidates: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """The n_beacon farthest points among each head's candidates [..., H, N, D]: [..., H, n_beacon, D]."""
        per_group = self.cache.slot_shape()[2] if self.config.fps_per_group else None
        return farthest_queries(candidates, self.n_beacon, per_group, valid)

    def _refresh_beacons(self) -> None:
        """Continual FPS: the beacons and the recent queries of the buffer together yield new
        beacons, each time the ring fills or, with lazy_refresh, once before each compaction."""
        start = time.perf_counter()
        self.buffer.beacons[:] = self._farthest(self.buffer.queries.clone(), None)
        self._sync()
        self.stats.refresh_s.append(time.perf_counter() - start)

    def _compact(self) -> None:
        if self.config.lazy_refresh and self.n_beacon:  # once per compaction, from the queries the ring holds now
            self._refresh_beacons()
        start = time.perf_counter()
        cache, config = self.cache, self.config
        n_candidates = self.generated - config.window
        L, B, H_kv, _, D = cache.slot_shape()
        candidate_slots = cache.prompt_length[:, None] + torch.arange(n_candidates, device=cache.device)  # [B, C]
        beacon_cos, beacon_sin = self.rope_cos[cache.position], self.rope_sin[cache.position]  # [B, D]: beacons vote from now
        recent, issued_at = self.buffer.recent()
        recent_cos, recent_sin = self.rope_cos[issued_at], self.rope_sin[issued_at]  # [B, R, D]
        positions = self.positions.of(cache)  # [L, B, H_kv, S]
        S = int(cache.length.max())
        in_use = cache.slot_ids[None, :S] < cache.length[:, None]  # [B, S]
        record = self.received[POLICY_RECORD[config.policy]] if config.policy in POLICY_RECORD else None  # [L, B, H_kv, S]
        keep = []
        for layer in range(L):
            context = cache.keys(layer, S)  # [B, H_kv, S, D]
            keys = context.gather(2, candidate_slots[:, None, :, None].expand(B, H_kv, n_candidates, D))
            # A recent query read the keys in use at or before its own position.
            visible = in_use[:, None, None, :] & (positions[layer, :, :, None, :S] <= issued_at[:, None, :, None])  # [B, H_kv, R, S]
            received = None if record is None else record[layer].gather(2, candidate_slots[:, None, :].expand(B, H_kv, n_candidates))
            keep.append(self._best(
                config.budget,
                received=received,
                beacons=rotate_to_position(self.buffer.beacons[layer], beacon_cos, beacon_sin),
                recent=apply_rope(recent[layer], recent_cos, recent_sin),
                keys=keys,
                context=context,
                visible=visible,
                in_use=in_use,
                candidate_slots=candidate_slots,
            ))
        keep = torch.stack(keep)  # [L, B, H_kv, budget]
        if self.store is not None:
            evicted = cache.prompt_length.view(1, B, 1, 1) + evicted_offsets(keep, n_candidates)  # [L, B, H_kv, E]
            scores = self.received["max"].gather(3, evicted) if self.store.score is not None else None
            self.store.demote(*cache.gather(evicted), positions.gather(3, evicted), scores)
        moved = [positions, *self.received.values()]
        cache.compact(moved, cache.prompt_length, keep, n_candidates, config.window)
        self.positions.keep(cache, positions)
        cache.length.copy_(cache.prompt_length + config.budget + config.window)
        self.generated = config.budget + config.window
        self._sync()
        self.stats.compactions += 1
        self.stats.compaction_s.append(time.perf_counter() - start)

    def _best(self, count: int, **layer_inputs: torch.Tensor | None) -> torch.Tensor:
        """One layer's `count` best candidates by the policy's scores, as ascending offsets
        [B, H_kv, count]; `layer_inputs` are the ScoringInputs of that layer, the rest is the manager's."""
        inputs = ScoringInputs(**layer_inputs, config=self.config, generator=self.generator, kv_heads=self.config.kv_heads)
        return SCORERS[self.config.policy](inputs).topk(count, dim=-1).indices.sort(dim=-1).values

    def snapshot(self) -> dict[str, torch.Tensor | int | None]:
        """What a run resumed from this point needs of the manager, by name (the evaluation keeps
        it beside its snapshots of the full cache); `resume` reads it back."""
        return self.buffer.snapshot() | {"received": dict(self.received), "generated": self.generated}

    def resume(self, saved: dict[str, torch.Tensor | int | None]) -> None:
        """Continue where the manager that took `saved` (a snapshot) was, on a cache in the same
        state. A policy without beacons may resume from BeaconKV's buffer. The attention received
        comes along when the snapshot has it; H2O and maxattn cannot resume from one without theirs."""
        self.buffer.resume(saved)
        if missing := set(self.received) - set(saved["received"]):
            raise ValueError(f"the snapshot holds no record of the attention received as a {missing.pop()}, which this policy scores by")
        for how, record in saved["received"].items():
            if how not in self.received:
                self.track_received_attention(how)
            self.received[how].copy_(record[..., : self.received[how].shape[3]])
        self.generated = saved["generated"]

    def slot_positions(self) -> torch.Tensor:
        """Absolute position held by every slot, [L, B, H_kv, S] (compression/slot_positions.py)."""
        return self.positions.of(self.cache)

    def _sync(self) -> None:
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize()  # so that the timings measure the work, not its launch


class PerRowManagers:
    """A continuous batch's compression: one manager per row, each on its own row of the cache.

    Rows join and leave at different steps, so each keeps its own schedule (one manager's is
    shared by all of its rows); a row's manager starts over when a new prompt takes the row."""

    def __init__(self, config: CompressionConfig, cache: Cache, n_heads: int, rope_cos: torch.Tensor, rope_sin: torch.Tensor, store: KVStore | None = None):
        B = cache.length.shape[0]
        self.store = store
        self.rows = [CompressionManager(config, cache.row(b), n_heads, rope_cos, rope_sin, None if store is None else store.row(b)) for b in range(B)]
        self.joined = [False] * B  # the rows that hold a prompt: only their schedules run
        L, _, _, _, D = cache.slot_shape()
        self.step_queries = step_queries(L, B, n_heads, D, cache.device)

    @property
    def nbytes(self) -> int:
        return 0 if self.store is None else self.store.nbytes

    def decode_views(self, layers: list) -> list[QueryTap]:
        return decode_views(layers, self.store, self.step_queries)

    def after_decode(self, positions: torch.Tensor) -> None:
        self.record(self.step_queries, positions)

    def record(self, queries: torch.Tensor, positions: torch.Tensor) -> None:
        """Inside the decode step: each row's queries [L, 1, H, 1, D] to its own manager."""
        for b, manager in enumerate(self.rows):
            manager.record(queries[:, b : b + 1], positions[b : b + 1])

    def join(self, row: int) -> CompressionManager:
        """A new prompt takes the row: its manager starts over, and is returned for the row's prefill."""
        self.rows[row].reset()
        self.joined[row] = True
        return self.rows[row]

    def leave(self, row: int) -> None:
        self.joined[row] = False

    def after_step(self) -> bool:
        """Between steps: each joined row's schedule; whether any row was compacted."""
        compacted = [manager.after_step() for manager, joined in zip(self.rows, self.joined) if joined]
        return any(compacted)

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


def new_store(model: ModelConfig, batch: int, compression: CompressionConfig, model_dtype: torch.dtype, device: torch.device) -> KVStore | None:
    """The store a compression config asks for (--kv-store), or None."""
    if not compression.store_slots:
        return None
    scored = compression.store_drops == "least_attended"
    return KVStore.allocate(model, batch, compression.store_slots, compression.store_dtype, model_dtype, compression.recall_pages, device, scored)


def decode_views(layers: list, store: KVStore | None, queries: torch.Tensor) -> list[QueryTap]:
    """The layers' views recalling from the store, if any, each writing its queries into queries[layer] [B, H, 1, D]."""
    if store is not None:
        layers = store.views(layers)
    return [QueryTap(layer, tap) for layer, tap in zip(layers, queries)]
