"""The HumanEval results as a reader sees them: pass@1 with intervals, the paired tests, the plot."""

from __future__ import annotations

from pathlib import Path

from evaluation.bytes_report import Point, bytes_tables, plot_bytes
from evaluation.coding import PUBLISHED_PASS_AT_1, HumanEvalResults, cell_key, write_json
from evaluation.saving import kernels_text
from evaluation.statistics import holm, mcnemar, wilson


def _share(passed: list[bool]) -> str:
    low, high = wilson(sum(passed), len(passed))
    return f"{sum(passed) / len(passed):.0%} {sum(passed)}/{len(passed)} [{low:.0%}, {high:.0%}]"


def markdown(results: HumanEvalResults) -> str:
    c = results.config
    budgets, policies = c["budgets"], c["policies"]
    cells = results.cells
    full = cells.get("none")
    lines = [
        f"# HumanEval under KV-cache policies, {results.model}",
        "",
        "Written by `python evaluate.py --task humaneval`; evaluation/coding.py says how.",
        "",
        f"- problems {c['first']}-{c['last']} of HumanEval (problems 100-163 are never used); greedy, chat template, "
        f"up to {c['max_new_tokens']} new tokens, ended at the code block's closing fence; {c['batch']} problems per batch",
        f"- budgets {budgets} generated tokens kept (the prompt is always kept), hysteresis {c['hysteresis']}, window {c['window']}, "
        f"n_beacon {c['n_beacon']}, n_recent {c['n_recent']}, BeaconKV aggregation {c['aggregation']}; {c['dtype']}, torch threads: {c.get('threads', '?')}{kernels_text(c)}",
        f"- pass@1 = the program (prompt, the answer's code, the tests) passes in a subprocess with a {c['timeout_s']:.0f} s timeout, "
        "2 GiB of memory, no network; Wilson 95% intervals in brackets",
        f"- wall time {results.seconds / 60:.1f} min, peak RSS {c.get('peak_rss_mib', 0):.0f} MiB",
    ]
    expected = 1 + len(budgets) * len(policies)
    if len(cells) < expected:
        lines.append(f"- **partial results**: {len(cells)} of {expected} cells done (run the same command again to resume)")
    if full is not None:
        lines.append(
            f"- full cache: pass@1 {_share(full.passed)}; the model's published figure is {PUBLISHED_PASS_AT_1:.1%} "
            "on all 164 problems (its own prompt and harness)"
        )
    lines += ["", "### pass@1", "", "| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
    if full is not None:
        lines.append("| full cache | " + " | ".join(_share(full.passed) for _ in budgets) + " |")
    for policy in policies:
        row = [_share(cells[cell_key(policy, b)].passed) if cell_key(policy, b) in cells else "" for b in budgets]
        lines.append(f"| {policy} | " + " | ".join(row) + " |")
    if "beacon" in policies:
        others = ["none"] + [p for p in policies if p != "beacon"]
        lines += [
            "",
            "### BeaconKV against each policy on the same problems (McNemar's exact test)",
            "",
            "problems only BeaconKV solved / problems only the other solved, two-sided p-value; * where the Holm-adjusted "
            "p over the whole table is < 0.05.",
            "",
            "| budget | " + " | ".join("full cache" if p == "none" else p for p in others) + " |",
            "|---" * (len(others) + 1) + "|",
        ]
        done = [b for b in budgets if cell_key("beacon", b) in cells]
        tests = {
            (b, other): mcnemar(cells[cell_key("beacon", b)].passed, cells[key].passed)
            for b in done
            for other in others
            if (key := cell_key(other, b if other != "none" else None)) in cells
        }
        adjusted = dict(zip(tests, holm([t.p_value for t in tests.values()])))
        for b in done:
            row = [
                "" if (b, other) not in tests else f"{tests[b, other].only_a}/{tests[b, other].only_b} p={tests[b, other].p_value:.2g}{' *' if adjusted[b, other] < 0.05 else ''}"
                for other in others
            ]
            lines.append(f"| {b} | " + " | ".join(row) + " |")
    lines += ["", bytes_tables(points(results), "problems")]
    lines += ["", "### Cost", "", "generation seconds for all problems (prefill included), new tokens, compactions.", "", "| policy | budget | seconds | new tokens | compactions |", "|---|---|---|---|---|"]
    for key, cell in cells.items():
        lines.append(f"| {'full cache' if cell.budget is None else cell.policy} | {cell.budget or ''} | {cell.seconds:.0f} | {sum(cell.new_tokens)} | {cell.compactions} |")
    return "\n".join(lines) + "\n"


def points(results: HumanEvalResults) -> list[Point]:
    """The cells with a measured share of the bytes, by bytes; the full cache in another storage
    once (it compacts at no budget)."""
    found: dict[tuple[str, int | None], Point] = {}
    for cell in results.cells.values():
        if cell.kv_share != cell.kv_share:
            continue
        spec = "none" if cell.budget is None else cell.policy
        key = (spec, None if spec.startswith("none") else cell.budget)
        found.setdefault(key, Point(spec, str(cell.budget or "full"), cell.kv_share, cell.passed))
    return sorted(found.values(), key=lambda p: (p.share, p.spec))


def plot(results: HumanEvalResults, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = results.config["budgets"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy in results.config["policies"]:
        cells = [results.cells.get(cell_key(policy, b)) for b in budgets]
        if any(c is None for c in cells):
            continue
        shares = [c.pass_at_1 for c in cells]
        intervals = [wilson(sum(c.passed), len(c.passed)) for c in cells]
        below, above = [s - lo for s, (lo, _) in zip(shares, intervals)], [hi - s for s, (_, hi) in zip(shares, intervals)]
        ax.errorbar(budgets, shares, yerr=[below, above], marker="o", capsize=3, label=policy, linewidth=2.8 if policy == "beacon" else 1.2)
    if "none" in results.cells:
        ax.axhline(results.cells["none"].pass_at_1, color="k", linestyle="--", label="full cache")
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("budget (generated tokens kept)")
    ax.set_ylabel("pass@1 (95% CI)")
    ax.set_title(f"HumanEval 0-{results.config['last']}, {results.model}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results: HumanEvalResults, out: Path) -> str:
    write_json(results, out)
    text = markdown(results)
    (out / "results.md").write_text(text)
    plot(results, out / "pass_at_1.png")
    plot_bytes(points(results), "problems", f"HumanEval 0-{results.config['last']} against KV bytes, {results.model}", out / "pass_at_1_vs_bytes.png")
    return text
