"""The results as a reader sees them: markdown tables, results.json and back, the plot."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from errors import UserError
from evaluation.bytes_report import bytes_tables, plot_bytes, points
from evaluation.future_attention import RecallShares
from evaluation.metrics import ContinuationResult, CostResult, LossResult, Results, RetrievalResult
from evaluation.saving import kernels_text, write_atomically
from evaluation.statistics import holm, interval_text, mcnemar, wilson
from evaluation.tasks import DISTANCE_BUCKETS


@dataclass(frozen=True)
class Column:
    title: str
    meaning: str
    text: Callable  # result -> the table cell
    panel: str = ""  # title of the plot's panel
    value: Callable | None = None  # result -> the number plotted


COLUMNS = {
    "retrieval": Column(
        "Retrieval: share of facts recalled, all traces",
        "greedy decoding writes a value stated once in the trace, 100 to 3000 tokens before the recall; recalls "
        "recalled / asked, then the Wilson 95% interval, then the share of the (layer, KV head) caches that still "
        "held every token of the value at the recall",
        lambda r: f"{r.success:.0%} {sum(r.hits)}/{len(r.hits)} {interval_text(sum(r.hits), len(r.hits))}; {r.kept_mean:.0%}",
        "retrieval: share of facts recalled (95% CI)",
        lambda r: r.success,
    ),
    "attention": Column(
        "Future-attention recall, evictable part",
        "share of the full-cache attention of the next K queries, on the positions between the prompt and the "
        "recent window, that falls on positions the policy kept; mean over compactions, rows, layers, query heads, queries",
        lambda r: f"{r.evictable:.3f}",
        "future-attention recall (evictable part)",
        lambda r: r.evictable,
    ),
    "attention_context": Column(
        "Future-attention recall, whole context",
        "the same share over all positions before the compaction (prompt and window included)",
        lambda r: f"{r.context:.4f}",
    ),
    "loss": Column(
        "Streaming loss: NLL on Python source",
        "mean next-token NLL in nats over the tokens after the first compaction, and its difference from the full cache's",
        lambda r: f"{r.nll:.3f} ({r.delta:+.3f})",
        "streaming loss: NLL increase over the full cache",
        lambda r: r.delta,
    ),
    "continuation": Column(
        "Continuation fidelity",
        "free greedy decoding: tokens equal to the full cache's before the first difference, counted from the "
        "first compaction (mean over prompts), and the share of all those tokens that are equal",
        lambda r: f"{r.leading:.0f} ({r.agreement:.0%})",
        "continuation: share of tokens equal to the full cache's",
        lambda r: r.agreement,
    ),
    "cost": Column(
        "Cost",
        "decode tokens/s of the whole batch (compactions and refreshes included) / ms per compaction / "
        "ms per FPS refresh (BeaconKV) / KV cache MiB of the batch (its share of a full bf16 cache's bytes)",
        lambda r: " / ".join(
            [f"{r.tokens_per_s:.1f} tok/s"]
            + ([f"{r.ms_per_compaction:.0f} ms"] if r.ms_per_compaction == r.ms_per_compaction else [])
            + ([f"{r.ms_per_refresh:.1f} ms"] if r.ms_per_refresh == r.ms_per_refresh else [])
            + [f"{r.kv_cache_mib:.1f} MiB" + (f" ({r.kv_share:.1%} of bf16's)" if r.kv_share == r.kv_share else "")]
        ),
        "cost: decode tokens/s of the batch",
        lambda r: r.tokens_per_s,
    ),
}


def table(results: Results, task: str) -> str:
    source = results.attention if task == "attention_context" else getattr(results, task)
    if not source:
        return ""
    column = COLUMNS[task]
    budgets = [str(b) for b in results.config["budgets"]]
    lines = [f"### {column.title}", "", column.meaning + ".", "", "| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
    for policy in ("none", *results.config["policies"]):
        by_budget = source.get(policy, {})
        cells = [column.text(by_budget.get(b, by_budget.get("full"))) if b in by_budget or "full" in by_budget else "" for b in budgets]
        if any(cells):
            lines.append(f"| {'full cache' if policy == 'none' else policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _bucket(distance: int) -> int:
    return next(i for i, (low, high) in enumerate(DISTANCE_BUCKETS) if distance < high or i == len(DISTANCE_BUCKETS) - 1)


def _recalls(result: RetrievalResult, hinted: bool | None = None, bucket: int | None = None) -> list[bool]:
    """The hits of the recalls of one kind of trace (None: both) and one distance bucket (None: all)."""
    return [
        hit
        for hit, h, d in zip(result.hits, result.hinted, result.distances)
        if (hinted is None or h == hinted) and (bucket is None or _bucket(d) == bucket)
    ]


def retrieval_tables(results: Results) -> str:
    """Retrieval by kind of trace and by distance, each share with its interval; then BeaconKV
    against each other policy on the very same recalls (McNemar)."""
    source, budgets = results.retrieval, [str(b) for b in results.config["budgets"]]
    full = source.get("none", {}).get("full")
    if full is None or not full.hinted:
        return ""
    policies = [p for p in results.config["policies"] if p in source]
    buckets = [f"{low}-{high}" for low, high in DISTANCE_BUCKETS]
    lines = []
    for hinted, kind in ((True, "with revisit hints"), (False, "without revisit hints")):
        lines += [
            f"### Retrieval, traces {kind}, by fact-to-recall distance",
            "",
            "recalled / asked and the Wilson 95% interval, per distance bucket (tokens).",
            "",
            "| policy | budget | " + " | ".join(buckets) + " | all |",
            "|---|---|" + "---|" * (len(buckets) + 1),
        ]
        rows = [("full cache", "", full)] + [(p, b, source[p][b]) for b in budgets for p in policies if b in source[p]]
        for name, budget, result in rows:
            cells = []
            for bucket in [*range(len(buckets)), None]:
                hits = _recalls(result, hinted, bucket)
                cells.append(f"{sum(hits)}/{len(hits)} {interval_text(sum(hits), len(hits))}" if hits else "")
            lines.append(f"| {name} | {budget} | " + " | ".join(cells) + " |")
        lines.append("")
    if "beacon" in policies:
        others = [p for p in policies if p != "beacon"]
        lines += [
            "### BeaconKV against each policy on the same recalls (McNemar's exact test)",
            "",
            "recalls only BeaconKV got / recalls only the other policy got, and the two-sided p-value; * where the "
            "Holm-adjusted p over the whole table is < 0.05. Recalls of one trace share its cache, so they are not "
            "independent draws: these p-values (and the intervals above) are optimistic for claims about new traces.",
            "",
            "| traces | budget | " + " | ".join(others) + " |",
            "|---|---|" + "---|" * len(others),
        ]
        rows = [(kind, hinted, b) for hinted, kind in ((True, "hints"), (False, "no hints"), (None, "both")) for b in budgets if b in source["beacon"]]
        tests = {
            (kind, b, other): mcnemar(_recalls(source["beacon"][b], hinted), _recalls(source[other][b], hinted))
            for kind, hinted, b in rows
            for other in others
            if b in source[other]
        }
        adjusted = dict(zip(tests, holm([t.p_value for t in tests.values()])))
        for kind, _, b in rows:
            cells = []
            for other in others:
                test = tests.get((kind, b, other))
                cells.append("" if test is None else f"{test.only_a}/{test.only_b} p={test.p_value:.2g}{' *' if adjusted[(kind, b, other)] < 0.05 else ''}")
            lines.append(f"| {kind} | {b} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def markdown(results: Results) -> str:
    c, s = results.config, results.config["sizes"]
    kinds = c["rows"]
    lines = [
        f"# KV-cache policies on {results.model}",
        "",
        "Written by `python evaluate.py`; its docstring defines the tasks.",
        "",
        f"- budgets {c['budgets']}, hysteresis {c['hysteresis']}, window {c['window']}, n_beacon {c['n_beacon']}, n_recent {c['n_recent']}, BeaconKV aggregation {c.get('aggregation', 'max')}; {c['dtype']}, torch threads: {c['threads']}{kernels_text(c)}",
        f"- one batch of {len(kinds)} rows, {s['length']} tokens after each prompt: {kinds.count('trace')} reasoning traces, half with revisit hints "
        f"({c['recalls']} recalls in all), {kinds.count('text')} chunks of Python source, {kinds.count('continuation')} free continuations; "
        f"K = {s['future_queries']} future queries, at one compaction in {s['attention_every']}",
        f"- wall time {results.seconds.get('total', 0) / 60:.1f} min, peak RSS {c.get('peak_rss_mib', 0):.0f} MiB",
    ]
    cells = len(c["policies"]) * len(c["budgets"])
    if "merged_runs" in c:
        n = c["merged_runs"]
        lines.append(f"- made by `python evaluate.py --report` from {n} run{'s' if n > 1 else ''}: each cell at the budgets its run ran; the wall time is theirs summed")
    elif len(c["cells_done"]) < cells:
        lines.append(f"- **partial results**: {len(c['cells_done'])} of {cells} (policy, budget) cells done (the run is still going, or was stopped; run the same command again to resume)")
    lines += [f"- note: {n}" for n in results.notes]
    tasks = [t for t in COLUMNS if t.split("_")[0] in c["tasks"]]
    tables = [table(results, task) for task in tasks]
    if "retrieval" in c["tasks"]:
        tables[1:1] = [retrieval_tables(results), bytes_tables(points(results), "recalls")]
    return "\n".join(lines) + "\n\n" + "\n".join(t for t in tables if t)


def _finite(x):
    """JSON has no NaN: a number that does not apply becomes null."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and x != x else x


