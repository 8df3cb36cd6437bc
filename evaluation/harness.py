"""The evaluation end to end: the batch the chosen tasks need, every run, every task scored."""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from cli import DTYPES
from errors import UserError
from evaluation.config import EvalConfig
from evaluation.future_attention import FullAttention, future_attention_recall, full_cache_compactions
from evaluation.metrics import Results, continuation, cost, retrieval, streaming_loss
from evaluation.runs import CPU, Batch, Run, log, run_all
from evaluation.tasks import continuation_rows, reasoning_trace, text_rows
from weights.loader import load_model
from weights.tokenizer import Tokenizer


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
