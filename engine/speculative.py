"""Speculative decoding: guess a few tokens cheaply, let the model check them all in one forward
pass, and keep the ones it would have produced itself.

Each round a drafter proposes tokens that may follow the text so far:
- prompt lookup (`PromptLookup`) finds the last earlier place where the text's final n tokens
  occurred, in the prompt or the answer, and proposes what followed them there;
- a draft model (`DraftModel`), a smaller model with the target's tokenizer, proposes its own
  greedy continuation.

The target then feeds its last sampled token and j drafts as one short prefill (j + 1 positions,
logits at each) and keeps drafts from the left (`accept`):
- greedy: a draft is kept while it equals the target's argmax at its position; the first argmax
  that differs, or the one after the last draft, is the round's last token. The output is the
  target's greedy output, token for token.
- sampling: a draft d is kept with probability p(d), p the target's distribution after the
  sampling filters. At the first rejection the token is drawn from p with d taken out, and after
  the last draft from p. A draft is a deterministic function of the text, so this is the standard
  acceptance rule with a one-point draft distribution, and every token is distributed as plain
  sampling draws it.

The rejected drafts' slots are handed back by stepping the row's length and position back (slots
are not positions: nothing reads a slot past the length), and the next round overwrites them.

j is chosen each round (`Widths`) for the most tokens per second: from the measured seconds of a
verify at each width and of a plain step, and the acceptance so far. A round without a draft, or
whose expected gain does not pay for its wider forward, is one plain decode step, compiled if the
session is.
"""

import time
from dataclasses import dataclass, field

import torch

from engine.cpu import inductor_options
from engine.decode import prefill
from engine.generation import GenerationResult, OnTokens, Session
from engine.sampling import SamplingConfig, filter_logits
from errors import UserError
from kv.cache import KVCache, sdpa
from models.transformer import BlockGroups, CacheRead, LayerInputs, LayerKV, Transformer, run_blocks

MAX_NGRAM = 4  # prompt lookup matches the text's last 4 tokens, else 3, ... down to MIN_NGRAM
MIN_NGRAM = 1
DECAY = 0.9  # how much of the acceptance counts so far a new round keeps
PROBE_EVERY = 16  # skipped drafts after which one is verified anyway, to see whether acceptance has come back
COMPILED_DRAFTS = 2  # a compiled verify's width: on both packaged models a pass over 3 positions costs about a step


@dataclass(frozen=True)
class Speculation:
    draft_model: Transformer | None = None  # None: prompt lookup
    max_draft: int = 8  # the most drafts one round verifies


@dataclass
class SpeculationStats:
    rounds: int = 0  # verifies
    plain_steps: int = 0
    drafted: int = 0  # drafts verified
    kept: int = 0

    def __str__(self) -> str:
        share = f" ({self.kept / self.drafted:.0%})" if self.drafted else ""
        return f"speculation: {self.rounds} verifies, {self.plain_steps} plain steps, {self.kept} of {self.drafted} drafts kept{share}"


