"""Continuous batching: more requests than rows; finished rows leave and waiting requests join
between decode steps.

The batch has `max_batch` rows over one paged cache. Before each step, the requests waiting (in
their order) take the idle rows while the pool can hold them: a request joins only if the blocks
it may need at worst (its prompt and every new token, or what its KV policy keeps) fit beside
what the rows already running may still claim, so a running row never waits for a block. Its
prefill runs then, alone; the step runs every row, each with its own sampling settings. A row
that ends (EOS, its token limit, a stop, or the caller cancelling it) returns all its blocks at
once.

`serve` answers a list of requests known in advance (generate.py --prompt-file); a server adds
requests to a ContinuousBatch as they arrive and runs its steps in between (serve.py).
"""

import time
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, replace

import torch

from compression.config import CompressionConfig
from engine.generation import OnTokens, Sampled, Session, check_lengths
from engine.logit_rules import LogitRules, RowLogits, TokenLogprobs, TokenMask
from engine.options import RunOptions, new_cache, new_policy, new_runner
from engine.sampling import RowSampling, SamplingConfig
from errors import UserError
from kv.paged import PageConfig, PagedKVCache
from kv.prefix_cache import PrefixCache
from models.transformer import Transformer

class ContinuousSession:
    """The rows of a continuous batch: a Session on a paged cache whose rows start idle. A prompt
    joins an idle row between steps (`admit`: the Session's prefill, into that row alone) and
    leaves it when done (`release`); `step` is the Session's own. An idle row still runs through
    the fixed-shape step, into the scratch block. With a KV policy each row has its own manager and
    schedule, since rows join at different steps."""

    def __init__(
        self, model: Transformer, batch: int, n_slots: int, options: RunOptions, *, eos_ids: frozenset[int], sampling: SamplingConfig | RowSampling = SamplingConfig()
    ):
        """options.pages: the pool (default: PageConfig())."""
        options = options if options.pages is not None else replace(options, pages=PageConfig())
        runner = new_runner(model, options)
        cache: PagedKVCache = new_cache(model, batch, n_slots, options)
        # A request may join with settings of its own, and a CUDA graph replays the branches its
        # capture took: under one, the settings are read on the device alone.
        rows = sampling if isinstance(sampling, RowSampling) else RowSampling.same(sampling, batch, model.device)
        rows.static = runner.graph
        self.session = Session(model, cache, eos_ids=eos_ids, sampling=rows, policy=new_policy(model, cache, options, per_row=True), runner=runner)
        self.model, self.cache, self.state = model, cache, self.session.state
        if self.state.seen is None:  # a request may join with a repetition penalty of its own (admit)
            self.state.seen = torch.zeros(batch, model.config.vocab_size, dtype=torch.bool, device=model.device)
        if options.prefix_cache and self.session.policy is None:  # compaction moves slots: a compressed row's blocks are its own
            salt = repr((model.config, model.dtype, options.kv_dtype, cache.block_size))
            cache.blocks.prefix = PrefixCache(cache.block_size, salt)
        if not runner.graph:  # a CUDA graph would replay the rules of its capture
            self.state.logits_hook = RowLogits(batch, model.config.vocab_size, model.device)
        self.state.finished.fill_(True)
        for row in range(batch):
            self.session.hold(row, False)

    def step(self) -> Sampled:
        return self.session.step()

    def admit(
        self, row: int, prompt: list[int], sampling: SamplingConfig | None = None, seed: int = 0, rules: LogitRules = LogitRules(), mask: TokenMask | None = None
    ) -> tuple[int, bool, int]:
        """Between steps: prefill a prompt into an idle row, sampled with its own settings from now
        on (None: the row's so far), its rules for the logits and its token mask; returns its first
        token, whether that ends it (EOS), and how many prompt tokens a prefix cache held (not prefilled)."""
        session = self.session
        assert not session.holding[row], "admit needs an idle row"
        if sampling is not None:
            self.state.sampling.set_row(row, sampling, seed)
        self.set_rules(row, rules, mask)
        self.state.seen[row] = False  # an idle row's steps marked the tokens it fed
        cached = self.cache.share_prefix(row, prompt)
        self.state.seen[row, torch.tensor(prompt[:cached], dtype=torch.int64, device=self.model.device)] = True
        self.cache.fit(row, len(prompt))
        policy = None if session.policy is None else session.policy.join(row)
        session.prefill_rows(slice(row, row + 1), self.cache.row(row), [prompt[cached:]], policy)
        if cached:  # a prefill into a row that holds slots leaves the protected prefix alone
            self.cache.prompt_length[row] = len(prompt)
        self.cache.register_prefix(row, prompt)
        session.hold(row, True)
        session.set_length(row, int(self.cache.length[row]))  # a KV policy may have compressed the prompt
        first = session.sampled()
        return first.tokens[row], first.finished[row], cached

    def check_rules(self, rules: LogitRules, mask: TokenMask | None = None) -> None:
        if self.state.logits_hook is not None:
            self.state.logits_hook.check(rules)
        elif rules != LogitRules() or mask is not None:
            raise UserError("penalties, a logit bias, log-probabilities and token masks do not run under a CUDA graph; drop --cuda-graph")

    def set_rules(self, row: int, rules: LogitRules, mask: TokenMask | None = None) -> None:
        self.check_rules(rules, mask)
        if self.state.logits_hook is not None:
            self.state.logits_hook.set_row(row, rules, mask)

    def accept(self, row: int, token: int) -> None:
        """Between steps: the row's new token, for its token mask."""
        if self.state.logits_hook is not None:
            self.state.logits_hook.accept(row, token)

    def logprobs(self, rows: list[int], tokens: list[int]) -> list[TokenLogprobs]:
        """The log-probabilities the last prefill or step recorded for these rows' tokens."""
        return self.state.logits_hook.logprobs(rows, tokens)

    def release(self, row: int, tokens: list[int] = ()) -> None:
        """Between steps: the row's prompt is done; its blocks go back to the pool. tokens: what it
        fed the cache (its prompt, then its answer), for a prefix cache to find again."""
        session = self.session
        self.cache.register_prefix(row, list(tokens[: session.lengths[row]]))
        self.cache.release(row)
        self.state.finished[row] = True
        session.hold(row, False)
        session.lengths[row] = 0
        if session.policy is not None:
            session.policy.leave(row)


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingConfig | None = None  # None: the session's
    seed: int = 0  # its draws, in a session whose rows draw from their own seeds
    rules: LogitRules = LogitRules()  # penalties, bias, log-probabilities (engine/logit_rules.py)
    mask: TokenMask | None = None  # the tokens that may come next (a grammar), or None: any


