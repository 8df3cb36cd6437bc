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

from engine.drafters import DraftModel, PromptLookup
from engine.generation import GenerationResult, OnTokens, Session
from engine.sampling import SamplingConfig
from engine.saved_step import saved_already
from engine.verify import AttendByPosition, Verifier, verify
from errors import UserError
from models.transformer import Transformer

DECAY = 0.9  # how much of the acceptance counts so far a new round keeps
PROBE_EVERY = 16  # skipped drafts after which one is verified anyway, to see whether acceptance has come back
PRIOR_DRAFT_COST = 0.25  # of a step, what each draft is taken to add to a verify until its width is measured
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


@dataclass
class Widths:
    """How many drafts to verify: the number with the most expected tokens per second. The
    seconds of a verify at each width and of a plain step are measured as the run goes; between
    two measured widths the cost is interpolated, and a width not yet measured is taken to cost
    a step and PRIOR_DRAFT_COST of one per draft. Each draft is kept with a probability estimated
    per matched n-gram length, from counts that decay, so it follows the text."""

    allowed: list[int]  # the numbers of drafts a verify may take
    verify_s: dict[int, float] = field(default_factory=dict)  # drafts -> seconds of a verify
    step_s: float | None = None
    kept: dict[int, float] = field(default_factory=dict)  # per n-gram length, decayed counts
    missed: dict[int, float] = field(default_factory=dict)
    skipped: int = 0
    tried: set[int] = field(default_factory=set)  # widths verified at least once

    def acceptance(self, n: int) -> float:
        kept, missed = self.kept.get(n, 1.0), self.missed.get(n, 1.0)  # a prior of one each
        return kept / (kept + missed)

    def cost(self, j: int) -> float:
        if j in self.verify_s:
            return self.verify_s[j]
        below = max((w for w in self.verify_s if w < j), default=None)
        above = min((w for w in self.verify_s if w > j), default=None)
        if below is None or above is None:
            return self.step_s * (1 + PRIOR_DRAFT_COST * j)
        share = (j - below) / (above - below)
        return self.verify_s[below] * (1 - share) + self.verify_s[above] * share

    def choose(self, n_drafts: int, match: int, room: int) -> int:
        """How many drafts to verify (0: a plain step instead), at most room. A width past
        n_drafts is filled with guesses, which count as rejected."""
        if n_drafts == 0 or self.step_s is None:
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
        elif j not in self.tried:
            self.tried.add(j)  # a width's first verify may compile it or allocate: untimed
        else:
            self.verify_s[j] = seconds if j not in self.verify_s else DECAY * self.verify_s[j] + (1 - DECAY) * seconds

    def verified(self, match: int, j: int, n_kept: int) -> None:
        self.kept[match] = DECAY * self.kept.get(match, 1.0) + n_kept
        self.missed[match] = DECAY * self.missed.get(match, 1.0) + (n_kept < j)


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


def verify_saved_already(model: Transformer, max_draft: int) -> bool:
    """Whether the saved verify of the width a compiled run allows is saved on this machine."""
    return saved_already(model, 1, min(COMPILED_DRAFTS, max_draft) + 1, AttendByPosition)


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
