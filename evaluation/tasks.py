"""The data of the compression evaluation: token streams fed through the decode path.

- Reasoning traces: step-by-step bookkeeping text in which each variable's value is stated once
  ("Step 4: Let q7 = 1459.") among many other numbers, and recalled once, 100 to 3000 tokens
  later ("Step 61: Recall: q7 = 1459."); with or without revisit hints in between.
- Real text: chunks of the Python standard library's own source files.
- Continuation prompts: the openings of other standard-library files, for free greedy decoding.

Everything is seeded and built from the tokenizer alone, so two runs see the same tokens.
"""

from __future__ import annotations

import math
import random
import string
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from errors import UserError
from weights.tokenizer import Tokenizer

TRACE_REQUEST = (
    "Solve this bookkeeping puzzle step by step. Define each variable exactly once, work through the "
    "intermediate arithmetic, and whenever a variable is needed again, recall its value."
)
NOUNS = ["crates", "jars", "boxes", "tickets", "bolts", "pages", "coins", "lamps", "cables", "seeds", "bricks", "shirts"]
# Fact-to-recall distances in tokens, in buckets: a trace draws a bucket first (one that still fits),
# then a distance log-uniformly inside it, so that short and long distances are equally common.
DISTANCE_BUCKETS = ((100, 300), (300, 1000), (1000, 3000))
MIN_LENGTH = 300  # shorter traces may hold no recall at all


@dataclass(frozen=True)
class Recall:
    """One fact recalled in a trace: the answer tokens are forced[start : start + n_tokens]; the
    value was stated once, in forced[stated : stated + n_tokens]."""

    variable: str
    value: int
    start: int  # index in the row's forced tokens of the first answer token
    n_tokens: int
    stated: int  # index of the first token of the value where it was stated
    distance: int  # tokens from that statement to the recall


@dataclass
class Row:
    """One row of a batch: the prompt goes through prefill, then `forced` one token per step."""

    kind: str  # "trace", "text" (both teacher-forced) or "continuation" (decoded freely)
    prompt: list[int]
    forced: list[int]  # empty for a continuation
    recalls: list[Recall] = field(default_factory=list)
    hints: bool = False  # a trace with revisit hints ("I will need q7 again ...")


