"""Quality against the bytes the KV cache holds: every cell at its share of a full bf16 cache's
bytes (codes, scales, the store and its page summaries counted), the plot of recall against
bytes, and each combination (eviction with a quantized cache or a store) tested against every
single technique (eviction alone, or the whole cache quantized) that holds at least as many bytes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from evaluation.config import split_storage
from evaluation.metrics import LossResult, Results
from evaluation.statistics import holm, interval_text, mcnemar, wilson

GOAL_SHARES = (0.10, 0.25)  # issue 29's byte budgets: recall there, as a share of the full cache's


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
    """The table of quality against bytes, the best cell under each goal's bytes, and the paired
    tests; `items` names what the outcomes count ("recalls", "problems")."""
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
    for goal in GOAL_SHARES:
        within = [p for p in found if p.share <= goal]
        if within:
            best = max(within, key=lambda p: sum(p.outcomes))
            at = f" at budget {best.budget}" if _budget(best) else ""
            lines.append(
                f"- At {goal:.0%} of the bytes or less, the most {items}: {label(best.spec)}{at} ({best.share:.1%}), "
                f"{sum(best.outcomes)} against the full cache's {full_right} ({_of(sum(best.outcomes), full_right)})."
            )
    return "\n".join(lines + ["", dominance_table(found)])


def dominance_table(found: list[Point]) -> str:
    """Each combination against, for each single technique, its cheapest cell holding at least as
    many bytes: McNemar's exact test on the same recalls, Holm over the whole table."""
    singles: dict[str, list[Point]] = {}
    for p in found:
        if p.technique == "single":
            singles.setdefault(p.spec, []).append(p)
    pairs = []
    for c in (p for p in found if p.technique == "combination"):
        for cells in singles.values():
            richer = [s for s in cells if s.share >= c.share]
            if richer:
                pairs.append((c, min(richer, key=lambda s: s.share)))
    if not pairs:
        return ""
    tests = [mcnemar(c.outcomes, s.outcomes) for c, s in pairs]
    adjusted = holm([t.p_value for t in tests])
    lines = [
        "### Combinations against single techniques at no more bytes (McNemar's exact test)",
        "",
        "each combination against the cheapest cell of each single technique that holds at least as many bytes: items (recalls "
        "or problems) only the combination got right / only the single technique got right, the two-sided p-value, and * where the Holm-adjusted p over "
        "this table is < 0.05.",
        "",
        "| combination | budget | KV bytes | single technique | budget | KV bytes | only combination / only single | p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (c, s), t, a in zip(pairs, tests, adjusted):
        lines.append(
            f"| {label(c.spec)} | {c.budget} | {c.share:.1%} | {label(s.spec)} | {_budget(s)} | {s.share:.1%} | "
            f"{t.only_a}/{t.only_b} | {t.p_value:.2g}{' *' if a < 0.05 else ''} |"
        )
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
    for spec in dict.fromkeys(p.spec for p in found):
        series = [p for p in found if p.spec == spec]
        shares = [p.share for p in series]
        recalled = [sum(p.outcomes) / len(p.outcomes) for p in series]
        intervals = [wilson(sum(p.outcomes), len(p.outcomes)) for p in series]
        style = {"single": "o--", "combination": "s-", "full": "k*"}[series[0].technique]
        line = ax.plot(shares, recalled, style, label=label(spec), markersize=9 if spec == "none" else 5)[0]
        below, above = [r - lo for r, (lo, _) in zip(recalled, intervals)], [hi - r for r, (_, hi) in zip(recalled, intervals)]
        ax.errorbar(shares, recalled, yerr=[below, above], fmt="none", ecolor=line.get_color(), capsize=3, linewidth=1)
    for goal in GOAL_SHARES:
        ax.axvline(goal, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ax.set_xticks([0.05, 0.1, 0.25, 0.5, 1.0], ["5%", "10%", "25%", "50%", "100%"])
    ax.set_xlabel("KV bytes, share of the full bf16 cache's")
    ax.set_ylabel(f"share of {items} right (95% CI)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _of(hits: int, full_hits: int) -> str:
    return f"{hits / full_hits:.0%}" if full_hits else "-"


def _budget(p: Point) -> str:
    """A cell's budget as the tables show it: none for the full cache in any storage."""
    return "" if p.spec.startswith("none") else p.budget
