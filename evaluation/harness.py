"""The evaluation end to end: the batch the chosen tasks need, every run, every task scored."""

from __future__ import annotations

import hashlib
import json
import resource
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from cli import DTYPES
from errors import UserError
from evaluation import full_pass
from evaluation.config import EvalConfig
from evaluation.future_attention import FullAttention, future_attention_recall, full_cache_compactions
from evaluation.metrics import Results, continuation, cost, retrieval, streaming_loss
from evaluation.runs import CPU, Batch, Run, full_cache_pass, log, recorder, run_all
from evaluation.saving import beacon_defaults, check_resumable, rounding
from evaluation.tasks import continuation_rows, reasoning_trace, text_rows
from weights.forms import load_model
from weights.tokenizer import Tokenizer


def build_batch(tokenizer: Tokenizer, config: EvalConfig) -> Batch:
    """The rows the selected tasks need (cost alone times every kind): each trace seed twice, with
    and without revisit hints."""
    s, tasks = config.sizes, set(config.tasks) | ({"retrieval", "loss", "continuation"} if config.tasks == ("cost",) else set())
    rows = []
    if tasks & {"retrieval", "attention"}:
        rows += [reasoning_trace(tokenizer, s.length, 1000 * config.seed + i, hints) for hints in (True, False) for i in range(s.n_traces)]
    if tasks & {"loss", "attention"}:
        rows += text_rows(tokenizer, s.n_text, s.text_prompt, s.length)
    if "continuation" in tasks:
        rows += continuation_rows(tokenizer, s.n_continuations, s.continuation_prompt, skip=s.n_text + 2)
    return Batch(rows, s.length)


def settings_of(config: EvalConfig, batch: Batch) -> dict:
    """What a run measured with, as JSON: a resumed run must match it."""
    tokens = json.dumps([[r.prompt, r.forced, [asdict(c) for c in r.recalls]] for r in batch.rows])
    settings = {k: v for k, v in asdict(config).items() if k != "full_pass"} | {
        "rows": [r.kind for r in batch.rows],
        "recalls": sum(len(r.recalls) for r in batch.rows),
        "batch_sha256": hashlib.sha256(tokens.encode()).hexdigest(),  # the very tokens: a changed generator does not resume
        "beacon_defaults": beacon_defaults(),
    } | rounding()
    return json.loads(json.dumps(settings, default=str))


def resumable(previous: Results | None, settings: dict) -> frozenset[tuple[str, int]]:
    """The (policy, budget) cells a previous run with the same settings finished."""
    if previous is None:
        return frozenset()
    check_resumable(previous.config, settings)
    return frozenset((p, int(b)) for p, b in previous.config.get("cells_done", []))


