"""One batch through the engine's decode path for every policy: the full cache once, snapshotted
where each budget first compacts, then each policy at each budget resumed from its snapshot (or
from the start, for a BeaconKV variant whose beacons differ before its first compaction).

Each (policy, budget) is a cell, handed over as soon as it is done, so that a killed run keeps
every finished cell and a resumed one skips them. The loop is `engine.generation.generate`'s: `prefill`, then `decode_step` with a
`CompressionManager` and `manager.after_step()` between steps. Trace and text rows are
teacher-forced, continuation rows decoded greedily, all in the same batch. Resuming is exact:
until its first compaction every policy computes what the full cache computes
(tests/test_evaluate.py checks it).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from compression.config import CompressionConfig
from compression.manager import CompressionManager, CompressionStats, new_store
from engine.decode import StepState, decode_step, prefill
from kv.cache import KVCache
from engine.sampling import SamplingConfig
from evaluation.config import EvalConfig, cells_attention_records, split_storage
from evaluation.tasks import Row
from kv.contiguous import contiguous_cache
from models.transformer import Transformer

CPU = torch.device("cpu")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class Batch:
    rows: list[Row]
    length: int  # tokens after each prompt

    def __post_init__(self) -> None:
        self.prompts = [r.prompt for r in self.rows]
        # (row, first position, end) of each stated value, recall by recall: what a compaction keeps of it is recorded
        self.watched = [(b, len(r.prompt) + c.stated, len(r.prompt) + c.stated + c.n_tokens) for b, r in enumerate(self.rows) for c in r.recalls]
        self.forced = torch.tensor([r.forced or [0] * self.length for r in self.rows])  # [B, T]
        self.free = torch.tensor([r.kind == "continuation" for r in self.rows])  # [B] rows decoded greedily
        self.n_positions = max(map(len, self.prompts)) + self.length

    def indices(self, *kinds: str) -> list[int]:
        return [b for b, r in enumerate(self.rows) if r.kind in kinds]


@dataclass
class Compaction:
    step: int  # decode steps done when it happened
    next_position: torch.Tensor  # [B] absolute position of the next query
    watched: torch.Tensor  # [len(batch.watched)] share of the (layer, KV head) caches holding the whole watched span after it
    kept: torch.Tensor | None  # [L, B, H_kv, P] bool: the positions the cache holds after it (prefix, kept, window); on sampled compactions only


@dataclass
class State:
    """A run in progress. predicted[:, t] is the argmax of the logits that predict token t of the
    stream (for a free row: the token generated); logprob[:, t] is log p(forced token t)."""

    cache: KVCache
    manager: CompressionManager
    tokens: torch.Tensor  # [B] the token the next step feeds
    step: int  # decode steps done
    predicted: torch.Tensor  # [B, T] int64
    logprob: torch.Tensor  # [B, T] float32
    after_step_due: bool = False  # a step ran, its manager.after_step() has not yet


@dataclass
class Run:
    """What one policy did at one budget, and what it cost."""

    policy: str
    budget: int | None  # None: the full cache
    predicted: torch.Tensor
    logprob: torch.Tensor
    compactions: list[Compaction]
    steps: int  # decode steps this run executed itself (after resuming)
    seconds: float  # their wall time, the manager's work included
    stats: CompressionStats
    kv_cache_bytes: int
    query_buffer_bytes: int


def start(model: Transformer, batch: Batch, compression: CompressionConfig, n_slots: int, kv_dtype: str = "auto") -> State:
    """Prefill the prompts into a fresh cache of n_slots slots stored as `kv_dtype`, with a manager for `compression`."""
    B = len(batch.rows)
    cache = contiguous_cache(model, B, n_slots, kv_dtype, CPU)
    store = new_store(model.config, B, compression, model.dtype, CPU)
    manager = CompressionManager(compression, cache, model.config.n_heads, model.rope_cos, model.rope_sin, store)
    logits = prefill(model, cache, batch.prompts, policy=manager).float()
    predicted = torch.zeros(B, batch.length, dtype=torch.int64)
    predicted[:, 0] = logits.argmax(-1)
    logprob = torch.zeros(B, batch.length)
    logprob[:, 0] = logits.log_softmax(-1)[torch.arange(B), batch.forced[:, 0]]
    return State(cache, manager, predicted[:, 0].clone(), 0, predicted, logprob)


def recorder(config: EvalConfig, batch: Batch) -> CompressionConfig:
    """The full cache's manager: it records queries and beacons as BeaconKV v1 does (FPS per query
    head, a refresh each time the ring fills), and never compacts. Pinned to v1, not BeaconKV's
    defaults, so that saved passes stay valid when the defaults change."""
    return CompressionConfig("beacon", batch.length, 1, config.window, config.n_beacon, config.n_recent, fps_per_group=False, lazy_refresh=False)


def differs_before_compacting(compression: CompressionConfig, recorder: CompressionConfig) -> bool:
    """A policy whose beacons (or prompt) differ from the recorder's before its first compaction:
    no snapshot of the full cache fits it, so it runs from the start."""
    if compression.prefix_budget:
        return True
    return compression.policy == "beacon" and (compression.fps_per_group, compression.lazy_refresh) != (recorder.fps_per_group, recorder.lazy_refresh)


def snapshot(state: State) -> State:
    c = state.cache
    cache = KVCache(c.k.clone(), c.v.clone(), c.length.clone(), c.position.clone(), c.prompt_length.clone(), c.slot_ids, c.dtype)
    return _going_on(state, cache, _copy_manager(state.manager, state.manager.config, cache))


def resume(model: Transformer, snap: State, compression: CompressionConfig, length: int) -> State:
    """A policy picked up from a snapshot of the full cache taken before the policy's first compaction."""
    n_slots = compression.slots_needed(int(snap.cache.prompt_length.max()), length)
    cache = KVCache.allocate(model.config, snap.tokens.shape[0], n_slots, snap.cache.dtype, CPU)
    store = new_store(model.config, snap.tokens.shape[0], compression, snap.cache.dtype, CPU)
    cache.k.copy_(snap.cache.k[:, :, :, :n_slots])
    cache.v.copy_(snap.cache.v[:, :, :, :n_slots])
    for counter in ("length", "position", "prompt_length"):
        getattr(cache, counter).copy_(getattr(snap.cache, counter))
    return _going_on(snap, cache, _copy_manager(snap.manager, compression, cache, store))


