"""The HumanEval task: the model writes each completion itself under every KV policy and budget,
and the completion passes when the problem's tests pass in a sandboxed subprocess.

Generation is `engine.generation.generate`, batched over problems, greedy, from the chat
template; a row ends at its end-of-turn token, at the code block's closing fence, or at
max_new_tokens. Each (policy, budget) cell is saved as soon as it is done, so that a stopped run
resumes with the cells it has.
"""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from cli import DTYPES
from compression.manager import new_store
from compression.config import CompressionConfig
from engine.options import RunOptions, generate
from kv.cache import KVCache
from engine.stop_strings import cut_at_stop
from errors import UserError
from evaluation.config import split_storage, with_variant
from evaluation.humaneval import STOP, Problem, extract_code, load_problems, program, request
from evaluation.runs import CPU, log
from evaluation.sandbox import run_programs
from evaluation.saving import beacon_defaults, check_resumable, rounding, write_atomically
from evaluation.tasks import chat_prompt
from kv.contiguous import contiguous_cache
from models.transformer import Transformer
from weights.forms import load_model
from weights.tokenizer import Tokenizer

PUBLISHED_PASS_AT_1 = 0.616  # Qwen2.5-Coder-0.5B-Instruct on all 164 problems, its technical report


@dataclass(frozen=True)
class HumanEvalConfig:
    checkpoint: Path
    policies: tuple[str, ...]  # the compressing ones; the full cache always runs
    budgets: tuple[int, ...]  # generated tokens kept
    hysteresis: int
    window: int
    n_beacon: int
    n_recent: int
    aggregation: str
    dtype: str
    out: Path
    first: int  # problems first..last (0..99 at most)
    last: int
    max_new_tokens: int
    batch: int  # problems decoded together
    timeout_s: float  # per program
    seed: int = 0

    def compression(self, policy: str, budget: int) -> CompressionConfig:
        base = CompressionConfig("beacon", budget, self.hysteresis, self.window, self.n_beacon, self.n_recent, self.aggregation, seed=self.seed)
        return with_variant(base, split_storage(policy)[0])  # a policy, or a variant of one


@dataclass
class Cell:
    """One policy at one budget (budget None: the full cache), problem by problem."""

    policy: str
    budget: int | None
    passed: list[bool]
    reasons: list[str]  # the sandbox's verdict per problem
    new_tokens: list[int]
    seconds: float  # generation, prefill included
    compactions: int
    kv_share: float = float("nan")  # KV bytes the rows held at most (codes, scales, store), over their full caches' in bf16

    @property
    def pass_at_1(self) -> float:
        return sum(self.passed) / len(self.passed)


@dataclass
class HumanEvalResults:
    model: str
    config: dict
    cells: dict[str, Cell] = field(default_factory=dict)  # "none", "beacon/16", ...
    answers: dict[str, list[str]] = field(default_factory=dict)  # the generated text per cell, to look at
    seconds: float = 0.0


def cell_key(policy: str, budget: int | None) -> str:
    return "none" if budget is None else f"{policy}/{budget}"


def stops_at_fence(tokenizer: Tokenizer, rows: int) -> Callable[[dict[int, int | None]], list[int]]:
    """on_tokens for generate: the rows whose answer has just written the closing fence."""
    recent: list[list[int]] = [[] for _ in range(rows)]

    def on_tokens(news: dict[int, int | None]) -> list[int]:
        stopped = []
        for row, token in news.items():
            if token is not None:
                recent[row] = recent[row][-7:] + [token]
                if STOP in tokenizer.decode(recent[row]):
                    stopped.append(row)
        return stopped

    return on_tokens


def answer_text(tokenizer: Tokenizer, tokens: list[int]) -> str:
    """The answer as the user would see it: up to the closing fence."""
    return cut_at_stop(tokenizer.decode(tokens), [STOP])


def run_cell(
    model: Transformer, tokenizer: Tokenizer, problems: list[Problem], config: HumanEvalConfig, policy: str, budget: int | None, expected: list[int]
) -> tuple[Cell, list[str]]:
    """Every problem under one policy and budget. A batch decodes until its longest answer ends,
    so problems are batched by `expected` answer length (longest first): rows that end together."""
    compression = config.compression(policy, budget) if budget is not None else CompressionConfig()
    prompts = [chat_prompt(tokenizer, request(p)) for p in problems]
    order = sorted(range(len(problems)), key=lambda i: -expected[i])
    answers, new_tokens = [""] * len(problems), [0] * len(problems)
    seconds, compactions = 0.0, 0
    for first in range(0, len(problems), config.batch):
        rows = order[first : first + config.batch]
        tick = time.perf_counter()
        result = generate(model, [prompts[i] for i in rows], config.max_new_tokens, eos_ids=tokenizer.eos_ids, on_tokens=stops_at_fence(tokenizer, len(rows)), options=RunOptions(compression=compression, kv_dtype=split_storage(policy)[1]))  # fmt: skip
        seconds += time.perf_counter() - tick
        log(f"    {cell_key(policy, budget)}: problems {first + 1}-{first + len(rows)} of {len(problems)}, {result.decode_steps} steps, {time.perf_counter() - tick:.0f} s")
        for i, tokens in zip(rows, result.tokens):
            answers[i], new_tokens[i] = answer_text(tokenizer, tokens), len(tokens)
        compactions += result.compression.compactions if result.compression is not None else 0
    outcomes = run_programs([program(p, extract_code(a)) for p, a in zip(problems, answers)], config.timeout_s)
    share = kv_share(model, compression, split_storage(policy)[1], [len(p) for p in prompts], new_tokens)
    return Cell(policy, budget, [o.passed for o in outcomes], [o.reason for o in outcomes], new_tokens, seconds, compactions, share), answers


