"""The report of one benchmark point: each system's figures, the table, the ratios and the JSON.

Each figure is the median over a system's trials, which follow one warm-up run. Prefill tok/s is
batch * prompt length / TTFT; achieved GB/s is bytes per decode token (memory.py) times decode
tok/s; the shares compare decode tok/s with the two ceilings (machine.py). The ratios put the
engine over each other system, so >1 means the engine is faster in decode and <1 in TTFT.
"""

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from benchmark.machine import BUSY_WARNING_CORES, Machine, bandwidth_roofline
from benchmark.memory import DecodeTraffic
from benchmark.systems import CompressionCost
from benchmark.workers import SystemRun
from benchmark.workload import Workload, dtype_name

MIB = 2**20
RATIO_KEYS = ("decode_tok_s", "ttft_s", "prefill_tok_s", "peak_mem_mib")


@dataclass(frozen=True)
class Figures:
    """One system's reported figures: medians over the trials, and the trials themselves."""

    decode_tok_s: float
    ms_per_token: float  # one decode step: how long each row waits for its next token
    ttft_s: float
    prefill_tok_s: float  # batch * prompt_len / ttft_s
    gb_per_s: float  # bytes per token * decode_tok_s
    roofline_share: float  # decode_tok_s / machine.ceiling_tok_s
    matmul_ceiling_share: float | None  # decode_tok_s / machine.matmul_ceiling_tok_s
    peak_mem_mib: float
    base_mem_mib: float
    final_mem_mib: float | None
    kv_cache_mib: float
    others_busy_cores: float | None  # the most CPU other processes took during one timed trial: ~0 for a clean figure
    decode_tok_s_trials: list[float]
    ttft_s_trials: list[float]


@dataclass(frozen=True)
class Report:
    workload: Workload
    model_type: str
    machine: Machine
    traffic: DecodeTraffic
    matmul_ceiling_tok_s: float | None
    systems: dict[str, Figures]  # "engine" first
    compression: CompressionCost | None

    @property
    def ceiling_tok_s(self) -> float:
        return bandwidth_roofline(self.machine, self.traffic)

    def ratios(self) -> dict[str, dict[str, float]]:
        engine = self.systems["engine"]
        return {
            f"engine/{name}": {key: getattr(engine, key) / getattr(other, key) for key in RATIO_KEYS}
            for name, other in self.systems.items()
            if name != "engine"
        }

    def to_json(self) -> dict[str, Any]:
        w = self.workload
        return {
            "machine": {**asdict(self.machine), "ceiling_tok_s": self.ceiling_tok_s, "matmul_ceiling_tok_s": self.matmul_ceiling_tok_s},
            "config": {
                "checkpoint": str(w.checkpoint),
                "model_type": self.model_type,
                "dtype": dtype_name(w.dtype),
                "device": str(w.device),
                "batch": w.batch,
                "prompt_len": w.prompt_len,
                "new_tokens": w.new_tokens,
                "trials": w.trials,
                "compile": w.compile,
                "quant": w.quant,
                "group_size": w.group_size if w.quant == "int4" else None,
                "gguf": None if w.gguf is None else str(w.gguf),
                "kv_policy": asdict(w.compression),
                "kv_dtype": w.kv_dtype,
            },
            "traffic": {
                "bytes_per_token": self.traffic.bytes_per_token,
                "bytes_per_step": self.traffic.bytes_per_step,
                "weight_bytes_per_step": self.traffic.weight_bytes,
                "kv_bytes_per_slot": self.traffic.kv_bytes_per_slot,
                "mean_kv_slots": self.traffic.mean_slots,
            },
            **{name: asdict(figures) for name, figures in self.systems.items()},
            "ratios": self.ratios(),
            "compression": None if self.compression is None else asdict(self.compression),
        }


def figures(run: SystemRun, w: Workload, traffic: DecodeTraffic, roofline_tok_s: float, matmul_tok_s: float | None) -> Figures:
    decode = statistics.median(t.decode_tok_s for t in run.trials)
    ttft = statistics.median(t.ttft_s for t in run.trials)
    return Figures(
        decode_tok_s=decode,
        ms_per_token=1000 * w.batch / decode,
        ttft_s=ttft,
        prefill_tok_s=w.batch * w.prompt_len / ttft,
        gb_per_s=traffic.bytes_per_token * decode / 1e9,
        roofline_share=decode / roofline_tok_s,
        matmul_ceiling_share=decode / matmul_tok_s if matmul_tok_s else None,
        peak_mem_mib=run.peak_mem_bytes / MIB,
        base_mem_mib=run.base_mem_bytes / MIB,
        final_mem_mib=None if run.final_mem_bytes is None else run.final_mem_bytes / MIB,
        kv_cache_mib=run.trials[-1].kv_cache_bytes / MIB,
        others_busy_cores=run.others_busy_cores,
        decode_tok_s_trials=[t.decode_tok_s for t in run.trials],
        ttft_s_trials=[t.ttft_s for t in run.trials],
    )


