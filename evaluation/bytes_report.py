"""Quality against the bytes the KV cache holds: every cell at its share of a full bf16 cache's
bytes (codes, scales, the store and its page summaries counted), the plot of recall against
bytes, and the equal-bytes table: at each byte budget, every cell run there tested against the
best single technique (eviction alone, or the whole cache in one storage) that holds no more."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from evaluation.config import split_storage
from evaluation.metrics import LossResult, Results
from evaluation.statistics import holm, interval_text, mcnemar, wilson

BUDGET_SHARES = (0.05, 0.10, 0.15, 0.25, 0.35, 0.50)  # the byte budgets of the equal-bytes table, as shares of the full bf16 cache's


@dataclass(frozen=True)
class Point:
    """One cell where it sits on the bytes axis."""

    spec: str  # "none", "streaming", "streaming:kv_dtype=int4:store_slots=256", ...
    budget: str  # generated tokens kept, or "full"
    share: float  # of a full bf16 cache's bytes
    outcomes: list[bool]  # per recall (retrieval) or per problem (HumanEval): right or not
    loss: LossResult | None = None

    @property
    def technique(self) -> str:
        """'full' (the bf16 reference), 'single' (eviction alone, or the whole cache quantized) or 'combination'."""
        if self.spec == "none":
            return "full"
        policy, kv_dtype = split_storage(self.spec)
        return "single" if policy == "none" or (kv_dtype == "auto" and "store_slots" not in policy) else "combination"


def label(spec: str) -> str:
    """'streaming:kv_dtype=int4:store_slots=256' -> 'streaming + int4 cache + int4 store 256';
    'none:kv_dtype=int8' -> 'full cache in int8'."""
    if spec == "none":
        return "full cache"
    policy, kv_dtype = split_storage(spec)
    if policy == "none":
        return f"full cache in {kv_dtype}"
    name, *settings = policy.split(":")
    options = dict(s.partition("=")[::2] for s in settings)
    parts = [name] + ([f"{kv_dtype} cache"] if kv_dtype != "auto" else [])
    if "store_slots" in options:
        parts.append(f"{options.pop('store_dtype', 'int4')} store {options.pop('store_slots')}")
    parts += [f"{k}={v}" for k, v in options.items()]
    return " + ".join(parts)


def points(results: Results) -> list[Point]:
    """A retrieval run's cells with a measured share, by bytes; the full cache in another storage
    once (it compacts at no budget)."""
    found, seen = [], set()
    for spec, by_budget in results.cost.items():
        for budget, cost in by_budget.items():
            retrieval = results.retrieval.get(spec, {}).get(budget)
            if cost.kv_share != cost.kv_share or retrieval is None or (spec.startswith("none:") and spec in seen):
                continue
            seen.add(spec)
            found.append(Point(spec, budget, cost.kv_share, retrieval.hits, results.loss.get(spec, {}).get(budget)))
    return sorted(found, key=lambda p: (p.share, p.spec))


def bytes_tables(found: list[Point], items: str) -> str:
    """The table of quality against bytes, the best cell within each byte budget, and the
    equal-bytes table; `items` names what the outcomes count ("recalls", "problems")."""
    full = next((p for p in found if p.spec == "none"), None)
    if full is None or len(found) < 2:
        return ""
    asked, full_right = len(full.outcomes), sum(full.outcomes)
    with_loss = any(p.loss is not None for p in found)
    lines = [
        "### Quality against KV bytes",
        "",
        "every cell at its bytes (codes, scales, store and its page summaries) as a share of the full cache's in bf16; "
        f"{items} right / asked with the Wilson 95% interval, and as a share of the full cache's"
        + ("; streaming-loss NLL increase over the full cache" if with_loss else ""),
        "",
        f"| cell | budget | KV bytes | {items} | of the full cache's |" + (" NLL increase |" if with_loss else ""),
        "|---|---|---|---|---|" + ("---|" if with_loss else ""),
    ]
    for p in found:
        right = sum(p.outcomes)
        loss = (f" {p.loss.delta:+.3f} |" if p.loss is not None else " |") if with_loss else ""
        lines.append(f"| {label(p.spec)} | {_budget(p)} | {p.share:.1%} | {right}/{asked} {interval_text(right, asked)} | {_of(right, full_right)} |{loss}")
    lines.append("")
    for budget in BUDGET_SHARES:
        within = [p for p in found if _within(p.share, budget)]
        if within:
            best = max(within, key=lambda p: sum(p.outcomes))
            at = f" at budget {best.budget}" if _budget(best) else ""
            lines.append(
                f"- At {budget:.0%} of the bytes or less, the most {items}: {label(best.spec)}{at} ({best.share:.1%}), "
                f"{sum(best.outcomes)} against the full cache's {full_right} ({_of(sum(best.outcomes), full_right)})."
            )
    return "\n".join(lines + ["", equal_bytes_table(found, items, full_right)])


def equal_bytes_table(found: list[Point], items: str, full_right: int) -> str:
    """At each byte budget, the cells run there (more bytes than the budget before, no more than
    this one), each against the best single technique holding no more bytes than the budget
    (the most right, the cheapest of a tie): McNemar's exact test on the same items, Holm over the
    whole table. A budget where no cell ran says so, as does one where no single technique did."""
    rows: list[tuple[float, Point | None, Point | None]] = []  # (budget, cell, its reference)
    lower = 0.0
    for budget in BUDGET_SHARES:
        singles = [p for p in found if p.technique == "single" and _within(p.share, budget)]
        reference = max(singles, key=lambda p: sum(p.outcomes)) if singles else None
        cells = [p for p in found if not _within(p.share, lower) and _within(p.share, budget) and p.technique != "full"]
        rows += [(budget, cell, reference) for cell in cells] or [(budget, None, reference)]
        lower = budget
    if all(cell is None for _, cell, _ in rows):
        return ""
    tests = [mcnemar(c.outcomes, r.outcomes) if c is not None and r is not None and c is not r else None for _, c, r in rows]
    adjusted = iter(holm([t.p_value for t in tests if t is not None]))
    lines = [
        "### The equal-bytes table",
        "",
        "at each budget (a share of the full bf16 cache's bytes), the cells whose bytes fall between the budget before and it, each "
        "against the best single technique (eviction alone, or the whole cache in one storage) that holds no more than the budget: "
        f"{items} only the cell got right / only the single technique got right, McNemar's exact two-sided p, and * where the "
        "Holm-adjusted p over this table is < 0.05.",
        "",
        f"| budget | cell | cell budget | KV bytes | {items} (of the full cache's) | best single technique | KV bytes | {items} | only cell / only single | p |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (budget, cell, reference), test in zip(rows, tests):
        against = f" {_named(reference)} | {reference.share:.1%} | {sum(reference.outcomes)} |" if reference else " none run | | |"
        if cell is None:
            lines.append(f"| {budget:.0%} | not run | | | |{against} | |")
            continue
        right = sum(cell.outcomes)
        paired = f" {test.only_a}/{test.only_b} | {test.p_value:.2g}{' *' if next(adjusted) < 0.05 else ''} |" if test else " | |"
        lines.append(f"| {budget:.0%} | {label(cell.spec)} | {_budget(cell)} | {cell.share:.1%} | {right} ({_of(right, full_right)}) |{against}{paired}")
    return "\n".join(lines) + "\n"


def plot_bytes(found: list[Point], items: str, title: str, path: Path) -> None:
    """The share of `items` right against bytes, one line per cell kind over its budgets, Wilson
    intervals as error bars; nothing when there is nothing to compare."""
    if len(found) < 2:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.set_prop_cycle(color=plt.cm.tab20.colors)  # a merged table has more kinds of cell than the default cycle has colours
    for spec in dict.fromkeys(p.spec for p in found):
        series = [p for p in found if p.spec == spec]
        shares = [p.share for p in series]
        recalled = [sum(p.outcomes) / len(p.outcomes) for p in series]
        intervals = [wilson(sum(p.outcomes), len(p.outcomes)) for p in series]
        style = {"single": "o--", "combination": "s-", "full": "k*"}[series[0].technique]
        line = ax.plot(shares, recalled, style, label=label(spec), markersize=9 if spec == "none" else 5)[0]
        below, above = [r - lo for r, (lo, _) in zip(recalled, intervals)], [hi - r for r, (_, hi) in zip(recalled, intervals)]
        ax.errorbar(shares, recalled, yerr=[below, above], fmt="none", ecolor=line.get_color(), capsize=3, linewidth=1)
    for budget in BUDGET_SHARES:
        ax.axvline(budget, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ticks = (*BUDGET_SHARES, 1.0)
    ax.set_xticks(ticks, [f"{t:.0%}" for t in ticks])
    ax.set_xlabel("KV bytes, share of the full bf16 cache's")
    ax.set_ylabel(f"share of {items} right (95% CI)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _within(share: float, budget: float) -> bool:
    """Whether a cell holds no more than `budget`, to the 0.1% the tables show: a cell shown at
    25.0% sits at the 25% budget."""
    return round(share, 3) <= budget


def _named(p: Point) -> str:
    """'streaming + int4 cache at 1592', or 'full cache in int4'."""
    return f"{label(p.spec)} at {p.budget}" if _budget(p) else label(p.spec)


def _of(hits: int, full_hits: int) -> str:
    return f"{hits / full_hits:.0%}" if full_hits else "-"


def _budget(p: Point) -> str:
    """A cell's budget as the tables show it: none for the full cache in any storage."""
    return "" if p.spec.startswith("none") else p.budget
