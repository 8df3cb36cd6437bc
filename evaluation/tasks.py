"""The data of the compression evaluation: token streams fed through the decode path.

- Reasoning traces: step-by-step bookkeeping text in which each variable's value is stated once
  ("Step 4: Let q7 = 1459.") among many other numbers, and recalled long after ("Recall: q7 =").
- Real text: chunks of the Python standard library's own source files.
- Continuation prompts: the openings of other standard-library files, for free greedy decoding.

Everything is seeded and built from the tokenizer alone, so two runs see the same tokens.
"""

from __future__ import annotations

import random
import string
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from errors import UserError
from weights.tokenizer import Tokenizer

TRACE_REQUEST = (
    "Solve this bookkeeping puzzle step by step. Define each variable exactly once, work through the "
    "intermediate arithmetic, and at the end recall the values of the variables you defined."
)
NOUNS = ["crates", "jars", "boxes", "tickets", "bolts", "pages", "coins", "lamps", "cables", "seeds", "bricks", "shirts"]


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


def _variable_names(rng: random.Random, n: int) -> list[str]:
    """Distinct names like q7, each letter used once so that no two names share their tokens."""
    letters = rng.sample([c for c in string.ascii_lowercase if c not in "ilo"], n)
    return [f"{c}{rng.randint(2, 9)}" for c in letters]


def reasoning_trace(tokenizer: Tokenizer, length: int, seed: int, n_recalls: int = 4) -> Row:
    """A trace of exactly `length` forced tokens: facts stated in the first ~45%, plain arithmetic after,
    then `n_recalls` recalls of facts stated at least 35% of the trace earlier, then more steps."""
    rng = random.Random(seed)
    names = _variable_names(rng, max(n_recalls + 2, length // 60))
    values = {name: rng.randint(1000, 9999) for name in names}
    lines = ["Let me work through this carefully, one step at a time."]
    step = 0

    def add(text: str) -> None:
        nonlocal step
        step += 1
        lines.append(f"Step {step}: {text}")

    def tokens_so_far() -> int:
        return len(encode_plain(tokenizer, "\n".join(lines) + "\n"))

    stated_at: dict[str, int] = {}
    # The definitions, up to two filler steps apart, in the first ~45% of the trace.
    for name in names:
        if len(stated_at) >= n_recalls and tokens_so_far() >= 0.45 * length:
            break
        stated_at[name] = len(encode_plain(tokenizer, "\n".join(lines) + f"\nStep {step + 1}: Let {name} ="))
        add(f"Let {name} = {values[name]}.")
        for _ in range(rng.randint(0, 2)):
            if tokens_so_far() < 0.45 * length:
                add(_filler(rng))
    names = list(stated_at)
    recall_line = len(encode_plain(tokenizer, f"Recall: {names[0]} = {values[names[0]]}.\n"))
    recall_block_tokens = n_recalls * recall_line + len(encode_plain(tokenizer, f"Step {step}: Now I recall the values defined above.\n"))
    while True:  # plain steps, as many as leave room for the recalls
        if rng.random() < 0.08:  # a revisiting thought: a variable's name, not its value
            text = f"I will need {rng.choice(names)} again at the end, so I keep it in mind."
        else:
            text = _filler(rng)
        add(text)
        if tokens_so_far() > length - recall_block_tokens - recall_line:
            lines.pop()
            step -= 1
            break
    add("Now I recall the values defined above.")
    here = tokens_so_far()
    far = [name for name in names if here - stated_at[name] >= 0.35 * length] or names
    recalled = rng.sample(far, min(n_recalls, len(far)))
    text = "\n".join(lines) + "\n"
    recalls = []
    for name in recalled:
        query = text + f"Recall: {name} ="
        start = len(encode_plain(tokenizer, query))
        text = query + f" {values[name]}.\n"
        n_tokens = len(encode_plain(tokenizer, query + f" {values[name]}")) - start
        recalls.append(Recall(name, values[name], start, n_tokens, stated_at[name], start - stated_at[name]))
    while len(encode_plain(tokenizer, text)) < length:  # keep the stream going after the recalls
        step += 1
        text += f"Step {step}: {_filler(rng)}\n"
    forced = encode_plain(tokenizer, text)[:length]
    for r in recalls:
        answer = tokenizer.decode(forced[r.start : r.start + r.n_tokens]).strip()
        if tokenizer.decode(forced[r.stated : r.stated + r.n_tokens]).strip() != str(r.value):
            raise ValueError(f"the statement of {r.variable} is not where the trace says")  # a tokenizer merging across "="
        if r.start + r.n_tokens >= length or answer != str(r.value):
            raise UserError(f"trace length {length} is too short for {n_recalls} recalls; raise the trace length")
    return Row("trace", chat_prompt(tokenizer, TRACE_REQUEST), forced, recalls)


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
