"""A sweep over prompt lengths (bench.py --sweep): one report per length, then decode speed by
prompt length as a table on stdout and a plot drawn with matplotlib."""

from pathlib import Path

from benchmark.report import Report, number, table
from benchmark.workload import dtype_name, progress


def print_sweep(reports: list[Report]) -> None:
    names = list(reports[0].systems)
    header = ["prompt", *(f"{name} (tok/s)" for name in names), "roofline (tok/s)"]
    rows = [[str(r.workload.prompt_len), *(number(r.systems[n].decode_tok_s) for n in names), number(r.ceiling_tok_s)] for r in reports]
    print("decode speed by prompt length", table(header, rows), sep="\n", end="\n\n")


def plot_sweep(reports: list[Report], path: Path) -> None:
    import matplotlib  # an optional dependency: only a sweep needs it

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    lengths = [r.workload.prompt_len for r in reports]
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in reports[0].systems:
        ax.plot(lengths, [r.systems[name].decode_tok_s for r in reports], marker="o", label=name)
    ax.plot(lengths, [r.ceiling_tok_s for r in reports], linestyle="--", color="gray", label="bandwidth roofline")
    if reports[0].matmul_ceiling_tok_s:
        ax.plot(lengths, [r.matmul_ceiling_tok_s for r in reports], linestyle=":", color="black", label="bare-matmul ceiling")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("decode (tok/s)")
    w, m = reports[0].workload, reports[0].machine
    ax.set_title(f"{w.checkpoint.name}, {dtype_name(w.dtype)}, batch {w.batch}, {w.new_tokens} new tokens\n{m.accelerator or m.cpu}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    progress(f"wrote {path}")
