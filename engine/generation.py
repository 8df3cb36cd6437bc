"""The generation loop: one cache, one prefill, then one decode step per token.

A Session holds what lives on the device for a whole run: the cache, the compression manager,
and the few tensors the decode step reads and advances. `generate` runs a batch of prompts
through one session; a chat runs every turn through the same one, each turn appended to it.
"""

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from compression.config import CompressionConfig
from compression.manager import CompressionManager, CompressionStats, PerRowManagers
from engine.compile import CompiledStep, compile_blocks
from engine.cuda_graph import capture_decode_step
from engine.decode import advanced_by_step, decode_step, prefill
from engine.kv_cache import KVCache
from engine.kv_store import KVStore
from engine.paged_cache import PageConfig, PagedKVCache
from engine.sampling import RowSampling, SamplingConfig, sample, seen_tokens
from errors import UserError
from models.kv_quant import kv_storage
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
    compression: CompressionStats | None = None
    setup_s: float = 0.0  # of decode_s, the first step's, which built the step: compiled the blocks or captured a CUDA graph (0 when eager)

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


class Session:
    """One cache and the decode step bound to it, for `batch` rows of up to `n_slots` slots.

    Every row starts with one prefill and runs to the end (a chat appends each turn with another
    prefill); rows that join and leave between steps are engine/scheduler.py's ContinuousSession."""

    def __init__(
        self,
        model: Transformer,
        batch: int,
        n_slots: int,
        *,
        eos_ids: frozenset[int],
        sampling: SamplingConfig | RowSampling = SamplingConfig(),
        compression: CompressionConfig = CompressionConfig(),
        compile: bool = False,
        cuda_graph: bool = False,
        pages: PageConfig | None = None,
        kv_dtype: str = "auto",
    ):
        """sampling: one config for every row, or each row's own (RowSampling, which rows may change
        between steps). kv_dtype: how the cache stores keys and values (models/kv_quant.py: kv_storage)."""
        device = model.device
        if cuda_graph and device.type != "cuda":
            raise UserError("CUDA graphs need the model on a CUDA device; drop --cuda-graph or use --device cuda")
        self.model = model
        self.sampling = sampling if isinstance(sampling, RowSampling) else RowSampling.same(sampling, batch, device)
        self.cache: KVCache | PagedKVCache
        dtype, bits = kv_storage(kv_dtype, model.dtype)
        if pages is None:
            self.cache = KVCache.allocate(model.config, batch, n_slots, dtype, device, bits=bits)
        else:
            self.cache = PagedKVCache.allocate(model.config, batch, n_slots, dtype, device, pages, bits=bits)
        self.cache.store = KVStore.for_compression(model.config, batch, compression, model.dtype, device)
        self.manager: CompressionManager | PerRowManagers | None = None
        if compression.enabled:
            self.manager = self._new_manager(compression)
        self.eos = torch.tensor(sorted(eos_ids) or [-1], device=device)
        # What the decode step reads and overwrites: the same tensors for the whole session, so
        # that a compiled step or a CUDA graph keeps pointing at them.
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=device)  # [B] the next tokens to feed
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)  # [B]
        self.seen = None  # [B, V] bool, the tokens the repetition penalty applies to
        if self.sampling.penalises_repetition:
            self.seen = torch.zeros(batch, model.config.vocab_size, dtype=torch.bool, device=device)
        self.compile, self.cuda_graph = compile, cuda_graph
        self.lengths = [0] * batch  # each row's slots in use, a host count: the eager read bound, a paged row's blocks
        self.last_logits: torch.Tensor | None = None
        self._step: Callable[..., object] | None = None
        self.setup_s = 0.0  # the first step's time, when it compiled the blocks or captured a CUDA graph

    def _new_manager(self, compression: CompressionConfig) -> CompressionManager | PerRowManagers:
        model = self.model
        return CompressionManager(compression, self.cache, model.config.n_heads, model.rope_cos, model.rope_sin)

    def prefill(self, prompts: list[list[int]]) -> Sampled:
        """Append one list of tokens per row; returns the first sampled token of each row."""
        self._reserve([held + len(p) for held, p in zip(self.lengths, prompts)])
        self._prefill(slice(None), self.cache, prompts, self.manager)
        first = self._sampled()  # the host sync that ends prefill
        self._lengths_changed()  # a KV policy may have compressed the prompts
        return first

    def _prefill(self, rows: slice, cache: KVCache | PagedKVCache, prompts: list[list[int]], manager: CompressionManager | None) -> None:
        """Prefill the rows' prompts into `cache` (the session's, or one row's view of it) and sample each row's first token."""
        seen = None if self.seen is None else self.seen[rows]
        if seen is not None:
            seen |= seen_tokens(prompts, seen.shape[1], seen.device)
        logits = prefill(self.model, cache, prompts, compression=manager)
        self.last_logits = logits  # [B, V] at each prompt's last token
        first = sample(logits, self.sampling[rows], seen, cache.position)  # [B]; the positions the first tokens take
        self.tokens[rows] = first
        self.finished[rows] = torch.isin(first, self.eos)

    def _sampled(self) -> Sampled:
        both = torch.cat([self.tokens, self.finished.to(self.tokens.dtype)]).tolist()  # one read of both
        batch = self.tokens.shape[0]
        return Sampled(both[:batch], [bool(f) for f in both[batch:]])

    def step(self) -> Sampled:
        """Feed the last sampled tokens, sample the next ones (returned), compact on schedule. The
        first step builds the step (a compile, a CUDA graph's warm-up and capture) and is timed whole."""
        if self._step is not None:
            return self._advance()
        start = time.perf_counter()
        self._step = self._build_step()
        sampled = self._advance()  # its read of the tokens waits for the device
        if self.compile or self.cuda_graph:
            self.setup_s = time.perf_counter() - start
        return sampled

    def _advance(self) -> Sampled:
        grown = [n + 1 if running else 0 for n, running in zip(self.lengths, self.running())]
        self._reserve(grown)
        # The step attends over the slots that can be in use, a bound the host knows: eager any size
        # costs nothing, and the compiled blocks take it as a variable (engine/compile.py). A CUDA
        # graph reads the whole buffer: one shape, one capture. A compressed cache is small already,
        # and its lengths shrink on the device.
        if not (self.cuda_graph or self.manager is not None):
            self._step(n_read=max(self.lengths) + 1)
        else:
            self._step()
        self.lengths = grown
        self._after_step()
        return self._sampled()

    def running(self) -> list[bool]:
        """The rows that hold a sequence: every one, in a session of static rows."""
        return [True] * len(self.lengths)

    def _after_step(self) -> None:
        if self.manager is not None and self.manager.after_step():
            self._lengths_changed()

    def _reserve(self, n_slots: list[int]) -> None:
        """Make room for each row's next n_slots slots (a paged cache hands out blocks)."""
        for row, n in enumerate(n_slots):
            self.cache.reserve(row, n)

    def _lengths_changed(self) -> None:
        """After a compaction: read the rows' lengths back; a paged cache frees the emptied blocks at once."""
        for row, n in enumerate(self.cache.length.tolist()):
            self._set_length(row, n)

    def _set_length(self, row: int, n_slots: int) -> None:
        self.lengths[row] = n_slots
        self.cache.shrink(row, n_slots)

    def reset(self) -> None:
        """Empty the cache for a new conversation, keeping every buffer (and a captured graph)."""
        for counter in (self.cache.length, self.cache.position, self.cache.prompt_length):
            counter.zero_()
        self.finished.zero_()
        if self.seen is not None:
            self.seen.zero_()
        if self.manager is not None:
            self.manager.reset()
        self._lengths_changed()

    def stop_rows(self, rows: Iterable[int]) -> None:
        """From the host, between steps: these rows are done; the step feeds them their last token
        again from now on, and nothing reads what they emit."""
        for row in rows:
            self.finished[row] = True

    def _build_step(self) -> Callable[..., object]:
        groups, one_graph = compile_blocks(self.model) if self.compile else (None, False)
        advance = partial(decode_step, self.model, self.cache, self.tokens, self.finished, self.eos, self.sampling, self.manager, seen=self.seen, groups=groups)
        if self.cuda_graph:
            return capture_decode_step(advance, advanced_by_step(self.cache, self.tokens, self.finished, self.seen, self.manager))
        if self.compile:
            return CompiledStep(advance, unguarded=one_graph)
        return advance

    @property
    def stats(self) -> CompressionStats | None:
        return self.manager.stats if self.manager is not None else None


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