def _going_on(state: State, cache: KVCache, manager: CompressionManager) -> State:
    """`state`, continued with another cache and manager."""
    return State(cache, manager, state.tokens.clone(), state.step, state.predicted.clone(), state.logprob.clone(), state.after_step_due)


def _copy_manager(source: CompressionManager, compression: CompressionConfig, cache: KVCache, store=None) -> CompressionManager:
    """A manager for `compression` in the state `source` is in."""
    manager = CompressionManager(compression, cache, source.buffer.queries.shape[2], source.rope_cos, source.rope_sin, store)
    manager.resume(source.snapshot())
    return manager


def kept_positions(state: State, n_positions: int) -> torch.Tensor:
    """[L, B, H_kv, n_positions] bool: the absolute positions the cache holds now."""
    positions = state.manager.slot_positions()  # [L, B, H_kv, S]
    in_use = state.cache.slot_ids[None, :] < state.cache.length[:, None]  # [B, S]
    positions = torch.where(in_use[None, :, None, :], positions, n_positions)
    kept = torch.zeros(*positions.shape[:3], n_positions + 1, dtype=torch.bool)
    return kept.scatter_(3, positions, True)[..., :n_positions]


def watched_kept(kept: torch.Tensor, batch: Batch) -> torch.Tensor:
    """[len(batch.watched)]: for each watched span, the share of (layer, KV head) caches holding all of it."""
    return torch.tensor([kept[:, b, :, start:end].all(-1).float().mean().item() for b, start, end in batch.watched])


