"""The generation loop: one cache, one prefill, then one decode step per token.

A Session holds what lives on the device for a whole run: the cache, the few tensors the decode
step reads and advances, and what it was handed: a cache of any kind (kv/), a runner that builds
the step (eager here; compiled, engine/compile.py; a CUDA graph, engine/cuda_graph.py) and a KV
policy, if any (compression/manager.py). `generate` runs a batch of prompts through one session
on the plain cache; a chat runs every turn through the same session, each turn appended to it.
"""

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, Protocol

import torch

from engine.decode import KVPolicy, StepState, decode_step, prefill
from engine.sampling import RowSampling, SamplingConfig, sample, seen_tokens
from errors import UserError
from kv.cache import KVCache
from models.transformer import Transformer

# The one callback of a generation, after a prefill and after every step, with the sequences that
# have news: {index: its new token}, and {index: None} once, when it has ended (EOS, a stop, its
# token limit). The index is a row of the batch (generate) or a prompt (serve). It returns the
# sequences that must stop now (a stop string appeared in their text), or None.
OnTokens = Callable[[dict[int, int | None]], Iterable[int] | None]


class Sampled(NamedTuple):
    """What a prefill or a step hands the host, from one read of the device: each row's new token,
    and whether the row has finished (its token is EOS, now or at an earlier step, or the host
    stopped it). End of sequence is detected there, on the device, and nowhere else."""

    tokens: list[int]
    finished: list[bool]


class Decoded(NamedTuple):
    tokens: list[list[int]]  # per row, the generated ids, EOS excluded
    steps: int
    ended_on_eos: list[bool]  # per row, at the last step: its token was EOS (not a stop string, not the token limit)


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # per row, the generated ids, EOS excluded
    prompt_tokens: int  # summed over rows
    prefill_s: float
    decode_s: float
    decode_steps: int
    kv_cache_bytes: int  # allocated
    kv_peak_bytes: int  # held at the peak: all of it in the contiguous cache, the most blocks in use in the paged one
    compression: Any = None  # the KV policy's stats (compression.manager.CompressionStats), if one ran
    setup_s: float = 0.0  # of decode_s, the first step's, which built the step: compiled the blocks or captured a CUDA graph (0 when eager)
    speculation: Any = None  # speculative decoding's counts (engine.speculative.SpeculationStats), if it ran

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second over the steps after the first (which compiled or captured the step), summed over rows."""
        steps, seconds = (self.decode_steps - 1, self.decode_s - self.setup_s) if self.setup_s else (self.decode_steps, self.decode_s)
        return steps * len(self.tokens) / seconds if steps > 0 and seconds > 0 else 0.0

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def check_lengths(model: Transformer, prompts: list[list[int]], max_new_tokens: int) -> None:
    limit = model.config.max_position_embeddings
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("every prompt must have at least one token")
    if max_new_tokens < 1:
        raise UserError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > limit:
        raise UserError(
            f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the model's maximum of {limit} positions; "
            "shorten the prompt or lower --max-new-tokens"
        )


class Runner(Protocol):
    """How a session's decode step runs, chosen once: Eager below, engine/compile.py's Compiled,
    engine/cuda_graph.py's Graph."""

    builds: bool  # its first step builds the step (a compile, a capture), timed apart
    whole_cache: bool  # every step reads the whole buffer (one shape), not only the slots in use
    graph: bool  # a step replays recorded branches: per-row settings are read on the device alone

    def build(self, model: Transformer, step: Callable[..., Any], state: StepState, advanced: list[torch.Tensor]) -> Callable[..., Any]:
        """The callable step; `advanced` lists every tensor a step overwrites."""


class Eager:
    """The plain runner: the decode step as Python calls it, reading only the slots in use."""

    builds = False  # its first step builds nothing (a compiled or captured runner's does, and is timed)
    whole_cache = False  # a step may read fewer slots than the buffer holds
    graph = False  # a step may take branches on host values

    def build(self, model: Transformer, step: Callable[..., Any], state: StepState, advanced: list[torch.Tensor]) -> Callable[..., Any]:
        """The callable step; `advanced` lists every tensor a step overwrites."""
        return step


