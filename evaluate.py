"""Every KV-cache policy on a real model, at equal budgets, through the engine's own decode path.

    python -m compression.evaluate --model smollm2          # the full run (see docs/eval/results.md)
    python -m compression.evaluate --model smollm2 --quick  # a smoke run
    python -m compression.evaluate --report docs/eval/results.json  # tables and plot again, from the JSON

Each policy runs `engine.decode.prefill` then `engine.decode.decode_step` with a
`CompressionManager`, calling `manager.after_step()` between steps, as `engine.generation.generate`
does. One batch holds three kinds of rows, all decoded together:

- reasoning traces, teacher-forced (the forced token is copied into `tokens` before each step);
- chunks of Python source, teacher-forced;
- prompts decoded freely (greedy).

Five tasks are scored from that one batch:

1. retrieval     a value stated once inside a trace ("Let q7 = 1459.") and recalled hundreds of
                 tokens later ("Recall: q7 ="): success = greedy decoding writes the value.
2. attention     future-attention recall: at each compaction, the share of the attention of the next
                 K queries (computed offline with the full cache) that lands on the kept positions.
3. loss          teacher-forced next-token NLL on the Python source, after the first compaction.
4. continuation  free greedy decoding against the full cache's: leading agreeing tokens, agreement.
5. cost          decode tok/s, time per compaction and per FPS refresh, KV-cache bytes.

Every policy computes exactly what the full cache computes until its first compaction, so the
full-cache run (whose manager records queries and beacons like any policy, and never compacts)
is snapshotted between the step and `after_step()` where a budget first compacts, and each policy
resumes from that snapshot. tests/test_evaluate.py checks that resuming equals running from the start.
"""

from __future__ import annotations

import os

# OpenMP threads that spin-wait while other processes share the CPU make matmuls ~10x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from compression.config import AGGREGATIONS, POLICIES, CompressionConfig
from compression.eval_tasks import Row, continuation_rows, reasoning_trace, text_rows
from compression.manager import CompressionManager, CompressionStats
from engine.decode import decode_step, prefill
from engine.kv_cache import KVCache
from engine.sampling import SamplingConfig
from errors import UserError, run_command
from models.transformer import Transformer, apply_rope
from weights.loader import load_model
from weights.packaged import CHECKPOINTS, QWEN_CODER_NAME, SMOLLM2_NAME
from weights.tokenizer import Tokenizer

TASKS = ("retrieval", "attention", "loss", "continuation", "cost")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODELS = {
    "smollm2": (SMOLLM2_NAME, "python -m weights.packaged smollm2"),
    "qwen-coder": (QWEN_CODER_NAME, "python -m weights.packaged qwen-coder"),
}
CPU = torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# Options


@dataclass(frozen=True)
class Sizes:
    length: int  # tokens after each prompt: forced, or generated
    n_traces: int  # reasoning traces (tasks 1 and 2)
    n_recalls: int  # recalls per trace
    n_text: int  # chunks of Python source (tasks 2 and 3)
    text_prompt: int  # their protected prefix, in tokens
    n_continuations: int  # prompts decoded freely (task 4)
    continuation_prompt: int
    future_queries: int  # K of task 2


# Sized for a 2-core CPU: the default run takes about 15-20 min with SmolLM2-135M (one step of the
# 9-row batch ~0.3 s), about 4x that with Qwen2.5-0.5B; --quick about a minute with SmolLM2.
FULL = Sizes(length=256, n_traces=5, n_recalls=3, n_text=2, text_prompt=32, n_continuations=2, continuation_prompt=64, future_queries=16)
QUICK = Sizes(length=144, n_traces=1, n_recalls=1, n_text=1, text_prompt=16, n_continuations=1, continuation_prompt=32, future_queries=4)
# (budgets, hysteresis, window, n_beacon, n_recent) where the command line does not say.
FULL_COMPRESSION = ((32, 64, 128), 16, 16, 16, 16)
QUICK_COMPRESSION = ((16,), 8, 8, 4, 8)
QUICK_POLICIES = ("beacon", "streaming", "snapkv")


@dataclass(frozen=True)
class EvalConfig:
    checkpoint: Path
    policies: tuple[str, ...]  # the compressing ones; the full cache always runs
    budgets: tuple[int, ...]
    hysteresis: int
    window: int
    n_beacon: int
    n_recent: int
    aggregation: str  # BeaconKV's
    tasks: tuple[str, ...]
    dtype: str
    out: Path
    sizes: Sizes
    seed: int = 0

    def compression(self, policy: str, budget: int) -> CompressionConfig:
        return CompressionConfig(policy, budget, self.hysteresis, self.window, self.n_beacon, self.n_recent, self.aggregation, self.seed)

    def first_compaction(self, budget: int) -> int:
        """Decode steps after which any policy with this budget compacts for the first time."""
        return budget + self.hysteresis + self.window + 1