def encode_plain(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of text in the middle of a stream: without the BOS a post-processor may add."""
    added = tokenizer.encode("")
    ids = tokenizer.encode(text)
    return ids[len(added) :] if added and ids[: len(added)] == added else ids


def chat_prompt(tokenizer: Tokenizer, request: str) -> list[int]:
    if tokenizer.has_chat_template:
        return tokenizer.encode_chat([{"role": "user", "content": request}])
    return tokenizer.encode(request + "\n")


def _filler(rng: random.Random) -> str:
    """One step of intermediate arithmetic or planning, with fresh numbers."""
    a, b = rng.randint(12, 99), rng.randint(3, 19)
    n1, n2 = rng.sample(NOUNS, 2)
    templates = [
        f"A pallet holds {a} {n1}, so {b} pallets hold {a} * {b} = {a * b} {n1}.",
        f"Adding the {b} spare {n1} gives {a} + {b} = {a + b} {n1} in total.",
        f"After selling {b} of the {a} {n1}, {a} - {b} = {a - b} {n1} are left.",
        f"Each of the {b} shelves has {a} {n2}, which makes {a * b} {n2}.",
        f"Next I check the {n1} against the {n2} before moving on.",
        f"The {n1} cost {a} dollars each, so {b} of them cost {a * b} dollars.",
        f"I split {a * b} {n2} into {b} equal groups of {a}.",
        f"So far the count of {n1} is consistent, and the {n2} still need {b} more.",
    ]
    return rng.choice(templates)


LETTERS = [c for c in string.ascii_lowercase if c not in "ilo"]


def _distance(rng: random.Random, room: int) -> int | None:
    """A fact-to-recall distance that fits in `room` tokens, or None when not even the shortest does."""
    fitting = [(low, min(high, room)) for low, high in DISTANCE_BUCKETS if low < room]
    if not fitting:
        return None
    low, high = rng.choice(fitting)
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def reasoning_trace(tokenizer: Tokenizer, length: int, seed: int, hints: bool) -> Row:
    """A trace of exactly `length` forced tokens in which facts ("Let q7 = 1459.") are stated and
    recalled once ("Recall: q7 = 1459."), at a distance drawn from DISTANCE_BUCKETS, among steps of
    plain arithmetic. Recalls fall due together at times and then come one line apart, so a few
    land past the end of the trace: those facts stay as distractors, never recalled (about 4%).
    Two facts waiting for their recall never share a letter, and a name is never defined twice.
    With `hints`, some plain steps are revisiting thoughts about a waiting fact (its name, never
    its value). The hints draw from the same generator, so a seed with and without hints gives
    two different traces of the same kind: the two kinds are compared as samples, not pairwise."""
    rng = random.Random(seed)
    waiting: dict[str, tuple[int, int, int]] = {}  # name -> (value, statement index, recall due)
    used: set[str] = set()
    recalls: list[Recall] = []

    def tokens(text: str) -> int:
        return len(encode_plain(tokenizer, text))

    text = "Let me work through this carefully, one step at a time.\n"
    longest = tokens(text)  # tokens of the longest line so far: a recall is due at most one line late
    step = 0
    while True:
        here = tokens(text)
        due = min(waiting, key=lambda name: waiting[name][2], default=None)
        step += 1
        if due is not None and waiting[due][2] <= here:
            value, stated, _ = waiting.pop(due)
            query = text + f"Step {step}: Recall: {due} ="
            start = tokens(query)
            recalls.append(Recall(due, value, start, tokens(query + f" {value}") - start, stated, start - stated))
            line = f"Step {step}: Recall: {due} = {value}.\n"
        else:
            free = [c for c in LETTERS if c not in {name[0] for name in waiting}]
            distance = _distance(rng, length - here - 3 * longest)
            names = [f"{c}{d}" for c in free for d in range(2, 10) if f"{c}{d}" not in used]
            if distance is not None and names and rng.random() < 0.7:
                name, value = rng.choice(names), rng.randint(1000, 9999)
                used.add(name)
                stated = tokens(text + f"Step {step}: Let {name} =")
                waiting[name] = (value, stated, stated + distance)
                line = f"Step {step}: Let {name} = {value}.\n"
            elif hints and waiting and rng.random() < 0.35:
                line = f"Step {step}: I will need {rng.choice(sorted(waiting))} again later, so I keep it in mind.\n"
            else:
                line = f"Step {step}: {_filler(rng)}\n"
        text += line
        longest = max(longest, tokens(line))
        if tokens(text) >= length and not waiting:
            break
    forced = encode_plain(tokenizer, text)[:length]
    while len(forced) < length:  # plain steps to the end
        step += 1
        text += f"Step {step}: {_filler(rng)}\n"
        forced = encode_plain(tokenizer, text)[:length]
    recalls = [r for r in recalls if r.start + r.n_tokens < length]
    for r in recalls:
        if tokenizer.decode(forced[r.stated : r.stated + r.n_tokens]).strip() != str(r.value):
            raise ValueError(f"the statement of {r.variable} is not where the trace says")  # a tokenizer merging across "="
        if tokenizer.decode(forced[r.start : r.start + r.n_tokens]).strip() != str(r.value):
            raise ValueError(f"the recall of {r.variable} is not where the trace says")
    if not recalls:
        raise UserError(f"a trace of {length} tokens holds no recall; raise --length (at least {MIN_LENGTH})")
    return Row("trace", chat_prompt(tokenizer, TRACE_REQUEST), forced, recalls, hints)


def stdlib_sources() -> list[Path]:
    """The standard library's own .py files, largest first (deterministic)."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(folder.glob("*.py"), key=lambda p: (-p.stat().st_size, p.name))
    if not files:
        raise UserError(f"no Python source files found in {folder}; the text tasks read the standard library's sources")
    return files


def text_rows(tokenizer: Tokenizer, n: int, prompt_tokens: int, length: int, skip: int = 0) -> list[Row]:
    """`n` chunks of real Python source: prompt_tokens through prefill, then `length` forced tokens.
    Files are taken largest first, after the first `skip` (so two tasks can use different files)."""
    rows = []
    for path in stdlib_sources()[skip:]:
        ids = encode_plain(tokenizer, path.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= prompt_tokens + length:
            rows.append(Row("text", ids[:prompt_tokens], ids[prompt_tokens : prompt_tokens + length]))
        if len(rows) == n:
            return rows
    raise UserError(f"not enough standard-library sources of {prompt_tokens + length} tokens for {n} text rows")


def continuation_rows(tokenizer: Tokenizer, n: int, prompt_tokens: int, skip: int) -> list[Row]:
    """`n` prompts, the openings of standard-library files, for free greedy decoding."""
    return [Row("continuation", row.prompt, []) for row in text_rows(tokenizer, n, prompt_tokens, 1, skip)]