def advance(
    model: Transformer, state: State, batch: Batch, snapshot_at: frozenset[int] = frozenset(), kept_every: int = 1, label: str = ""
) -> tuple[float, dict[int, State], list[Compaction]]:
    """Decode steps, each followed by manager.after_step(), until the stream's last token has been
    fed. Returns the seconds spent in the decode path and the manager (bookkeeping excluded), the
    snapshots taken between a step and its after_step(), and the compactions; every kept_every-th
    of them keeps the whole map of kept positions (long runs would not hold them all). With a
    label, progress goes to stderr every quarter of the way."""
    n_steps = batch.length - 1  # the last token is predicted, never fed
    finished, no_eos, greedy = torch.zeros(len(batch.rows), dtype=torch.bool), torch.tensor([-1]), SamplingConfig()
    rows = torch.arange(len(batch.rows))
    snapshots: dict[int, State] = {}
    compactions: list[Compaction] = []
    seconds = 0.0
    while True:
        if state.after_step_due:  # also the first thing after resuming from a snapshot
            done = state.manager.stats.compactions
            tick = time.perf_counter()
            state.manager.after_step()
            seconds += time.perf_counter() - tick
            state.after_step_due = False
            if state.manager.stats.compactions > done:
                kept = kept_positions(state, batch.n_positions)
                sampled = len(compactions) % kept_every == 0
                compactions.append(Compaction(state.step, state.cache.position.clone(), watched_kept(kept, batch), kept if sampled else None))
        if state.step == n_steps:
            return seconds, snapshots, compactions
        t = state.step  # this step feeds token t of each stream and predicts token t + 1
        tick = time.perf_counter()
        state.tokens.copy_(torch.where(batch.free, state.tokens, batch.forced[:, t]))  # teacher forcing
        logits = decode_step(model, state.cache, StepState(state.tokens, finished, no_eos, greedy), state.manager)
        seconds += time.perf_counter() - tick
        state.step += 1
        state.after_step_due = True
        if label and state.step % max(n_steps // 4, 1) == 0:
            log(f"    {label}: step {state.step}/{n_steps}")
        state.predicted[:, t + 1] = logits.argmax(-1)
        state.logprob[:, t + 1] = logits.float().log_softmax(-1)[rows, batch.forced[:, t + 1]]
        if state.step in snapshot_at:
            snapshots[state.step] = snapshot(state)


def run_from_start(model: Transformer, batch: Batch, compression: CompressionConfig, kv_dtype: str = "auto") -> tuple[State, list[Compaction]]:
    """One policy over the whole batch without a snapshot (the tests compare it with resuming)."""
    state = start(model, batch, compression, compression.slots_needed(max(map(len, batch.prompts)), batch.length), kv_dtype)
    _, _, compactions = advance(model, state, batch)
    return state, compactions


def full_cache_pass(model: Transformer, batch: Batch, config: EvalConfig) -> tuple[Run, dict[int, State]]:
    """The full cache over the whole batch, and the snapshots taken where each budget first compacts."""
    n_steps = batch.length - 1
    state = start(model, batch, recorder(config, batch), batch.n_positions)
    for how in sorted(cells_attention_records(config.policies)):
        state.manager.track_received_attention(how)
    log(f"  full cache: {n_steps} steps x {len(batch.rows)} rows")
    firsts = {config.first_compaction(b) for b in config.budgets}
    seconds, snapshots, _ = advance(model, state, batch, frozenset(f for f in firsts if f <= n_steps), label="full cache")
    seconds -= sum(state.manager.stats.refresh_s)  # the recorder's FPS refreshes are no part of the full cache
    log(f"  full cache: {seconds:.0f} s")
    return Run("none", None, state.predicted, state.logprob, [], n_steps, seconds, CompressionStats(), state.cache.nbytes, 0), snapshots


def run_all(
    model: Transformer,
    batch: Batch,
    config: EvalConfig,
    on_run: Callable[[Run], None],
    done: frozenset[tuple[str, int]] = frozenset(),
    kept_every: int = 1,
    full_pass: tuple[Run, dict[int, State]] | None = None,
) -> None:
    """The full cache once (unless its pass is given, as full_cache_pass returns it), then every
    (policy, budget) not in `done`, each resumed from the snapshot of the full cache taken where
    its budget first compacts. on_run(run) follows each."""
    n_steps = batch.length - 1
    full, snapshots = full_pass or full_cache_pass(model, batch, config)
    on_run(full)
    cells = [(policy, budget) for budget in config.budgets for policy in config.policies if (policy, budget) not in done]
    once: dict[str, Run] = {}  # the full cache in another storage, which compacts at no budget: one run stands for all
    for i, (policy, budget) in enumerate(cells):
        first = config.first_compaction(budget)
        spec, kv_dtype = split_storage(policy)
        compression = recorder(config, batch) if spec == "none" else config.compression(policy, budget)
        if first > n_steps and kv_dtype == "auto":
            log(f"  {policy} budget={budget}: never compacts within {n_steps} steps, so it is the full cache")
            on_run(replace(full, policy=policy, budget=budget))
            continue
        if policy in once:
            on_run(replace(once[policy], budget=budget))
            continue
        if kv_dtype != "auto" or differs_before_compacting(compression, recorder(config, batch)):
            first = 0  # a quantized cache differs from the first token on
            state = start(model, batch, compression, compression.slots_needed(max(map(len, batch.prompts)), batch.length), kv_dtype)
        else:
            state = resume(model, snapshots[first], compression, batch.length)
        seconds, _, compactions = advance(model, state, batch, kept_every=kept_every, label=f"{policy} budget={budget}")
        m = state.manager
        run = Run(policy, budget, state.predicted, state.logprob, compactions, n_steps - first, seconds, m.stats, state.cache.nbytes + m.nbytes, m.buffer.queries.nbytes)
        if spec == "none":
            once[policy] = run
        on_run(run)
        log(f"  [{i + 1}/{len(cells)}] {policy} budget={budget}: {n_steps - first} steps, {m.stats.compactions} compactions, {seconds:.0f} s")