def resolve_model(name: str) -> Path:
    if name in MODELS:
        folder, command = CHECKPOINTS / MODELS[name][0], MODELS[name][1]
        if not (folder / "config.json").is_file() or not (folder / "tokenizer.json").is_file():
            raise UserError(f"model {name!r} is not in {folder} yet; create it with `{command}`")
        return folder
    if not (Path(name) / "config.json").is_file():
        raise UserError(f"--model {name!r} is neither {' nor '.join(MODELS)} nor a checkpoint folder with config.json")
    return Path(name)


def parse_args(argv: list[str] | None) -> EvalConfig:
    p = argparse.ArgumentParser(prog="python -m compression.evaluate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, qwen-coder, or a checkpoint folder")
    p.add_argument("--policies", help=f"comma-separated (default: all; --quick: {','.join(QUICK_POLICIES)}); the full cache, 'none', always runs as the reference")
    p.add_argument("--budgets", help="comma-separated generated tokens kept by a compaction (default 32,64,128; --quick: 16)")
    p.add_argument("--hysteresis", type=int, help="compact when the kept part exceeds budget + this (default 16; --quick: 8)")
    p.add_argument("--window", type=int, help="recent tokens never evicted (default 16; --quick: 8)")
    p.add_argument("--n-beacon", type=int, help="BeaconKV beacons per layer and query head (default 16; --quick: 4)")
    p.add_argument("--n-recent", type=int, help="recent queries buffered: every policy's observation window (default 16; --quick: 8)")
    p.add_argument("--aggregation", choices=AGGREGATIONS, default=CompressionConfig().aggregation, help="BeaconKV: how scores combine over queries and the heads of a KV group")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from {','.join(TASKS)}")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="float32 (default: faster than bfloat16 for batched matmuls on CPUs without native bf16) or bfloat16")
    p.add_argument("--length", type=int, help=f"tokens per stream after its prompt (default {FULL.length}; --quick: {QUICK.length})")
    p.add_argument("--traces", type=int, help=f"reasoning traces (default {FULL.n_traces}; --quick: {QUICK.n_traces})")
    p.add_argument("--out", type=Path, default=Path("docs/eval"), help="folder for results.md, results.json, quality_vs_budget.png")
    p.add_argument("--quick", action="store_true", help="three short streams, one budget, three policies: a smoke run")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: on a small shared CPU a second thread slows the small matmuls down; 0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    budgets, hysteresis, window, n_beacon, n_recent = QUICK_COMPRESSION if a.quick else FULL_COMPRESSION
    policies = _names(a.policies, POLICIES, "--policies") if a.policies else QUICK_POLICIES if a.quick else POLICIES
    tasks = _names(a.tasks, TASKS, "--tasks")
    sizes = QUICK if a.quick else FULL
    sizes = replace(sizes, length=a.length or sizes.length, n_traces=a.traces if a.traces is not None else sizes.n_traces)
    if a.threads:
        torch.set_num_threads(a.threads)
    config = EvalConfig(
        checkpoint=resolve_model(a.model),
        policies=tuple(x for x in policies if x != "none"),
        budgets=tuple(sorted(_numbers(a.budgets))) if a.budgets else budgets,
        hysteresis=_default(a.hysteresis, hysteresis),
        window=_default(a.window, window),
        n_beacon=_default(a.n_beacon, n_beacon),
        n_recent=_default(a.n_recent, n_recent),
        aggregation=a.aggregation,
        tasks=tasks,
        dtype=a.dtype,
        out=a.out,
        sizes=sizes,
        seed=a.seed,
    )
    for budget in config.budgets:
        config.compression("beacon", budget)  # every number checked, with the engine's own messages
    return config


def _names(text: str, allowed: tuple[str, ...], option: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in names if x not in allowed]
    if unknown or not names:
        raise UserError(f"{option}: unknown or missing {','.join(unknown) or 'names'}; choose from {','.join(allowed)}")
    return tuple(x for x in allowed if x in names)


def _numbers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--budgets takes comma-separated integers, got {text!r}") from None


def _default(given: int | None, default: int) -> int:
    return default if given is None else given


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# One batch through the decode path, with snapshots and resumption


@dataclass
class Batch:
    rows: list[Row]
    length: int  # tokens after each prompt

    def __post_init__(self):
        self.prompts = [r.prompt for r in self.rows]
        self.forced = torch.tensor([r.forced or [0] * self.length for r in self.rows])  # [B, T]
        self.free = torch.tensor([r.kind == "continuation" for r in self.rows])  # [B] rows decoded greedily
        self.n_positions = max(map(len, self.prompts)) + self.length

    def indices(self, *kinds: str) -> list[int]:
        return [b for b, r in enumerate(self.rows) if r.kind in kinds]


@dataclass
class Compaction:
    step: int  # decode steps done when it happened
    next_position: torch.Tensor  # [B] absolute position of the next query
    kept: torch.Tensor  # [L, B, H_kv, P] bool: the positions the cache holds after it (prefix, kept, window)


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


