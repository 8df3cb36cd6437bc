"""Continuous batching: more prompts than rows; finished rows leave and waiting prompts join
between decode steps.

The batch has `max_batch` rows over one paged cache. Before each step, the prompts waiting (in
their order) take the idle rows while the pool can hold them: a prompt joins only if the blocks
it may need at worst (its prompt and every new token, or what its KV policy keeps) fit beside
what the rows already running may still claim, so a running row never waits for a block. Its
prefill runs then, alone; the step runs every row. A row that ends (EOS, its token limit, or a
stop) returns all its blocks at once. Answers come back in prompt order.
"""

import time
from collections import deque
from dataclasses import dataclass

import torch

from compression.config import CompressionConfig
from compression.manager import PerRowManagers
from engine.generation import OnTokens, Session, check_lengths
from engine.paged_cache import PageConfig, PagedKVCache
from engine.sampling import SamplingConfig
from errors import UserError
from models.transformer import Transformer

class ContinuousSession(Session):
    """A session whose rows start idle, on a paged cache: a prompt joins an idle row between steps
    (`admit`) and leaves it when done (`release`). An idle row still runs through the fixed-shape
    step, into the scratch block, its counters put back to zero after each step. With a KV policy
    each row has its own manager and schedule, since rows join at different steps."""

    cache: PagedKVCache

    def __init__(self, model: Transformer, batch: int, n_slots: int, *, pages: PageConfig, **options):
        super().__init__(model, batch, n_slots, pages=pages, **options)
        self.finished.fill_(True)
        self.joined = [False] * batch  # host: the rows holding a prompt
        self.idle = torch.ones(batch, dtype=torch.bool, device=model.device)  # [B] the rows holding none

    def _new_manager(self, compression: CompressionConfig) -> PerRowManagers:
        model = self.model
        return PerRowManagers(compression, self.cache, model.config.n_heads, model.rope_cos, model.rope_sin, model.kv_heads)

    def running(self) -> list[bool]:
        return list(self.joined)

    def admit(self, row: int, prompt: list[int]) -> tuple[int, bool]:
        """Between steps: prefill a prompt into an idle row; returns its first token, and whether
        that ends it (EOS)."""
        assert not self.joined[row], "admit needs an idle row"
        self.cache.reserve(row, len(prompt))
        manager = None
        if self.manager is not None:
            manager = self.manager.rows[row]
            manager.reset()
        self._prefill(slice(row, row + 1), self.cache.row(row), [prompt], manager)
        self.idle[row] = False
        self.joined[row] = True
        self._set_length(row, int(self.cache.length[row]))  # a KV policy may have compressed the prompt
        first = self._sampled()
        return first.tokens[row], first.finished[row]

    def release(self, row: int) -> None:
        """Between steps: the row's prompt is done; its blocks go back to the pool."""
        self.cache.release(row)
        if self.seen is not None:
            self.seen[row] = False
        self.finished[row] = True
        self.idle[row] = True
        self.joined[row] = False
        self.lengths[row] = 0

    def _after_step(self) -> None:
        if not all(self.joined):  # an idle row's counters go back to zero; with none, nothing to do
            for counter in (self.cache.length, self.cache.position):
                counter.masked_fill_(self.idle, 0)
        if self.manager is not None:
            for row, manager in enumerate(self.manager.rows):
                if self.joined[row] and manager.after_step():
                    self._set_length(row, int(self.cache.length[row]))


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int


@dataclass
class BatchRun:
    tokens: list[list[int]]  # per prompt, in prompt order, EOS excluded
    prompt_tokens: int
    seconds: float  # every prefill and step, from the first admission to the last answer
    steps: int
    most_rows: int  # the most prompts running at once
    kv_cache_bytes: int  # the pool
    kv_peak_bytes: int  # the most blocks held at once

    @property
    def new_tokens(self) -> int:
        return sum(map(len, self.tokens))


