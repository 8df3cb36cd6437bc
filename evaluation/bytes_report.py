"""Quality against the bytes the KV cache holds: every cell at its share of a full bf16 cache's
bytes (codes, scales, the store and its page summaries counted), the plot of recall against
bytes, and each combination (eviction with a quantized cache or a store) tested against every
single technique (eviction alone, or the whole cache quantized) that holds at least as many bytes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from evaluation.config import split_storage
from evaluation.metrics import LossResult, Results, RetrievalResult
from evaluation.statistics import holm, interval_text, mcnemar, wilson

GOAL_SHARES = (0.10, 0.25)  # issue 29's byte budgets: recall there, as a share of the full cache's


@dataclass(frozen=True)
class Point:
    """One cell where it sits on the bytes axis."""

    spec: str  # "none", "streaming", "streaming:kv_dtype=int4:store_slots=256", ...
    budget: str  # generated tokens kept, or "full"
    share: float  # of a full bf16 cache's bytes
    retrieval: RetrievalResult | None
    loss: LossResult | None

    @property
    def technique(self) -> str:
        """'full' (the bf16 reference), 'single' (eviction alone, or the whole cache quantized) or 'combination'."""
        if self.spec == "none":
            return "full"
        policy, kv_dtype = split_storage(self.spec)
        return "single" if policy == "none" or (kv_dtype == "auto" and "store_slots" not in policy) else "combination"

    @property
    def recalls(self) -> list[bool]:
        return self.retrieval.hits if self.retrieval is not None else []


def label(spec: str) -> str:
    """'streaming:kv_dtype=int4:store_slots=256' -> 'streaming + int4 cache + store 256'."""
    if spec == "none":
        return "full cache"
    policy, kv_dtype = split_storage(spec)
    name, *settings = policy.split(":")
    options = dict(s.partition("=")[::2] for s in settings)
    parts = ["full cache" if name == "none" else name] + ([f"{kv_dtype} cache"] if kv_dtype != "auto" else [])
    if "store_slots" in options:
        parts.append(f"{options.pop('store_dtype', 'int4')} store {options.pop('store_slots')}")
    parts += [f"{k}={v}" for k, v in options.items()]
    return " + ".join(parts)


def points(results: Results) -> list[Point]:
    """Every cell with a measured share, by bytes; the full cache in another storage once (it
    compacts at no budget)."""
    found, seen = [], set()
    for spec, by_budget in results.cost.items():
        for budget, cost in by_budget.items():
            if cost.kv_share != cost.kv_share or (spec.startswith("none:") and spec in seen):
                continue
            seen.add(spec)
            found.append(Point(spec, budget, cost.kv_share, results.retrieval.get(spec, {}).get(budget), results.loss.get(spec, {}).get(budget)))
    return sorted(found, key=lambda p: (p.share, p.spec))


def bytes_tables(results: Results) -> str:
    found = points(results)
    full = next((p for p in found if p.spec == "none" and p.retrieval is not None), None)
    if full is None or len(found) < 2:
        return ""
    asked = len(full.recalls)
    lines = [
        "### Quality against KV bytes",
        "",
        "every cell at its bytes (codes, scales, store and its page summaries) as a share of the full cache's in bf16; "
        "facts recalled / asked with the Wilson 95% interval, and as a share of the full cache's recalls"
        + ("; streaming-loss NLL increase over the full cache" if results.loss else ""),
        "",
        "| cell | budget | KV bytes | recalls | of the full cache's |" + (" NLL increase |" if results.loss else ""),
        "|---|---|---|---|---|" + ("---|" if results.loss else ""),
    ]
    full_hits = sum(full.recalls)
    for p in found:
        hits = sum(p.recalls)
        loss = f" {p.loss.delta:+.3f} |" if p.loss is not None else (" |" if results.loss else "")
        budget = "" if p.spec.startswith("none") else p.budget
        lines.append(f"| {label(p.spec)} | {budget} | {p.share:.1%} | {hits}/{asked} {interval_text(hits, asked)} | {_of(hits, full_hits)} |{loss}")
    lines.append("")
    for goal in GOAL_SHARES:
        within = [p for p in found if p.share <= goal and p.retrieval is not None]
        if within:
            best = max(within, key=lambda p: sum(p.recalls))
            lines.append(
                f"- At {goal:.0%} of the bytes or less, the most recalls: {label(best.spec)}"
                + (f" at budget {best.budget}" if not best.spec.startswith("none") else "")
                + f" ({best.share:.1%}), {sum(best.recalls)} of the full cache's {full_hits} ({_of(sum(best.recalls), full_hits)})."
            )
    return "\n".join(lines + ["", dominance_table(found)])


def dominance_table(found: list[Point]) -> str:
    """Each combination against, for each single technique, its cheapest cell holding at least as
    many bytes: McNemar's exact test on the same recalls, Holm over the whole table."""
    singles: dict[str, list[Point]] = {}
    for p in found:
        if p.technique == "single" and p.retrieval is not None:
            singles.setdefault(p.spec, []).append(p)
    pairs = []
    for c in (p for p in found if p.technique == "combination" and p.retrieval is not None):
        for cells in singles.values():
            richer = [s for s in cells if s.share >= c.share]
            if richer:
                pairs.append((c, min(richer, key=lambda s: s.share)))
    if not pairs:
        return ""
    tests = [mcnemar(c.recalls, s.recalls) for c, s in pairs]
    adjusted = holm([t.p_value for t in tests])
    lines = [
        "### Combinations against single techniques at no more bytes (McNemar's exact test)",
        "",
        "each combination against the cheapest cell of each single technique that holds at least as many bytes: recalls only "
        "the combination got / only the single technique got, the two-sided p-value, and * where the Holm-adjusted p over "
        "this table is < 0.05. Recalls of one trace share its cache, so these p-values are optimistic for new traces.",
        "",
        "| combination | budget | KV bytes | single technique | budget | KV bytes | only combination / only single | p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (c, s), t, a in zip(pairs, tests, adjusted):
        single_budget = "" if s.spec.startswith("none") else s.budget
        lines.append(
            f"| {label(c.spec)} | {c.budget} | {c.share:.1%} | {label(s.spec)} | {single_budget} | {s.share:.1%} | "
            f"{t.only_a}/{t.only_b} | {t.p_value:.2g}{' *' if a < 0.05 else ''} |"
        )
    return "\n".join(lines) + "\n"


def plot_bytes(results: Results, path: Path) -> bool:
    """Recall against bytes, one line per cell kind over its budgets, Wilson intervals as error
    bars; False when there is nothing to plot."""
    found = [p for p in points(results) if p.retrieval is not None]
    if len(found) < 2:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for spec in dict.fromkeys(p.spec for p in found):
        series = [p for p in found if p.spec == spec]
        shares = [p.share for p in series]
        recalled = [sum(p.recalls) / len(p.recalls) for p in series]
        intervals = [wilson(sum(p.recalls), len(p.recalls)) for p in series]
        style = {"single": "o--", "combination": "s-", "full": "k*"}[series[0].technique]
        line = ax.plot(shares, recalled, style, label=label(spec), markersize=9 if spec == "none" else 5)[0]
        below, above = [r - lo for r, (lo, _) in zip(recalled, intervals)], [hi - r for r, (_, hi) in zip(recalled, intervals)]
        ax.errorbar(shares, recalled, yerr=[below, above], fmt="none", ecolor=line.get_color(), capsize=3, linewidth=1)
    for goal in GOAL_SHARES:
        ax.axvline(goal, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ax.set_xticks([0.05, 0.1, 0.25, 0.5, 1.0], ["5%", "10%", "25%", "50%", "100%"])
    ax.set_xlabel("KV bytes, share of the full bf16 cache's")
    ax.set_ylabel("facts recalled (95% CI)")
    ax.set_title(f"Recall against KV bytes, {results.model}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _of(hits: int, full_hits: int) -> str:
    return f"{hits / full_hits:.0%}" if full_hits else "-"