def evaluate(config: EvalConfig, on_progress: Callable[[Results], None] | None = None, previous: Results | None = None) -> Results:
    """All tasks; on_progress(results so far) after the full cache and after each (policy, budget).
    With `previous` (an interrupted run's results, same settings) its finished cells are kept, not redone."""
    started = time.perf_counter()
    log(f"loading {config.checkpoint} in {config.dtype}")
    model = load_model(config.checkpoint, DTYPES[config.dtype], CPU)
    tokenizer = Tokenizer.from_dir(config.checkpoint)
    batch = build_batch(tokenizer, config)
    if batch.n_positions > model.config.max_position_embeddings:
        raise UserError(f"the streams need {batch.n_positions} positions, the model has {model.config.max_position_embeddings}: lower --length")
    settings = settings_of(config, batch)
    done = resumable(previous, settings)
    results = previous if done else Results(config.checkpoint.name, settings | {"cells_done": []})
    earlier = results.seconds.get("total", 0.0)
    if done:
        log(f"resuming: {len(done)} of {len(config.policies) * len(config.budgets)} cells already done in {config.out}")
    forced_rows = batch.indices("trace", "text")
    full_attention = None
    with torch.inference_mode():
        if "attention" in config.tasks:
            log(f"full-cache attention of {len(forced_rows)} whole streams (offline prefill)")
            full_attention = FullAttention.of(model, [batch.rows[b].prompt + batch.rows[b].forced for b in forced_rows])

        full: Run | None = None

        def on_run(run: Run) -> None:
            nonlocal full
            if run.budget is None:
                full = run
                score(results, batch, config, tokenizer, full, None, None)
            else:
                score(results, batch, config, tokenizer, full, run.budget, run)
                if full_attention is not None:
                    score_attention(results, full_attention, batch, config, run)
                results.config["cells_done"].append([run.policy, run.budget])
            results.seconds["total"] = earlier + time.perf_counter() - started
            results.config["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            if on_progress is not None:
                on_progress(results)

        kinds = [r.kind for r in batch.rows]
        log(f"{len(kinds)} rows ({kinds.count('trace')} traces with {settings['recalls']} recalls, {kinds.count('text')} source chunks, {kinds.count('continuation')} free), {batch.length} tokens each")
        own = config.out / "full_pass.pt"
        source = config.full_pass or own
        passed = full_pass.load(source, settings, model, recorder(config, batch), batch.n_positions, required=config.full_pass is not None)
        if passed is None:
            passed = full_cache_pass(model, batch, config)
            config.out.mkdir(parents=True, exist_ok=True)
            full_pass.save(own, settings, *passed)
        else:
            log(f"  full cache: loaded from {source}, which a run of the same full cache saved")
        run_all(model, batch, config, on_run, done, config.sizes.attention_every, passed)
    return results


def score(results: Results, batch: Batch, config: EvalConfig, tokenizer: Tokenizer, full: Run, budget: int | None, run: Run | None) -> None:
    """Tasks 1, 3, 4 and 5: the full cache's own numbers (budget None), or one policy's at a budget."""
    traces, text, free = batch.indices("trace"), batch.indices("text"), batch.indices("continuation")
    full_bf16_bytes = full.kv_cache_bytes * torch.bfloat16.itemsize // DTYPES[config.dtype].itemsize
    if budget is None:
        results.put("cost", "none", None, cost(full, len(batch.rows), full_bf16_bytes))
        results.samples = [tokenizer.decode(full.predicted[b].tolist()) for b in free]
        if traces and "retrieval" in config.tasks:
            results.put("retrieval", "none", None, retrieval(full, batch, tokenizer))
            if results.retrieval["none"]["full"].success < 0.5 and not results.notes:
                results.notes.append("the full cache recalls under half of the facts: the retrieval task says little about this model")
        return
    after = min(config.first_compaction(budget) + 1, batch.length - 1)  # the first token a compaction can change
    if text and "loss" in config.tasks:
        results.put("loss", "none", budget, streaming_loss(full, full, text, after))
        results.put("loss", run.policy, budget, streaming_loss(run, full, text, after))
    results.put("cost", run.policy, budget, cost(run, len(batch.rows), full_bf16_bytes))
    if traces and "retrieval" in config.tasks:
        results.put("retrieval", run.policy, budget, retrieval(run, batch, tokenizer))
    if free and "continuation" in config.tasks:
        results.put("continuation", run.policy, budget, continuation(run, full, free, after))


def score_attention(results: Results, full_attention: FullAttention, batch: Batch, config: EvalConfig, run: Run) -> None:
    """Task 2 for one run; the full cache is seen at the moments this run compacted."""
    rows = batch.indices("trace", "text")
    prompt_lengths = torch.tensor([len(p) for p in batch.prompts])
    K = config.sizes.future_queries
    results.put("attention", run.policy, run.budget, future_attention_recall(full_attention, run.compactions, rows, prompt_lengths, config.window, K))
    if str(run.budget) not in results.attention.get("none", {}):
        results.put("attention", "none", run.budget, future_attention_recall(full_attention, full_cache_compactions(run.compactions), rows, prompt_lengths, config.window, K))