class Session:
    """One cache and the decode step bound to it, one row per sequence.

    Every row starts with one prefill and runs to the end (a chat appends each turn with another
    prefill). A continuous batch (engine/scheduler.py) starts its rows empty and fills them one at
    a time, between steps, with the same prefill and the same step."""

    def __init__(
        self, model: Transformer, cache: KVCache, *, eos_ids: frozenset[int], sampling: SamplingConfig | RowSampling = SamplingConfig(),
        policy: KVPolicy | None = None, runner: Runner = Eager(),
    ):
        """cache: any cache kind, allocated for the rows. sampling: one config for every row, or each
        row's own (RowSampling, which rows may change between steps). policy: a KV policy
        (compression.manager), or None. runner: how the step runs (Eager, or engine/compile.py's,
        engine/cuda_graph.py's)."""
        batch, device = cache.length.shape[0], model.device
        self.model, self.cache, self.policy, self.runner = model, cache, policy, runner
        sampling = sampling if isinstance(sampling, RowSampling) else RowSampling.same(sampling, batch, device)
        seen = None  # [B, V] bool, the tokens the repetition penalty applies to
        if sampling.penalises_repetition:
            seen = torch.zeros(batch, model.config.vocab_size, dtype=torch.bool, device=device)
        self.state = StepState(
            torch.zeros(batch, dtype=torch.int64, device=device),  # the next tokens to feed
            torch.zeros(batch, dtype=torch.bool, device=device),
            torch.tensor(sorted(eos_ids) or [-1], device=device),
            sampling,
            seen,
        )
        self.lengths = [0] * batch  # each row's slots in use, a host count: the eager read bound, a paged row's blocks
        self.holding = [True] * batch  # host: the rows that hold a sequence (a continuous batch's idle rows do not)
        self.idle = torch.zeros(batch, dtype=torch.bool, device=device)  # [B] the rows that hold none
        self.last_logits: torch.Tensor | None = None
        self._step: Callable[..., object] | None = None
        self.setup_s = 0.0  # the first step's time, when it compiled the blocks or captured a CUDA graph

    def prefill(self, prompts: list[list[int]]) -> Sampled:
        """Append one list of tokens per row; returns the first sampled token of each row."""
        self._fit([held + len(p) for held, p in zip(self.lengths, prompts)])
        self.prefill_rows(slice(None), self.cache, prompts, self.policy)
        first = self.sampled()  # the host sync that ends prefill
        self._lengths_changed()  # a KV policy may have compressed the prompts
        return first

    def prefill_rows(self, rows: slice, cache: KVCache, prompts: list[list[int]], policy: KVPolicy | None) -> None:
        """Prefill the rows' prompts into `cache` (the session's, or one row's view of it) and sample each row's first token."""
        state = self.state
        seen = None if state.seen is None else state.seen[rows]
        if seen is not None:
            seen |= seen_tokens(prompts, seen.shape[1], seen.device)
        logits = prefill(self.model, cache, prompts, policy=policy)
        self.last_logits = logits  # [B, V] at each prompt's last token
        hook = state.logits_hook
        first = sample(logits if hook is None else hook.adjust(logits, rows), state.sampling[rows], seen, cache.position)  # [B]; the positions the first tokens take
        if hook is not None:
            hook.record(logits, first, rows)
        state.tokens[rows] = first
        state.finished[rows] = torch.isin(first, state.eos)

    def sampled(self) -> Sampled:
        """Every row's last sampled token and whether it has finished, in one read of the device."""
        tokens, finished = self.state.tokens, self.state.finished
        both = torch.cat([tokens, finished.to(tokens.dtype)]).tolist()  # one read of both
        batch = tokens.shape[0]
        return Sampled(both[:batch], [bool(f) for f in both[batch:]])

    def step(self) -> Sampled:
        """Feed the last sampled tokens, sample the next ones (returned), compact on schedule. The
        first step builds the step (a compile, a CUDA graph's warm-up and capture) and is timed whole."""
        if self._step is not None:
            return self._advance()
        start = time.perf_counter()
        advanced = [self.cache.length, self.cache.position, *self.state.advanced()] + ([] if self.policy is None else self.policy.step_state())
        self._step = self.runner.build(self.model, partial(decode_step, self.model, self.cache, self.state, self.policy), self.state, advanced)
        sampled = self._advance()  # its read of the tokens waits for the device
        if self.runner.builds:
            self.setup_s = time.perf_counter() - start
        return sampled

    def _advance(self) -> Sampled:
        grown = [n + 1 if holds else 0 for n, holds in zip(self.lengths, self.holding)]
        self._fit(grown)
        # The step attends over the slots that can be in use, a bound the host knows: eager any size
        # costs nothing, and the compiled blocks take it as a variable (engine/compile.py). A CUDA
        # graph reads the whole buffer: one shape, one capture. A compressed cache is small already,
        # and its lengths shrink on the device.
        if not (self.runner.whole_cache or self.policy is not None):
            self._step(n_read=max(self.lengths) + 1)
        else:
            self._step()
        self.lengths = grown
        self._after_step()
        return self.sampled()

    def hold(self, row: int, holds: bool) -> None:
        """Between steps: the row now holds a sequence, or no longer does (a continuous batch's rows)."""
        self.holding[row] = holds
        self.idle[row] = not holds

    def _after_step(self) -> None:
        if not all(self.holding):  # an idle row stepped into the scratch block: its counters go back to zero
            for counter in (self.cache.length, self.cache.position):
                counter.masked_fill_(self.idle, 0)
        if self.policy is not None and self.policy.after_step():
            self._lengths_changed()

    def _fit(self, n_slots: list[int]) -> None:
        """Make room for each row's next n_slots slots (a paged cache hands out blocks)."""
        for row, n in enumerate(n_slots):
            self.cache.fit(row, n)

    def _lengths_changed(self) -> None:
        """After a compaction: read the rows' lengths back; a paged cache frees the emptied blocks at once."""
        for row, n in enumerate(self.cache.length.tolist()):
            self.set_length(row, n)

    def set_length(self, row: int, n_slots: int) -> None:
        self.lengths[row] = n_slots
        self.cache.fit(row, n_slots)

    def reset(self) -> None:
        """Empty the cache for a new conversation, keeping every buffer (and a captured graph)."""
        for counter in (self.cache.length, self.cache.position, self.cache.prompt_length):
            counter.zero_()
        self.state.finished.zero_()
        if self.state.seen is not None:
            self.state.seen.zero_()
        if self.policy is not None:
            self.policy.reset()
        self._lengths_changed()

    def stop_rows(self, rows: Iterable[int]) -> None:
        """From the host, between steps: these rows are done; the step feeds them their last token
        again from now on, and nothing reads what they emit."""
        for row in rows:
            self.state.finished[row] = True

    @property
    def kv_bytes(self) -> int:
        """The cache's bytes and what the policy holds beside it (a store)."""
        return self.cache.nbytes + (0 if self.policy is None else self.policy.nbytes)

    @property
    def kv_peak_bytes(self) -> int:
        return self.cache.peak_bytes + (0 if self.policy is None else self.policy.nbytes)

    @property
    def stats(self) -> Any:
        return None if self.policy is None else self.policy.stats