def kv_share(model: Transformer, compression: CompressionConfig, kv_dtype: str, prompt_lengths: list[int], new_tokens: list[int]) -> float:
    """The KV bytes the rows held at most, each with its own slots (as the paged cache holds them:
    the prompt, and what is generated up to a compaction's limit) and its store, over the bytes of
    their full caches in bf16 (prompt and answer)."""
    meta = torch.device("meta")
    bf16_per_slot = KVCache.allocate(model.config, 1, 1, torch.bfloat16, meta).nbytes
    store = new_store(model.config, 1, compression, model.dtype, meta)
    limit = compression.slots_needed(0, max(new_tokens, default=0))  # generated slots a row holds at most
    held = sum(contiguous_cache(model, 1, p + min(n, limit), kv_dtype, meta).nbytes for p, n in zip(prompt_lengths, new_tokens))
    held += len(new_tokens) * (store.nbytes if store else 0)
    return held / (sum(prompt_lengths) + sum(new_tokens)) / bf16_per_slot


def settings_of(config: HumanEvalConfig) -> dict:
    """What a run measured with, as JSON: a resumed run must match it."""
    return json.loads(json.dumps(asdict(config) | {"beacon_defaults": beacon_defaults()} | rounding(), default=str))


def read_humaneval(path: Path) -> HumanEvalResults:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read results from {path}: {e}") from e
    try:
        cells = {k: Cell(**c) for k, c in raw["cells"].items()}
        return HumanEvalResults(raw["model"], raw["config"], cells, raw["answers"], raw["seconds"])
    except (KeyError, TypeError) as e:
        raise UserError(f"{path} is not the results of a HumanEval run of this version of evaluate.py (no {e}); run it again") from None


def write_json(results: HumanEvalResults, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / "results.json", json.dumps(asdict(results), indent=1))


def evaluate_humaneval(config: HumanEvalConfig, on_progress: Callable[[HumanEvalResults], None], previous: HumanEvalResults | None = None) -> HumanEvalResults:
    """Every cell not already in `previous` (a stopped run with the same settings), in order."""
    started = time.perf_counter()
    settings = settings_of(config)
    if previous is not None:
        check_resumable(previous.config, settings)
    results = previous or HumanEvalResults(config.checkpoint.name, settings)
    earlier = results.seconds
    problems = load_problems(config.first, config.last)
    log(f"loading {config.checkpoint} in {config.dtype}")
    model = load_model(config.checkpoint, DTYPES[config.dtype], CPU)
    tokenizer = Tokenizer.from_dir(config.checkpoint)
    cells = [("none", None)] + [(p, b) for b in config.budgets for p in config.policies]
    todo = [c for c in cells if cell_key(*c) not in results.cells]
    if len(todo) < len(cells):
        log(f"resuming: {len(cells) - len(todo)} of {len(cells)} cells already done in {config.out}")
    with torch.inference_mode():
        for i, (policy, budget) in enumerate(todo):
            # The full cache's answer lengths predict the others'; before it, the prompts' lengths do.
            full = results.cells.get("none")
            expected = full.new_tokens if full is not None else [len(p.prompt) for p in problems]
            ran = [b for b in config.budgets if policy.startswith("none:") and cell_key(policy, b) in results.cells]
            if ran:  # the full cache in another storage compacts at no budget: one run stands for all
                cell, answers = replace(results.cells[cell_key(policy, ran[0])], budget=budget), results.answers[cell_key(policy, ran[0])]
            else:
                cell, answers = run_cell(model, tokenizer, problems, config, policy, budget, expected)
            results.cells[cell_key(policy, budget)] = cell
            results.answers[cell_key(policy, budget)] = answers
            results.seconds = earlier + time.perf_counter() - started
            results.config["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            log(f"  [{i + 1}/{len(todo)}] {cell_key(policy, budget)}: pass@1 {cell.pass_at_1:.0%}, {sum(cell.new_tokens)} tokens in {cell.seconds:.0f} s")
            on_progress(results)
    return results