@dataclass
class BatchRun:
    tokens: list[list[int]]  # per prompt, in prompt order, EOS excluded
    prompt_tokens: int
    seconds: float  # every prefill and step, from the first admission to the last answer
    steps: int
    most_rows: int  # the most prompts running at once
    kv_cache_bytes: int  # the pool
    kv_peak_bytes: int  # the most blocks held at once
    cached_tokens: int = 0  # prompt tokens found in the prefix cache, not prefilled

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
    options: RunOptions = RunOptions(),
    on_tokens: OnTokens | None = None,
) -> BatchRun:
    """Answer every request, at most max_batch at once; on_tokens hears of each by its index.
    options.pages.n_blocks sizes the pool (default: max_batch rows of the longest request's worst
    case, the memory static batching would take)."""
    if max_batch < 1:
        raise UserError(f"--max-batch must be >= 1, got {max_batch}")
    for request in requests:
        check_lengths(model, [request.prompt], request.max_new_tokens)
    worst = max(options.compression.slots_needed(len(r.prompt), r.max_new_tokens) for r in requests)  # slots a prompt may hold at once
    session = ContinuousSession(model, max_batch, worst, options, eos_ids=eos_ids, sampling=sampling)
    answers: list[list[int]] = [[] for _ in requests]

    def collect(news: dict[int, int | None]) -> Iterable[int] | None:
        for p, token in news.items():
            if token is not None:
                answers[p].append(token)
        return on_tokens(news) if on_tokens is not None else None

    batch = ContinuousBatch(session, options.compression, collect)
    for p, request in enumerate(requests):
        batch.add(p, request)
    start = time.perf_counter()
    while batch.busy():
        batch.step()
    seconds = time.perf_counter() - start
    prompt_tokens = sum(len(r.prompt) for r in requests)
    kv_bytes, kv_peak_bytes = session.session.kv_bytes, session.session.kv_peak_bytes
    return BatchRun(answers, prompt_tokens, seconds, batch.steps, batch.most_rows, kv_bytes, kv_peak_bytes, sum(batch.cached_tokens.values()))