def decode(session: Session, first: Sampled, max_new_tokens: int, *, on_tokens: OnTokens | None = None) -> Decoded:
    """The token loop: from the tokens prefill sampled, step until every row has finished or
    max_new_tokens are out."""
    sampled, steps = first, 0
    rows = range(len(first.tokens))
    generated: list[list[int]] = [[] for _ in rows]
    told_end = [False for _ in rows]  # on_tokens has heard that the row ended
    while True:
        news: dict[int, int | None] = {}
        for row in rows:
            if told_end[row]:
                continue
            if sampled.finished[row]:  # on EOS, or stopped by the host at the last call
                news[row], told_end[row] = None, True
            else:
                generated[row].append(sampled.tokens[row])
                news[row] = sampled.tokens[row]
        stopped = set(on_tokens(news) or []) if on_tokens is not None else set()
        session.stop_rows(stopped)
        if all(told or row in stopped for row, told in zip(rows, told_end)) or steps + 1 == max_new_tokens:
            ends = {row: None for row in rows if not told_end[row]}
            if on_tokens is not None and ends:
                on_tokens(ends)
            return Decoded(generated, steps, sampled.finished)
        sampled = session.step()
        steps += 1


def run(session: Session, prompts: list[list[int]], max_new_tokens: int, on_tokens: OnTokens | None = None) -> GenerationResult:
    """Prefill the prompts (one per row of the session) and decode until every row has finished."""
    start = time.perf_counter()
    first = session.prefill(prompts)
    prefill_s = time.perf_counter() - start

    start = time.perf_counter()
    decoded = decode(session, first, max_new_tokens, on_tokens=on_tokens)
    decode_s = time.perf_counter() - start
    return GenerationResult(
        decoded.tokens, sum(map(len, prompts)), prefill_s, decode_s, decoded.steps, session.kv_bytes, session.kv_peak_bytes, session.stats, session.setup_s,
    )


def generate(
    model: Transformer, prompts: list[list[int]], max_new_tokens: int, *, eos_ids: frozenset[int], sampling: SamplingConfig = SamplingConfig(),
    on_tokens: OnTokens | None = None, runner: Runner = Eager(),
) -> GenerationResult:
    """Generate for a batch of prompts (any lengths) on the plain cache: each row holds its prompt
    and max_new_tokens slots; the step runs as the runner says (eager by default).
    engine/options.py's generate runs the same loop with features."""
    check_lengths(model, prompts, max_new_tokens)
    cache = KVCache.allocate(model.config, len(prompts), max(map(len, prompts)) + max_new_tokens, model.dtype, model.device)
    return run(Session(model, cache, eos_ids=eos_ids, sampling=sampling, runner=runner), prompts, max_new_tokens, on_tokens)