def start(model: Transformer, batch: Batch, compression: CompressionConfig, n_slots: int) -> State:
    """Prefill the prompts into a fresh cache of n_slots slots, with a manager for `compression`."""
    B = len(batch.rows)
    cache = KVCache.allocate(model.config, B, n_slots, model.embed.weight.dtype, CPU)
    manager = CompressionManager(compression, cache, model.config.n_heads, model.rope_cos, model.rope_sin)
    logits = prefill(model, cache, batch.prompts, compression=manager).float()
    predicted = torch.zeros(B, batch.length, dtype=torch.int64)
    predicted[:, 0] = logits.argmax(-1)
    logprob = torch.zeros(B, batch.length)
    logprob[:, 0] = logits.log_softmax(-1)[torch.arange(B), batch.forced[:, 0]]
    return State(cache, manager, predicted[:, 0].clone(), 0, predicted, logprob)


def recorder(config: EvalConfig, batch: Batch) -> CompressionConfig:
    """The full cache's manager: it records queries and beacons as BeaconKV's does, and never compacts."""
    return CompressionConfig("beacon", batch.length, 1, config.window, config.n_beacon, config.n_recent)


def snapshot(state: State) -> State:
    c = state.cache
    cache = KVCache(c.k.clone(), c.v.clone(), c.length.clone(), c.position.clone(), c.prompt_length.clone(), c.slot_ids)
    return _going_on(state, cache, _copy_manager(state.manager, state.manager.config, cache))


def resume(model: Transformer, snap: State, compression: CompressionConfig, length: int) -> State:
    """A policy picked up from a snapshot of the full cache taken before the policy's first compaction."""
    n_slots = compression.slots_needed(int(snap.cache.prompt_length.max()), length)
    cache = KVCache.allocate(model.config, snap.tokens.shape[0], n_slots, snap.cache.k.dtype, CPU)
    cache.k.copy_(snap.cache.k[:, :, :, :n_slots])
    cache.v.copy_(snap.cache.v[:, :, :, :n_slots])
    for counter in ("length", "position", "prompt_length"):
        getattr(cache, counter).copy_(getattr(snap.cache, counter))
    return _going_on(snap, cache, _copy_manager(snap.manager, compression, cache))


def _going_on(state: State, cache: KVCache, manager: CompressionManager) -> State:
    """`state`, continued with another cache and manager."""
    return State(cache, manager, state.tokens.clone(), state.step, state.predicted.clone(), state.logprob.clone(), state.after_step_due)


def _copy_manager(source: CompressionManager, compression: CompressionConfig, cache: KVCache) -> CompressionManager:
    """A manager for `compression` in the state `source` is in. The recorder's buffer is
    [beacons | ring of recent queries]; a baseline's is the same ring alone, at the same offsets."""
    manager = CompressionManager(compression, cache, source.queries.shape[2], source.rope_cos, source.rope_sin)
    skip = source.n_beacon - manager.n_beacon
    if skip not in (0, source.n_beacon) or manager.queries.shape[3] != source.queries.shape[3] - skip:
        raise ValueError("the snapshot's query buffer does not match the policy's")
    manager.queries.copy_(source.queries[:, :, :, skip:])
    manager.query_slot.copy_(source.query_slot - skip)
    manager.steps, manager.generated = source.steps, source.generated
    return manager


def kept_positions(state: State, n_positions: int) -> torch.Tensor:
    """[L, B, H_kv, n_positions] bool: the absolute positions the cache holds now."""
    positions = state.manager.slot_positions()  # [L, B, H_kv, S]
    in_use = state.cache.slot_ids[None, :] < state.cache.length[:, None]  # [B, S]
    positions = torch.where(in_use[None, :, None, :], positions, n_positions)
    kept = torch.zeros(*positions.shape[:3], n_positions + 1, dtype=torch.bool)
    return kept.scatter_(3, positions, True)[..., :n_positions]


def advance(model: Transformer, state: State, batch: Batch, snapshot_at: frozenset[int] = frozenset()) -> tuple[float, dict[int, State], list[Compaction]]:
    """Decode steps, each followed by manager.after_step(), until the stream's last token has been
    fed. Returns the seconds spent in the decode path and the manager (bookkeeping excluded), the
    snapshots taken between a step and its after_step(), and the compactions."""
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
                compactions.append(Compaction(state.step, state.cache.position.clone(), kept_positions(state, batch.n_positions)))
        if state.step == n_steps:
            return seconds, snapshots, compactions
        t = state.step  # this step feeds token t of each stream and predicts token t + 1
        tick = time.perf_counter()
        state.tokens.copy_(torch.where(batch.free, state.tokens, batch.forced[:, t]))  # teacher forcing
        logits = decode_step(model, state.cache, state.tokens, finished, no_eos, greedy, state.manager)
        seconds += time.perf_counter() - tick
        state.step += 1
        state.after_step_due = True
        state.predicted[:, t + 1] = logits.argmax(-1)
        state.logprob[:, t + 1] = logits.float().log_softmax(-1)[rows, batch.forced[:, t + 1]]
        if state.step in snapshot_at:
            snapshots[state.step] = snapshot(state)