class PromptLookup:
    """Drafts from the text itself: the tokens that followed the latest earlier occurrence of the
    text's last n tokens, for the longest n from MAX_NGRAM down to MIN_NGRAM that has one."""

    def __init__(self):
        self.after: dict[tuple[int, ...], int] = {}  # an n-gram -> the index just after its latest occurrence
        self.indexed = 0  # history[:indexed] ends every n-gram indexed so far

    def draft(self, history: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens, and the length of the n-gram matched (0: none)."""
        # An n-gram ending at the last token has no continuation yet: index up to the one before.
        for end in range(self.indexed, len(history) - 1):
            for n in range(1, MAX_NGRAM + 1):
                if end + 1 >= n:
                    self.after[tuple(history[end + 1 - n : end + 1])] = end + 1
        self.indexed = max(self.indexed, len(history) - 1)
        for n in range(min(MAX_NGRAM, len(history)), MIN_NGRAM - 1, -1):
            start = self.after.get(tuple(history[-n:]))
            if start is not None:
                return history[start : start + k], n
        return [], 0


class DraftModel:
    """Drafts a smaller model's greedy continuation, on a one-row cache of its own that follows
    the text: what it fed of drafts the target rejected is stepped back at the next round."""

    def __init__(self, model: Transformer, n_slots: int):
        self.model = model
        self.cache = KVCache.allocate(model.config, 1, n_slots, model.dtype, model.device)
        self.fed: list[int] = []  # the tokens its cache holds

    def draft(self, history: list[int], k: int) -> tuple[list[int], int]:
        same = 0
        while same < min(len(self.fed), len(history) - 1) and self.fed[same] == history[same]:
            same += 1
        step_back(self.cache, len(self.fed) - same)
        logits = prefill(self.model, self.cache, [history[same:]])  # [1, V] at the last token
        drafts: list[int] = []
        for _ in range(k):
            drafts.append(int(logits.argmax(-1)))
            if len(drafts) < k:
                logits = prefill(self.model, self.cache, [drafts[-1:]])
        self.fed = history + drafts[:-1]
        return drafts, 1


def step_back(cache: KVCache, n: int) -> None:
    """Forget the one row's last n slots: the tokens fed there never were."""
    if n:
        cache.length -= n
        cache.position -= n


@dataclass
class Widths:
    """How many drafts to verify: the number with the most expected tokens per second. The
    seconds of a verify at each width and of a plain step are measured; between two measured
    widths the cost is interpolated. Each draft is kept with a probability estimated per matched
    n-gram length, from counts that decay, so it follows the text."""

    allowed: list[int]  # the numbers of drafts a verify may take
    verify_s: dict[int, float] = field(default_factory=dict)  # drafts -> seconds of a verify
    step_s: float | None = None
    kept: dict[int, float] = field(default_factory=dict)  # per n-gram length, decayed counts
    missed: dict[int, float] = field(default_factory=dict)
    skipped: int = 0

    def to_calibrate(self) -> list[int]:
        """The widths timed before the first verify: 1, 2, 4, ... and the widest, where allowed."""
        return sorted({j for j in self.allowed if j & (j - 1) == 0} | {max(self.allowed)})

    def acceptance(self, n: int) -> float:
        kept, missed = self.kept.get(n, 1.0), self.missed.get(n, 1.0)  # a prior of one each
        return kept / (kept + missed)

    def cost(self, j: int) -> float:
        if j in self.verify_s:
            return self.verify_s[j]
        below = max((w for w in self.verify_s if w < j), default=None)
        above = min((w for w in self.verify_s if w > j), default=None)
        if below is None or above is None:
            return self.verify_s[below if above is None else above]
        share = (j - below) / (above - below)
        return self.verify_s[below] * (1 - share) + self.verify_s[above] * share

    def choose(self, n_drafts: int, match: int, room: int) -> int:
        """How many drafts to verify (0: a plain step instead), at most room. A width past
        n_drafts is filled with guesses, which count as rejected."""
        if n_drafts == 0 or self.step_s is None or not self.verify_s:
            return 0  # the first plain steps measure what a verify must beat
        a = self.acceptance(match)
        rate, best = 1 / self.step_s, 0
        for j in (j for j in self.allowed if j <= room):
            expected = sum(a**i for i in range(min(j, n_drafts) + 1))  # tokens a verify of j drafts yields
            if expected / self.cost(j) > rate:
                rate, best = expected / self.cost(j), j
        if best == 0:
            self.skipped += 1
            if self.skipped >= PROBE_EVERY:
                self.skipped, best = 0, min((j for j in self.allowed if j <= room), default=0)
        return best

    def measured(self, seconds: float, j: int) -> None:
        """A verify of j drafts (0: a plain step) took this long."""
        if j == 0:
            self.step_s = seconds if self.step_s is None else DECAY * self.step_s + (1 - DECAY) * seconds
        else:
            self.verify_s[j] = seconds if j not in self.verify_s else DECAY * self.verify_s[j] + (1 - DECAY) * seconds

    def verified(self, match: int, j: int, n_kept: int) -> None:
        self.kept[match] = DECAY * self.kept.get(match, 1.0) + n_kept
        self.missed[match] = DECAY * self.missed.get(match, 1.0) + (n_kept < j)


def accept(logits: torch.Tensor, drafts: list[int], sampling: SamplingConfig) -> tuple[int, int]:
    """logits [j + 1, V]: the target's, after its last token and after each of the j drafts.
    Returns how many drafts are kept, and the token that follows them."""
    j = len(drafts)
    fed = torch.tensor(drafts, device=logits.device)  # [j]
    if sampling.temperature == 0:
        best = logits.argmax(dim=-1)  # [j + 1]
        n_kept = (best[:j] == fed).long().cumprod(0).sum()
        n, token = torch.stack([n_kept, best[n_kept]]).tolist()
        return n, token
    probs = filter_logits(logits, sampling).softmax(dim=-1)  # [j + 1, V]
    drafted = probs[:j].gather(1, fed[:, None])[:, 0]  # [j] each draft's probability under the target
    n_kept = (torch.rand(j, device=logits.device) < drafted).long().cumprod(0).sum()
    # After a rejected draft, the target's distribution without it; after the last draft, as it is.
    residual = torch.cat([probs[:j].scatter(1, fed[:, None], 0.0), probs[j:]])  # [j + 1, V]
    row = residual[n_kept]
    exponential = -torch.log(torch.rand_like(row).clamp_min(1e-20))
    token = (row / exponential).argmax()  # a draw from row / row.sum() (the exponential race)
    n, token = torch.stack([n_kept, token]).tolist()
    return n, token


class AttendByPosition:
    """A verify's view of one layer: each fed position attends alone, over exactly the slots up to
    its own, as a decode step reads them. One attention over all of them sums in another order,
    and in bfloat16 that turns greedy tokens at near ties. The other ops treat positions apart;
    the 4- and 8-bit products compute each row alone, so there a position's logits are the plain
    step's bit for bit, while a float GEMM over several rows may round apart by ~1e-6."""

    def __init__(self, view: LayerKV):
        self.view = view  # the layer's first held + T slots

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.view.write(k, v, slots)

    def attend(self, q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, before_rope: torch.Tensor) -> torch.Tensor:
        k, v = self.view.read(q.dtype)  # [1, H_kv, held + T, D] each
        S, T = k.shape[2], q.shape[2]
        out = []
        for i in range(T):
            n = S - T + 1 + i  # the slots up to position i's own
            in_use = torch.ones(1, 1, 1, n, dtype=torch.bool, device=q.device)  # [B, 1, 1, S] as the step's
            out.append(sdpa(q[:, :, i : i + 1], k[:, :, :n], v[:, :, :n], in_use))
        return torch.cat(out, dim=2)  # [1, H, T, D]


def verify_blocks(blocks: list[torch.nn.Module], x: torch.Tensor, inputs: LayerInputs, kvs: list[LayerKV]) -> torch.Tensor:
    """run_blocks under a name of its own: compiled, its graphs and guards stay apart from the decode step's."""
    return run_blocks(blocks, x, inputs, kvs)


class Verifier:
    """Feeds the session's one row several tokens in one forward pass. When the session's step
    runs compiled blocks, so does the verify, at COMPILED_DRAFTS drafts only: each width is a
    graph of its own to compile."""

    def __init__(self, session: Session):
        self.session = session
        self.compiled: BlockGroups | None = None

    def groups(self) -> BlockGroups | None:
        step_groups = self.session.state.blocks
        if step_groups is None or self.compiled is not None:
            return self.compiled if step_groups is not None else None
        model = self.session.model
        compiled = torch.compile(verify_blocks, fullgraph=True, options=inductor_options(model.device, tensor_parallel=False))

        def run(blocks: list[torch.nn.Module], x: torch.Tensor, inputs: LayerInputs, kvs: list[AttendByPosition]) -> torch.Tensor:
            for kv in kvs:  # one graph for every number of slots held
                for tensor, dim in kv.view.slots_read():
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
            return compiled(blocks, x, inputs, kvs)

        self.compiled = BlockGroups(run, step_groups.size)
        return self.compiled

    def forward(self, tokens: list[int]) -> torch.Tensor:
        """Logits [T, V] after each of the tokens, fed after what the row holds."""
        session, cache = self.session, self.session.cache
        held, T, device = session.lengths[0], len(tokens), cache.length.device
        cache.fit(0, held + T)
        steps = torch.arange(T, device=device)
        layers = [AttendByPosition(view) for view in cache.layers(held + T)]
        read = CacheRead(layers, cache.length[:, None] + steps, None)  # [1, T] slots to write
        logits = session.model(torch.tensor([tokens], device=device), cache.position[:, None] + steps, read, groups=self.groups())
        cache.length += T
        cache.position += T
        return logits[0]


def verify(verifier: Verifier, last: int, drafts: list[int], sampling: SamplingConfig) -> tuple[int, int]:
    """Feed the last sampled token and the drafts into the session's one row, keep the drafts the
    target agrees with, and hand back the rest's slots. Returns the drafts kept and the next token,
    which the session holds as its next token to feed."""
    session = verifier.session
    cache, state = session.cache, session.state
    logits = verifier.forward([last, *drafts])  # [j + 1, V]
    n_kept, token = accept(logits, drafts, sampling)
    step_back(cache, len(drafts) - n_kept)
    session.lengths[0] += n_kept + 1
    cache.fit(0, session.lengths[0])
    state.tokens[0] = token
    state.finished[:1] = torch.isin(state.tokens[:1], state.eos)
    return n_kept, token


def calibrate(verifier: Verifier, widths: Widths, last: int) -> None:
    """Time a verify at each width it may take, on the row as it is, stepping back after each; the
    first of a width is untimed (it may compile, or allocate)."""
    for j in widths.to_calibrate():
        for timed in (False, True):
            start = time.perf_counter()
            verifier.forward([last] * (j + 1))[-1, 0].item()
            if timed:
                widths.verify_s[j] = time.perf_counter() - start
            step_back(verifier.session.cache, j + 1)
    verifier.session.cache.fit(0, verifier.session.lengths[0])


def check_session(session: Session) -> SamplingConfig:
    """The one row's sampling settings, or a UserError for what speculation does not run with."""
    if len(session.lengths) != 1:
        raise UserError("--speculate runs one prompt at a time; give one --prompt, or drop --speculate")
    if session.policy is not None:
        raise UserError("--speculate does not run with a KV policy (the policy's schedule counts one token per step); drop one of them")
    sampling = session.state.sampling.configs[0]
    if sampling.penalises_repetition:
        raise UserError("--speculate does not run with --repetition-penalty (each draft would change what counts as seen); drop one of them")
    return sampling


def speculate(
    session: Session, prompt: list[int], max_new_tokens: int, speculation: Speculation, on_tokens: OnTokens | None = None
) -> GenerationResult:
    """Prefill the prompt into the session's one row, then decode speculatively until EOS, a stop
    (on_tokens returns the row) or max_new_tokens. The result's `speculation` holds the rounds' counts."""
    sampling = check_session(session)
    if speculation.draft_model is None:
        drafter: PromptLookup | DraftModel = PromptLookup()
    else:
        drafter = DraftModel(speculation.draft_model, len(prompt) + max_new_tokens)
    eos = set(session.state.eos.tolist())
    # A built step (compiled) verifies at one width, a graph of its own to compile; eager at any.
    allowed = [min(COMPILED_DRAFTS, speculation.max_draft)] if session.runner.builds else list(range(1, speculation.max_draft + 1))
    stats, widths, verifier = SpeculationStats(), Widths(allowed), Verifier(session)
    start = time.perf_counter()
    first = session.prefill([prompt])
    prefill_s = time.perf_counter() - start

    start = time.perf_counter()
    history, answer = list(prompt), []
    pending = first.tokens[:1]  # tokens to hand out, the last one not fed yet
    while True:
        ended = False
        for token in pending:
            if token in eos:
                ended = True
                break
            answer.append(token)
            history.append(token)
            if on_tokens is not None and on_tokens({0: token}):
                ended = True
                break
            if len(answer) == max_new_tokens:
                ended = True
                break
        if ended:
            break
        room = max_new_tokens - len(answer) - 1  # drafts beyond it could not be handed out
        if widths.step_s is not None and not widths.verify_s and room >= max(allowed):
            calibrate(verifier, widths, history[-1])
        drafts, match = drafter.draft(history, min(speculation.max_draft, room)) if room > 0 else ([], 0)
        j = widths.choose(len(drafts), match, room)
        round_start = time.perf_counter()
        if j == 0:
            builds = session.runner.builds and stats.plain_steps == 0  # the first step compiles or captures
            pending = session.step().tokens[:1]
            if not builds:
                widths.measured(time.perf_counter() - round_start, 0)
            stats.plain_steps += 1
            continue
        drafts = drafts[:j] + drafts[-1:] * (j - len(drafts))  # a width past the drafts, filled with guesses
        n_kept, token = verify(verifier, history[-1], drafts, sampling)
        widths.measured(time.perf_counter() - round_start, j)
        widths.verified(match, j, n_kept)
        stats.rounds, stats.drafted, stats.kept = stats.rounds + 1, stats.drafted + j, stats.kept + n_kept
        pending = [*drafts[:n_kept], token]
    if on_tokens is not None:
        on_tokens({0: None})
    decode_s = time.perf_counter() - start
    return GenerationResult(
        [answer], len(prompt), prefill_s, decode_s, max(len(answer) - 1, 0), session.kv_bytes, session.kv_peak_bytes, None, session.setup_s, stats
    )