def serve(
    model: Transformer,
    requests: list[Request],
    max_batch: int,
    *,
    eos_ids: frozenset[int],
    sampling: SamplingConfig = SamplingConfig(),
    compression: CompressionConfig = CompressionConfig(),
    pages: PageConfig = PageConfig(),
    compile: bool = False,
    cuda_graph: bool = False,
    on_tokens: OnTokens | None = None,
    kv_dtype: str = "auto",
) -> BatchRun:
    """Answer every request, at most max_batch at once. pages.n_blocks sizes the pool (default:
    max_batch rows of the longest request's worst case, the memory static batching would take)."""
    if max_batch < 1:
        raise UserError(f"--max-batch must be >= 1, got {max_batch}")
    for request in requests:
        check_lengths(model, [request.prompt], request.max_new_tokens)
    worst = [compression.slots_needed(len(r.prompt), r.max_new_tokens) for r in requests]  # slots a prompt may hold at once
    session = ContinuousSession(
        model, max_batch, max(worst), eos_ids=eos_ids, sampling=sampling, compression=compression, compile=compile, cuda_graph=cuda_graph, pages=pages,
        kv_dtype=kv_dtype,
    )
    cache = session.cache
    need = [-(-n // cache.block_size) for n in worst]  # blocks
    pool = len(cache.free)
    if max(need) > pool:
        raise UserError(
            f"a prompt may need {max(need)} blocks of {cache.block_size} slots but the pool has {pool}; "
            "give the pool more blocks, or lower --max-new-tokens"
        )

    rows = RunningPrompts(session, requests, need, on_tokens)
    waiting = deque(range(len(requests)))
    steps = most_rows = 0
    start = time.perf_counter()
    while waiting or rows.busy():
        news: dict[int, int | None] = {}
        for row in rows.idle():
            if waiting and need[waiting[0]] <= rows.claimable():
                rows.admit(row, waiting.popleft(), news)
        rows.deliver(news)
        most_rows = max(most_rows, len(rows.busy()))
        if not rows.busy():
            continue  # every prompt admitted this round ended with its first token
        sampled = session.step()
        steps += 1
        news = {}
        for row in rows.busy():
            rows.take(row, sampled.tokens[row], sampled.finished[row], news)
        rows.deliver(news)
    seconds = time.perf_counter() - start
    prompt_tokens = sum(len(r.prompt) for r in requests)
    return BatchRun(rows.answers, prompt_tokens, seconds, steps, most_rows, cache.nbytes, cache.peak_bytes)


class RunningPrompts:
    """Which prompt each row of a continuous batch holds, and every prompt's answer so far."""

    def __init__(self, session: ContinuousSession, requests: list[Request], need: list[int], on_tokens: OnTokens | None):
        self.session, self.requests, self.need, self.on_tokens = session, requests, need, on_tokens
        self.prompts: list[int | None] = [None] * len(session.lengths)  # per row
        self.answers: list[list[int]] = [[] for _ in requests]

    def busy(self) -> list[int]:
        return [row for row, p in enumerate(self.prompts) if p is not None]

    def idle(self) -> list[int]:
        return [row for row, p in enumerate(self.prompts) if p is None]

    def claimable(self) -> int:
        """Free blocks that no running prompt may still claim."""
        cache = self.session.cache
        owed = sum(self.need[p] - len(cache.rows[row]) for row, p in enumerate(self.prompts) if p is not None)
        return len(cache.free) - owed

    def admit(self, row: int, p: int, news: dict[int, int | None]) -> None:
        self.prompts[row] = p
        self.take(row, *self.session.admit(row, self.requests[p].prompt), news)

    def take(self, row: int, token: int, ended: bool, news: dict[int, int | None]) -> None:
        """A row's new token into this round's news, or (ended: EOS) the end of its prompt, which leaves the row at once."""
        p = self.prompts[row]
        if ended:
            news[p] = None
            self._leave(row)
        else:
            self.answers[p].append(token)
            news[p] = token

    def deliver(self, news: dict[int, int | None]) -> None:
        """Hand a round's news to on_tokens; a prompt it stops, or that made its last token, leaves
        its row, and on_tokens hears of its end."""
        stopped = set(self.on_tokens(news) or []) if self.on_tokens is not None and news else set()
        ends: dict[int, int | None] = {}
        for row, p in enumerate(self.prompts):
            if p is not None and (p in stopped or len(self.answers[p]) == self.requests[p].max_new_tokens):
                ends[p] = None
                self._leave(row)
        if self.on_tokens is not None and ends:
            self.on_tokens(ends)

    def _leave(self, row: int) -> None:
        self.session.release(row)
        self.prompts[row] = None