class ContinuousBatch:
    """The requests of a continuous batch, each known by a key of the caller's (an index, an id):
    those waiting, in order, and the one each row holds. The caller adds and cancels requests and
    runs steps, all from one thread; on_tokens hears of every new token and every end by key."""

    def __init__(self, session: ContinuousSession, compression: CompressionConfig, on_tokens: OnTokens | None):
        self.session, self.compression, self.on_tokens = session, compression, on_tokens
        self.requests: dict[Hashable, Request] = {}  # waiting or running
        self.waiting: deque[Hashable] = deque()
        self.rows: list[Hashable | None] = [None] * len(session.session.lengths)  # the request each row holds
        self.produced: dict[Hashable, list[int]] = {}  # tokens so far, per running request
        self.cached_tokens: dict[Hashable, int] = {}  # per request admitted: prompt tokens the prefix cache held
        self.pool_blocks = session.cache.blocks.n_free  # the session starts with every row idle
        self.steps = self.most_rows = 0

    def blocks_needed(self, request: Request) -> int:
        """The most blocks the request may hold at once: its prompt and every new token, or what its KV policy keeps."""
        slots = self.compression.slots_needed(len(request.prompt), request.max_new_tokens)
        return -(-slots // self.session.cache.block_size)

    def most_new_tokens(self, prompt_length: int) -> int:
        """The most new tokens a prompt of this length may ask for (< 1: none). A row without a KV
        policy holds every token: its slots bound the answer. A policy keeps a row bounded, so the
        model's positions do, unless the prompt kept whole leaves too few slots for the policy to work in."""
        positions, n_slots = self.session.model.config.max_position_embeddings, self.session.cache.n_slots
        if self.compression.slots_needed(prompt_length, positions - prompt_length) <= n_slots:
            return positions - prompt_length
        return min(positions, n_slots) - prompt_length

    def check(self, request: Request) -> None:
        """A UserError if the request can never run here: too long for the model, a row, or the whole pool."""
        cache = self.session.cache
        check_lengths(self.session.model, [request.prompt], request.max_new_tokens)
        self.session.check_rules(request.rules, request.mask)
        slots = self.compression.slots_needed(len(request.prompt), request.max_new_tokens)
        if slots > cache.n_slots:
            raise UserError(
                f"a prompt of {len(request.prompt)} tokens and {request.max_new_tokens} new tokens need {slots} cache slots, "
                f"more than a row's {cache.n_slots}; shorten the prompt or ask for fewer new tokens"
            )
        need, pool = self.blocks_needed(request), self.pool_blocks
        if need > pool:
            raise UserError(
                f"a prompt may need {need} blocks of {cache.block_size} slots but the pool has {pool}; "
                "give the pool more blocks, or lower --max-new-tokens"
            )

    def add(self, key: Hashable, request: Request) -> None:
        self.check(request)
        self.requests[key] = request
        self.waiting.append(key)

    def cancel(self, key: Hashable) -> None:
        """Between steps: forget the request; a row it holds leaves at once, its blocks back in the
        pool. on_tokens hears nothing more of it."""
        if key in self.waiting:
            self.waiting.remove(key)
        elif key in self.rows:
            self._leave(self.rows.index(key))
        self.requests.pop(key, None)

    def running(self) -> list[int]:
        return [row for row, key in enumerate(self.rows) if key is not None]

    def logprobs(self, news: dict[Hashable, int]) -> dict[Hashable, TokenLogprobs]:
        """For on_tokens, while it hears of these running requests' new tokens: their log-probabilities."""
        keys = list(news)
        return dict(zip(keys, self.session.logprobs([self.rows.index(key) for key in keys], [news[key] for key in keys])))

    def busy(self) -> bool:
        return bool(self.waiting) or any(key is not None for key in self.rows)

    def claimable(self) -> int:
        """Free blocks that no running request may still claim."""
        cache = self.session.cache
        owed = sum(self.blocks_needed(self.requests[key]) - len(cache.blocks.rows[row]) for row, key in enumerate(self.rows) if key is not None)
        return cache.blocks.n_free - owed

    def step(self) -> None:
        """Waiting requests join the idle rows while the pool can hold them, then one decode step."""
        news: dict[Hashable, int | None] = {}
        for row, key in enumerate(self.rows):
            if key is None and self.waiting and self.blocks_needed(self.requests[self.waiting[0]]) <= self.claimable():
                self._admit(row, self.waiting.popleft(), news)
        self._deliver(news)
        self.most_rows = max(self.most_rows, len(self.running()))
        if not self.running():
            return  # every request admitted this round ended with its first token
        sampled = self.session.step()
        self.steps += 1
        news = {}
        for row in self.running():
            self._take(row, sampled.tokens[row], sampled.finished[row], news)
        self._deliver(news)

    def _admit(self, row: int, key: Hashable, news: dict[Hashable, int | None]) -> None:
        request = self.requests[key]
        self.rows[row] = key
        self.produced[key] = []
        token, ended, self.cached_tokens[key] = self.session.admit(row, request.prompt, request.sampling, request.seed, request.rules, request.mask)
        self._take(row, token, ended, news)

    def _take(self, row: int, token: int, ended: bool, news: dict[Hashable, int | None]) -> None:
        """A row's new token into this round's news, or (ended: EOS) the end of its request, which leaves the row at once."""
        key = self.rows[row]
        if ended:
            news[key] = None
            self._leave(row)
        else:
            self.produced[key].append(token)
            self.session.accept(row, token)
            news[key] = token

    def _deliver(self, news: dict[Hashable, int | None]) -> None:
        """Hand a round's news to on_tokens; a request it stops, or that made its last token, leaves
        its row, and on_tokens hears of its end."""
        stopped = set(self.on_tokens(news) or []) if self.on_tokens is not None and news else set()
        ends: dict[Hashable, int | None] = {}
        for row, key in enumerate(self.rows):
            if key is not None and (key in stopped or len(self.produced[key]) == self.requests[key].max_new_tokens):
                ends[key] = None
                self._leave(row)
        if self.on_tokens is not None and ends:
            self.on_tokens(ends)

    def _leave(self, row: int) -> None:
        key = self.rows[row]
        self.session.release(row, self.requests[key].prompt + self.produced[key])
        self.rows[row] = None
        del self.produced[key]
        self.requests.pop(key)