def number(x: float) -> str:
    """Three or four significant digits, never in exponent form."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}" if abs(x) >= 1 else f"{x:.3g}"


def percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


TABLE_ROWS: list[tuple[str, Callable[[Figures], str]]] = [
    ("decode (tok/s)", lambda f: number(f.decode_tok_s)),
    ("decode (ms/token)", lambda f: number(f.ms_per_token)),
    ("TTFT (s)", lambda f: number(f.ttft_s)),
    ("prefill (tok/s)", lambda f: number(f.prefill_tok_s)),
    ("achieved (GB/s)", lambda f: number(f.gb_per_s)),
    ("bandwidth roofline share (%)", lambda f: percent(f.roofline_share)),
    ("bare-matmul ceiling share (%)", lambda f: percent(f.matmul_ceiling_share)),
    ("peak memory (MiB)", lambda f: number(f.peak_mem_mib)),
    ("  of which before loading (MiB)", lambda f: number(f.base_mem_mib)),
    ("held after the trials (MiB)", lambda f: "-" if f.final_mem_mib is None else number(f.final_mem_mib)),
    ("KV cache (MiB)", lambda f: number(f.kv_cache_mib)),
    ("others' CPU, busiest trial (cores)", lambda f: "-" if f.others_busy_cores is None else f"{f.others_busy_cores:.2f}"),
]


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [[cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)] for row in [header, *rows]]
    return "\n".join("  ".join(line) for line in lines)


def other_weights(w: Workload) -> str:
    """The engine's weight format when not the checkpoint's own (the other systems always run that), and llama.cpp's file."""
    label = f", engine weights {w.quant_label}" if w.quant_label else ""
    return label + ("" if w.gguf is None else f", llama.cpp on {w.gguf.name}")


def describe(r: Report) -> str:
    m, w, t = r.machine, r.workload, r.traffic
    device = m.accelerator or f"{m.cpu}, {m.cores} cores"
    matmul = f" | bare-matmul ceiling {number(r.matmul_ceiling_tok_s)} tok/s" if r.matmul_ceiling_tok_s else ""
    busy = "" if m.others_busy_cores is None else f" | others' CPU at the start: {m.others_busy_cores:.2f} cores"
    return "\n".join([
        f"machine: {device} | torch {m.torch}, {m.threads} threads | read bandwidth {number(m.read_gb_per_s)} GB/s{busy}",
        f"model: {w.checkpoint.name} ({r.model_type}), {dtype_name(w.dtype)} on {w.device}{other_weights(w)}"
        f"{', compiled decode step' if w.compile else ''}{'' if w.kv_dtype == 'auto' else f', KV cache {w.kv_dtype}'} | batch {w.batch}, prompt {w.prompt_len}, "
        f"{w.new_tokens} new tokens | median of {w.trials} trials",
        f"bytes per decode token: {number(t.bytes_per_token / 1e6)} MB (weights {number(t.weight_bytes / 1e6)} MB per step, "
        f"KV {number(t.kv_bytes_per_slot * t.mean_slots / 1e6)} MB per row) | bandwidth roofline {number(r.ceiling_tok_s)} tok/s{matmul}",
    ])


def print_report(r: Report) -> None:
    names = list(r.systems)
    rows = [[label, *(cell(r.systems[name]) for name in names)] for label, cell in TABLE_ROWS]
    print(describe(r), table(["", *names], rows), sep="\n\n")
    for pair, ratio in r.ratios().items():
        print(
            f"{pair}: decode {ratio['decode_tok_s']:.2f}x (>1: engine faster), TTFT {ratio['ttft_s']:.2f}x (<1: engine faster), "
            f"peak memory {ratio['peak_mem_mib']:.2f}x"
        )
    c = r.compression
    if c is not None:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f} ms"

        print(f"engine's KV policy in the last trial: {c.compactions} compactions ({ms(c.compaction_ms)} each, median), "
              f"{c.refreshes} beacon refreshes ({ms(c.refresh_ms)} each): together {c.share_of_decode:.1%} of its decode time")
    busiest = max((f.others_busy_cores or 0.0 for f in r.systems.values()), default=0.0)
    if busiest > BUSY_WARNING_CORES:
        print(f"warning: other processes took up to {busiest:.2f} cores during the timed trials: these figures understate the systems")
    print(flush=True)