def plot(results: Results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [t for t in ("retrieval", "attention", "loss", "continuation", "cost") if getattr(results, t)]
    budgets = results.config["budgets"]
    columns = min(len(panels) + 1, 3)  # one more panel for the legend
    rows = -(-(len(panels) + 1) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.6 * rows), squeeze=False)
    axes = list(axes.flat)
    for ax, task in zip(axes, panels):
        source, column = getattr(results, task), COLUMNS[task]

        def series(policy: str) -> list[float]:
            got = source.get(policy, {})
            return [column.value(got.get(str(b), got.get("full"))) if str(b) in got or "full" in got else float("nan") for b in budgets]

        for policy in results.config["policies"]:
            line = ax.plot(budgets, series(policy), marker="o", label=policy, linewidth=2.8 if policy == "beacon" else 1.2)[0]
            if task == "retrieval":
                intervals = [wilson(sum(r.hits), len(r.hits)) for r in (source.get(policy, {}).get(str(b)) for b in budgets) if r is not None]
                if len(intervals) == len(budgets):
                    shares = series(policy)
                    below, above = [s - lo for s, (lo, _) in zip(shares, intervals)], [hi - s for s, (_, hi) in zip(shares, intervals)]
                    ax.errorbar(budgets, shares, yerr=[below, above], fmt="none", ecolor=line.get_color(), capsize=3, linewidth=1)
        ax.plot(budgets, series("none"), "k--", label="full cache")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget (generated tokens kept)")
        ax.set_title(column.panel, fontsize=10)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[len(panels) :]:
        ax.axis("off")
    axes[len(panels)].legend(handles, labels, loc="center", fontsize=10, title="policy")
    fig.suptitle(f"KV-cache policies on {results.model}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


RESULT_TYPES = {"retrieval": RetrievalResult, "attention": RecallShares, "loss": LossResult, "continuation": ContinuationResult, "cost": CostResult}


def read_results(path: Path) -> Results:
    """Results back from a results.json (null stands for NaN there)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read results from {path}: {e}") from e

    def make(kind: type, fields: dict):
        return kind(**{k: float("nan") if v is None else v for k, v in fields.items()})

    try:
        tasks = {t: {p: {b: make(kind, f) for b, f in by.items()} for p, by in raw[t].items()} for t, kind in RESULT_TYPES.items()}
        results = Results(raw["model"], raw["config"], **tasks, seconds=raw["seconds"], notes=raw["notes"], samples=raw.get("samples", []))
        results.config["cells_done"], results.config["sizes"]["attention_every"]  # written by every run of this version
    except (KeyError, TypeError) as e:
        raise UserError(f"{path} is not the results of a retrieval run of this version of evaluate.py (no {e}); run it again") from None
    return results


# What may differ between runs merged into one table: which cells each ran, what they cost, and
# which tasks they scored (the table shows those every run scored).
MERGEABLE = ("out", "policies", "budgets", "cells_done", "peak_rss_mib", "tasks", "merged_runs")


def merge_results(runs: list[Results], policies: tuple[str, ...] = ()) -> Results:
    """Several runs on the same batch as one: their cells side by side (the first run's where two
    ran the same cell, which computes the same), every other setting equal. With `policies`, only
    those policies' cells and the full cache."""
    first = runs[0]
    for other in runs[1:]:
        differ = sorted(k for k in {*first.config, *other.config} if k not in MERGEABLE and first.config.get(k) != other.config.get(k))
        if differ or other.model != first.model:
            raise UserError(f"runs of other models or settings ({', '.join(differ) or 'model'}) do not merge into one table")
    ran = list(dict.fromkeys(p for r in runs for p in r.config["policies"]))
    if missing := [p for p in policies if p not in ran]:
        raise UserError(f"--policies {','.join(missing)}: no run merged here ran it; these ran: {','.join(ran)}")
    if len(runs) == 1 and not policies:
        return first
    kept = set(policies or ran) | {"none"}
    config = dict(first.config)
    config["policies"] = [p for p in ran if p in kept]
    config["tasks"] = [t for t in first.config["tasks"] if all(t in r.config["tasks"] for r in runs)]
    config["cells_done"] = [cell for r in runs for cell in r.config["cells_done"] if cell[0] in kept]
    config["budgets"] = sorted({b for _, b in config["cells_done"]})
    config["peak_rss_mib"] = max(r.config.get("peak_rss_mib", 0) for r in runs)
    config["merged_runs"] = sum(r.config.get("merged_runs", 1) for r in runs)
    merged = Results(first.model, config, notes=list(dict.fromkeys(n for r in runs for n in r.notes)), samples=first.samples)
    merged.seconds = {"total": sum(r.seconds.get("total", 0.0) for r in runs)}
    for task in RESULT_TYPES:
        for r in runs:
            for policy, by_budget in getattr(r, task).items():
                for budget, result in by_budget.items():
                    if policy in kept and (budget == "full" or int(budget) in config["budgets"]):
                        getattr(merged, task).setdefault(policy, {}).setdefault(budget, result)
    return merged


def write(results: Results, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(results)
    (out / "results.md").write_text(text)
    write_atomically(out / "results.json", json.dumps(_finite(asdict(results)), indent=1))
    plot(results, out / "quality_vs_budget.png")
    plot_bytes(points(results), "recalls", f"Retrieval against KV bytes, {results.model}", out / "quality_vs_bytes.png")
    return text