def generate(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    eos_ids: frozenset[int],
    sampling: SamplingConfig = SamplingConfig(),
    compile: bool = False,
    on_tokens: OnTokens | None = None,
    compression: CompressionConfig = CompressionConfig(),
    cuda_graph: bool = False,
    pages: PageConfig | None = None,
    n_slots: int | None = None,
    kv_dtype: str = "auto",
) -> GenerationResult:
    """Generate for a batch of prompts (any lengths). With a compression policy the cache holds
    the prompt + budget_max + window slots only, and is compacted whenever it is full. With
    pages, the cache is paged: each row holds only the blocks its own slots need. n_slots sizes
    the cache's rows (default: what this run needs), so that runs of several sizes can share one
    shape, hence one CUDA graph."""
    check_lengths(model, prompts, max_new_tokens)
    needed = compression.slots_needed(max(len(p) for p in prompts), max_new_tokens)
    if n_slots is not None and n_slots < needed:
        raise ValueError(f"this run needs {needed} slots per row, more than the {n_slots} asked for")
    n_slots = needed if n_slots is None else n_slots
    session = Session(
        model, len(prompts), n_slots, eos_ids=eos_ids, sampling=sampling, compression=compression, compile=compile, cuda_graph=cuda_graph, pages=pages,
        kv_dtype=kv_dtype,
    )

    start = time.perf_counter()
    first = session.prefill(prompts)
    prefill_s = time.perf_counter() - start

    start = time.perf_counter()
    decoded = decode(session, first, max_new_tokens, on_tokens=on_tokens)
    decode_s = time.perf_counter() - start
    cache = session.cache
    return GenerationResult(
        decoded.tokens, sum(map(len, prompts)), prefill_s, decode_s, decoded.steps, cache.nbytes, cache.peak_bytes, session.stats, session.setup_s,
    )