def run_from_start(model: Transformer, batch: Batch, compression: CompressionConfig) -> tuple[State, list[Compaction]]:
    """One policy over the whole batch without a snapshot (the tests compare it with resuming)."""
    state = start(model, batch, compression, compression.slots_needed(max(map(len, batch.prompts)), batch.length))
    _, _, compactions = advance(model, state, batch)
    return state, compactions


def run_all(model: Transformer, batch: Batch, config: EvalConfig, on_runs: Callable[[int | None, dict[str, Run]], None]) -> dict[tuple[str, int | None], Run]:
    """The full cache once, then every policy at every budget resumed from its snapshot.
    on_runs(None, {"none": run}) follows the full cache, on_runs(budget, {policy: run}) each budget."""
    n_steps = batch.length - 1
    firsts = {b: config.first_compaction(b) for b in config.budgets}
    state = start(model, batch, recorder(config, batch), batch.n_positions)
    log(f"  full cache: {n_steps} steps x {len(batch.rows)} rows")
    seconds, snapshots, _ = advance(model, state, batch, frozenset(f for f in firsts.values() if f <= n_steps))
    seconds -= sum(state.manager.stats.refresh_s)  # the recorder's FPS refreshes are no part of the full cache
    full = Run("none", None, state.predicted, state.logprob, [], n_steps, seconds, CompressionStats(), state.cache.nbytes, 0)
    log(f"  full cache: {seconds:.0f} s")
    runs: dict[tuple[str, int | None], Run] = {("none", None): full}
    on_runs(None, {"none": full})
    for budget in config.budgets:
        for policy in config.policies:
            if firsts[budget] > n_steps:
                log(f"  {policy} budget={budget}: never compacts within {n_steps} steps, so it is the full cache")
                runs[(policy, budget)] = replace(full, policy=policy, budget=budget)
                continue
            state = resume(model, snapshots[firsts[budget]], config.compression(policy, budget), batch.length)
            seconds, _, compactions = advance(model, state, batch)
            m = state.manager
            runs[(policy, budget)] = Run(policy, budget, state.predicted, state.logprob, compactions, n_steps - firsts[budget], seconds, m.stats, state.cache.nbytes, m.queries.nbytes)
            log(f"  {policy} budget={budget}: {n_steps - firsts[budget]} steps, {m.stats.compactions} compactions, {seconds:.0f} s")
        on_runs(budget, {p: runs[(p, budget)] for p in config.policies})
    return runs


# ----------------------------------------------------------------------------------------------
# Task 2: the future queries' attention, computed offline with the full cache


class _QueryCatcher:
    """Stands in for the compression manager in prefill, to keep the queries it is handed."""

    def seed(self, queries: torch.Tensor, lengths: torch.Tensor) -> None:
        self.queries = queries


@dataclass
class FullAttention:
    """Pre-RoPE queries [L, B, H, P, D] and post-RoPE keys [L, B, H_kv, P, D] of whole streams."""

    queries: torch.Tensor
    keys: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    lengths: torch.Tensor  # [B] tokens per stream

    @classmethod
    def of(cls, model: Transformer, sequences: list[list[int]]) -> FullAttention:
        cache = KVCache.allocate(model.config, len(sequences), max(map(len, sequences)), model.embed.weight.dtype, CPU)
        catcher = _QueryCatcher()
        prefill(model, cache, sequences, compression=catcher)
        return cls(catcher.queries.float(), cache.k.float(), model.rope_cos, model.rope_sin, cache.length.clone())

    def probabilities(self, first: torch.Tensor, n_queries: int) -> torch.Tensor:
        """softmax(q_rot . k / sqrt(D)) [L, B, H_kv, G, K, P] of the queries at positions
        first .. first + K - 1 (first: [B]) over the positions up to each query's own."""
        L, B, H, P, D = self.queries.shape
        H_kv = self.keys.shape[2]
        at = first[:, None] + torch.arange(n_queries)  # [B, K]
        q = self.queries.gather(3, at[None, :, None, :, None].expand(L, B, H, n_queries, D))
        q = apply_rope(q, self.rope_cos[at], self.rope_sin[at])  # cos/sin [B, K, D] broadcast over L and H
        q = q.view(L, B, H_kv, H // H_kv, n_queries, D)  # query head h reads KV head h // G
        logits = torch.einsum("lbkgqd,lbkpd->lbkgqp", q, self.keys) / math.sqrt(D)
        visible = torch.arange(P)[None, None, :] <= at[:, :, None]  # [B, K, P]
        return logits.masked_fill(~visible[None, :, None, None], float("-inf")).softmax(-1)


def attention_recall(probabilities: torch.Tensor, kept: torch.Tensor, region: torch.Tensor) -> torch.Tensor:
    """Share of each query's attention inside `region` [B, P] that falls on `kept` positions
    [L, B, H_kv, P]: [L, B, H_kv, G, K] for probabilities [L, B, H_kv, G, K, P]."""
    inside = probabilities * region[None, :, None, None, None, :]
    return (inside * kept[:, :, :, None, None, :]).sum(-1) / inside.sum(-1).clamp_min(1e-30)


@dataclass
class RecallShares:
    context: float  # share of the attention on all positions before the compaction
    evictable: float  # the same on the positions between the prompt and the recent window
    n_compactions: int


def future_attention_recall(full: FullAttention, compactions: list[Compaction], rows: list[int], prompt_lengths: torch.Tensor, window: int, n_queries: int) -> RecallShares:
    """Mean over compactions, the given rows (of the batch, and of `full` in that order), layers,
    query heads and the next n_queries queries."""
    context, evictable = [], []
    for c in compactions:
        next_position = c.next_position[rows]
        if bool((next_position + n_queries > full.lengths).any()):
            continue  # fewer than n_queries queries follow
        probs = full.probabilities(next_position, n_queries)
        positions = torch.arange(probs.shape[-1])[None, :]
        old = positions < next_position[:, None]  # [B, P]
        middle = old & (positions >= prompt_lengths[rows, None]) & (positions < (next_position - window)[:, None])
        kept = c.kept[:, rows, :, : probs.shape[-1]]
        context.append(attention_recall(probs, kept, old).mean())
        evictable.append(attention_recall(probs, kept, middle).mean())
    if not context:
        return RecallShares(float("nan"), float("nan"), 0)
    return RecallShares(torch.stack(context).mean().item(), torch.stack(evictable).mean().item(), len(context))


def full_cache_compactions(like: list[Compaction]) -> list[Compaction]:
    """The full cache seen at the moments of another run's compactions: every past position is kept."""
    out = []
    for c in like:
        P = c.kept.shape[-1]
        kept = (torch.arange(P)[None, :] < c.next_position[:, None])[None, :, None, :].expand_as(c.kept)
        out.append(Compaction(c.step, c.next_position, kept))
    return out


# ----------------------------------------------------------------------------------------------
# Scoring tasks 1, 3, 4 and 5


@dataclass
class RetrievalResult:
    success: float
    hits: list[bool]  # per recall, trace by trace
    distances: list[int]  # tokens between the statement and the recall
    kept: list[float] = field(default_factory=list)  # per recall: share of the (layer, KV head) caches holding the whole stated value then

    @property
    def kept_mean(self) -> float:
        return sum(self.kept) / len(self.kept) if self.kept else float("nan")


def retrieval(run: Run, batch: Batch, tokenizer: Tokenizer) -> RetrievalResult:
    """A recall succeeds when each answer token is the argmax given the ones before it (so greedy
    decoding writes the value) and the token after the value is not one more digit."""
    hits, distances, kept = [], [], []
    for b in batch.indices("trace"):
        prompt = len(batch.prompts[b])
        for r in batch.rows[b].recalls:
            answer = range(r.start, r.start + r.n_tokens)
            exact = all(int(run.predicted[b, t]) == batch.rows[b].forced[t] for t in answer)
            after = tokenizer.decode([int(run.predicted[b, r.start + r.n_tokens])]).strip()
            hits.append(exact and not after[:1].isdigit())
            distances.append(r.distance)
            # The cache that predicts the answer: as the last compaction before that step left it.
            before = [c for c in run.compactions if c.step < r.start]
            value = slice(prompt + r.stated, prompt + r.stated + r.n_tokens)
            kept.append(before[-1].kept[:, b, :, value].all(-1).float().mean().item() if before else 1.0)
    return RetrievalResult(sum(hits) / max(len(hits), 1), hits, distances, kept)


@dataclass
class LossResult:
    nll: float  # mean over the source tokens predicted after the first compaction
    nll_full: float  # the full cache's on the same tokens
    n_tokens: int

    @property
    def delta(self) -> float:
        return self.nll - self.nll_full


def streaming_loss(run: Run, full: Run, rows: list[int], first_scored: int) -> LossResult:
    nll, nll_full = -run.logprob[rows, first_scored:], -full.logprob[rows, first_scored:]
    return LossResult(nll.mean().item(), nll_full.mean().item(), nll.numel())


@dataclass
class ContinuationResult:
    leading: float  # tokens equal to the full cache's before the first difference (mean over prompts)
    agreement: float  # share of the tokens equal to the full cache's
    n_tokens: int  # tokens compared per prompt: those generated after the first compaction


def continuation(run: Run, full: Run, rows: list[int], first_affected: int) -> ContinuationResult:
    same = run.predicted[rows, first_affected:] == full.predicted[rows, first_affected:]  # [B', T']
    return ContinuationResult(same.cumprod(-1).sum(-1).float().mean().item(), same.float().mean().item(), same.shape[1])


@dataclass
class CostResult:
    tokens_per_s: float  # decode throughput of the batch, compactions and refreshes included
    ms_per_compaction: float
    ms_per_refresh: float
    kv_cache_mib: float  # the whole batch's static cache
    query_buffer_mib: float
    rows: int


def cost(run: Run, rows: int) -> CostResult:
    def mean_ms(xs: list[float]) -> float:
        return 1000 * sum(xs) / len(xs) if xs else float("nan")

    return CostResult(
        rows * run.steps / run.seconds if run.seconds > 0 else float("nan"),
        mean_ms(run.stats.compaction_s),
        mean_ms(run.stats.refresh_s),
        run.kv_cache_bytes / 2**20,
        run.query_buffer_bytes / 2**20,
        rows,
    )


# ----------------------------------------------------------------------------------------------
# The evaluation


@dataclass
class Results:
    model: str
    config: dict
    # task -> policy -> budget ("64", ...; "full" where one number stands for every budget) -> result
    retrieval: dict[str, dict[str, RetrievalResult]] = field(default_factory=dict)
    attention: dict[str, dict[str, RecallShares]] = field(default_factory=dict)
    loss: dict[str, dict[str, LossResult]] = field(default_factory=dict)
    continuation: dict[str, dict[str, ContinuationResult]] = field(default_factory=dict)
    cost: dict[str, dict[str, CostResult]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)  # the full cache's free continuations, to look at

    def put(self, task: str, policy: str, budget: int | None, value) -> None:
        getattr(self, task).setdefault(policy, {})[str(budget) if budget is not None else "full"] = value


def build_batch(tokenizer: Tokenizer, config: EvalConfig) -> Batch:
    """The rows the selected tasks need (cost alone times every kind)."""
    s, tasks = config.sizes, set(config.tasks) | ({"retrieval", "loss", "continuation"} if config.tasks == ("cost",) else set())
    rows = []
    if tasks & {"retrieval", "attention"}:
        rows += [reasoning_trace(tokenizer, s.length, 1000 * config.seed + i, s.n_recalls) for i in range(s.n_traces)]
    if tasks & {"loss", "attention"}:
        rows += text_rows(tokenizer, s.n_text, s.text_prompt, s.length)
    if "continuation" in tasks:
        rows += continuation_rows(tokenizer, s.n_continuations, s.continuation_prompt, skip=s.n_text + 2)
    return Batch(rows, s.length)


def evaluate(config: EvalConfig, on_progress: Callable[[Results], None] | None = None) -> Results:
    """All tasks; on_progress(results so far) after the full cache and after each budget."""
    started = time.perf_counter()
    log(f"loading {config.checkpoint} in {config.dtype}")
    model = load_model(config.checkpoint, DTYPES[config.dtype], CPU)
    tokenizer = Tokenizer.from_dir(config.checkpoint)
    batch = build_batch(tokenizer, config)
    if batch.n_positions > model.config.max_position_embeddings:
        raise UserError(f"the streams need {batch.n_positions} positions, the model has {model.config.max_position_embeddings}: lower --length")
    settings = asdict(config) | {"threads": torch.get_num_threads(), "rows": [r.kind for r in batch.rows], "recalls": sum(len(r.recalls) for r in batch.rows)}
    results = Results(config.checkpoint.name, json.loads(json.dumps(settings, default=str)) | {"budgets_done": []})
    forced_rows = batch.indices("trace", "text")
    full_attention = None
    with torch.inference_mode():
        if "attention" in config.tasks:
            log(f"full-cache attention of {len(forced_rows)} whole streams (offline prefill)")
            full_attention = FullAttention.of(model, [batch.rows[b].prompt + batch.rows[b].forced for b in forced_rows])

        full: Run | None = None

        def on_runs(budget: int | None, runs: dict[str, Run]) -> None:
            nonlocal full
            if budget is None:
                full = runs["none"]
                score(results, batch, config, tokenizer, full, None, {})
            else:
                score(results, batch, config, tokenizer, full, budget, runs)
                if full_attention is not None:
                    score_attention(results, full_attention, batch, config, budget, runs)
                results.config["budgets_done"].append(budget)
            results.seconds["total"] = time.perf_counter() - started
            results.config["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            if on_progress is not None:
                on_progress(results)

        kinds = [r.kind for r in batch.rows]
        log(f"{len(kinds)} rows ({kinds.count('trace')} traces, {kinds.count('text')} source chunks, {kinds.count('continuation')} free), {batch.length} tokens each")
        run_all(model, batch, config, on_runs)
    return results


def score(results: Results, batch: Batch, config: EvalConfig, tokenizer: Tokenizer, full: Run, budget: int | None, runs: dict[str, Run]) -> None:
    """Tasks 1, 3, 4 and 5: the full cache's own numbers (budget None), or every policy's at a budget."""
    traces, text, free = batch.indices("trace"), batch.indices("text"), batch.indices("continuation")
    if budget is None:
        results.put("cost", "none", None, cost(full, len(batch.rows)))
        results.samples = [tokenizer.decode(full.predicted[b].tolist()) for b in free]
        if traces and "retrieval" in config.tasks:
            results.put("retrieval", "none", None, retrieval(full, batch, tokenizer))
            if results.retrieval["none"]["full"].success < 0.5:
                results.notes.append("the full cache recalls under half of the facts: the retrieval task says little about this model")
        return
    after = min(config.first_compaction(budget) + 1, batch.length - 1)  # the first token a compaction can change
    if text and "loss" in config.tasks:
        results.put("loss", "none", budget, streaming_loss(full, full, text, after))
    for policy, run in runs.items():
        results.put("cost", policy, budget, cost(run, len(batch.rows)))
        if traces and "retrieval" in config.tasks:
            results.put("retrieval", policy, budget, retrieval(run, batch, tokenizer))
        if text and "loss" in config.tasks:
            results.put("loss", policy, budget, streaming_loss(run, full, text, after))
        if free and "continuation" in config.tasks:
            results.put("continuation", policy, budget, continuation(run, full, free, after))


def score_attention(results: Results, full_attention: FullAttention, batch: Batch, config: EvalConfig, budget: int, runs: dict[str, Run]) -> None:
    """Task 2 at one budget; the full cache is seen at the moments the policies compacted."""
    rows = batch.indices("trace", "text")
    prompt_lengths = torch.tensor([len(p) for p in batch.prompts])
    K = config.sizes.future_queries
    for policy, run in runs.items():
        results.put("attention", policy, budget, future_attention_recall(full_attention, run.compactions, rows, prompt_lengths, config.window, K))
    schedule = next((r.compactions for r in runs.values() if r.compactions), [])
    results.put("attention", "none", budget, future_attention_recall(full_attention, full_cache_compactions(schedule), rows, prompt_lengths, config.window, K))


# ----------------------------------------------------------------------------------------------
# Reporting


@dataclass(frozen=True)
class Column:
    title: str
    meaning: str
    text: Callable  # result -> the table cell
    panel: str = ""  # title of the plot's panel
    value: Callable | None = None  # result -> the number plotted


COLUMNS = {
    "retrieval": Column(
        "Retrieval: share of facts recalled",
        "greedy decoding writes a value stated once in the trace, hundreds of tokens before the recall; in "
        "brackets, the share of the (layer, KV head) caches that still held every token of the value at the recall",
        lambda r: f"{r.success:.0%} ({sum(r.hits)}/{len(r.hits)}; {r.kept_mean:.0%})",
        "retrieval: share of facts recalled",
        lambda r: r.success,
    ),
    "attention": Column(
        "Future-attention recall, evictable part",
        "share of the full-cache attention of the next K queries, on the positions between the prompt and the "
        "recent window, that falls on positions the policy kept; mean over compactions, rows, layers, query heads, queries",
        lambda r: f"{r.evictable:.3f}",
        "future-attention recall (evictable part)",
        lambda r: r.evictable,
    ),
    "attention_context": Column(
        "Future-attention recall, whole context",
        "the same share over all positions before the compaction (prompt and window included)",
        lambda r: f"{r.context:.4f}",
    ),
    "loss": Column(
        "Streaming loss: NLL on Python source",
        "mean next-token NLL in nats over the tokens after the first compaction, and its difference from the full cache's",
        lambda r: f"{r.nll:.3f} ({r.delta:+.3f})",
        "streaming loss: NLL increase over the full cache",
        lambda r: r.delta,
    ),
    "continuation": Column(
        "Continuation fidelity",
        "free greedy decoding: tokens equal to the full cache's before the first difference, counted from the "
        "first compaction (mean over prompts), and the share of all those tokens that are equal",
        lambda r: f"{r.leading:.0f} ({r.agreement:.0%})",
        "continuation: share of tokens equal to the full cache's",
        lambda r: r.agreement,
    ),
    "cost": Column(
        "Cost",
        "decode tokens/s of the whole batch (compactions and refreshes included) / ms per compaction / "
        "ms per FPS refresh (BeaconKV) / KV cache MiB of the batch",
        lambda r: " / ".join(
            [f"{r.tokens_per_s:.1f} tok/s"]
            + ([f"{r.ms_per_compaction:.0f} ms"] if r.ms_per_compaction == r.ms_per_compaction else [])
            + ([f"{r.ms_per_refresh:.1f} ms"] if r.ms_per_refresh == r.ms_per_refresh else [])
            + [f"{r.kv_cache_mib:.1f} MiB"]
        ),
        "cost: decode tokens/s of the batch",
        lambda r: r.tokens_per_s,
    ),
}


def table(results: Results, task: str) -> str:
    source = results.attention if task == "attention_context" else getattr(results, task)
    if not source:
        return ""
    column = COLUMNS[task]
    budgets = [str(b) for b in results.config["budgets"]]
    lines = [f"### {column.title}", "", column.meaning + ".", "", "| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
    for policy in ("none", *results.config["policies"]):
        by_budget = source.get(policy, {})
        cells = [column.text(by_budget.get(b, by_budget.get("full"))) if b in by_budget or "full" in by_budget else "" for b in budgets]
        if any(cells):
            lines.append(f"| {'full cache' if policy == 'none' else policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(results: Results) -> str:
    c, s = results.config, results.config["sizes"]
    kinds = c["rows"]
    lines = [
        f"# KV-cache policies on {results.model}",
        "",
        "Written by `python -m compression.evaluate`; the module docstring defines the tasks.",
        "",
        f"- budgets {c['budgets']}, hysteresis {c['hysteresis']}, window {c['window']}, n_beacon {c['n_beacon']}, n_recent {c['n_recent']}, BeaconKV aggregation {c.get('aggregation', 'max')}; {c['dtype']}, torch threads: {c['threads']}",
        f"- one batch of {len(kinds)} rows, {s['length']} tokens after each prompt: {kinds.count('trace')} reasoning traces "
        f"({c['recalls']} recalls in all), {kinds.count('text')} chunks of Python source, {kinds.count('continuation')} free continuations; K = {s['future_queries']} future queries",
        f"- wall time {results.seconds.get('total', 0) / 60:.1f} min, peak RSS {c.get('peak_rss_mib', 0):.0f} MiB",
    ]
    if c.get("budgets_done", c["budgets"]) != c["budgets"]:
        lines.append(f"- **partial results**: budgets done so far {c['budgets_done']} (the run is still going, or was stopped)")
    lines += [f"- note: {n}" for n in results.notes]
    tasks = [t for t in COLUMNS if t.split("_")[0] in c["tasks"]]
    return "\n".join(lines) + "\n\n" + "\n".join(t for t in (table(results, task) for task in tasks) if t)


def _finite(x):
    """JSON has no NaN: a number that does not apply becomes null."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and x != x else x


def plot(results: Results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [t for t in ("retrieval", "attention", "loss", "continuation", "cost") if getattr(results, t)]
    budgets = results.config["budgets"]
    columns = min(len(panels) + 1, 3)  # one more panel for the legend
    rows = -(-(len(panels) + 1) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.6 * rows), squeeze=False)
    axes = list(axes.flat)
    for ax, task in zip(axes, panels):
        source, column = getattr(results, task), COLUMNS[task]

        def series(policy: str) -> list[float]:
            got = source.get(policy, {})
            return [column.value(got.get(str(b), got.get("full"))) if str(b) in got or "full" in got else float("nan") for b in budgets]

        for policy in results.config["policies"]:
            ax.plot(budgets, series(policy), marker="o", label=policy, linewidth=2.8 if policy == "beacon" else 1.2)
        ax.plot(budgets, series("none"), "k--", label="full cache")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget (generated tokens kept)")
        ax.set_title(column.panel, fontsize=10)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[len(panels) :]:
        ax.axis("off")
    axes[len(panels)].legend(handles, labels, loc="center", fontsize=10, title="policy")
    fig.suptitle(f"KV-cache policies on {results.model}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


RESULT_TYPES = {"retrieval": RetrievalResult, "attention": RecallShares, "loss": LossResult, "continuation": ContinuationResult, "cost": CostResult}


def read_results(path: Path) -> Results:
    """Results back from a results.json (null stands for NaN there)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read results from {path}: {e}") from e

    def make(kind: type, fields: dict):
        return kind(**{k: float("nan") if v is None else v for k, v in fields.items()})

    tasks = {t: {p: {b: make(kind, f) for b, f in by.items()} for p, by in raw[t].items()} for t, kind in RESULT_TYPES.items()}
    return Results(raw["model"], raw["config"], **tasks, seconds=raw["seconds"], notes=raw["notes"], samples=raw.get("samples", []))


def write(results: Results, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(results)
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(_finite(asdict(results)), indent=1))
    plot(results, out / "quality_vs_budget.png")
    return text


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv

    def body() -> None:
        if args[:1] == ["--report"]:  # python -m compression.evaluate --report docs/eval/results.json
            if len(args) != 2:
                raise UserError("--report takes one results.json and nothing else")
            print(write(read_results(Path(args[1])), Path(args[1]).parent))
            return
        config = parse_args(args)
        results = evaluate(config, on_progress=lambda partial: write(partial, config.out))
        print(write(results, config.out))
        log(f"wrote {config.out}/results.md, results.json and quality_vs_budget.png; {results.seconds['total'] / 60:.1f} min")

    return run_command(body)

if __name__ == "__main__":
    sys.exit(main())
