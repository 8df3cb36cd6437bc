"""bench.py under torchrun: the engine split over N ranks, its decode speed and each rank's memory.

Every rank is one process holding its part of the model (models/parallel.py), so no worker is
spawned: each rank loads, warms up (compiling its step), then all take each timed trial
together, started by a barrier. Decode tok/s and TTFT are rank 0's (the ranks move in lockstep:
every step ends in the same collectives). Memory is each rank's own: the weights a decode step
reads, its KV cache, and its resident high-water mark. Rank 0 prints the table; --json writes it.
"""

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from benchmark.memory import memory_high_water, memory_in_use
from benchmark.systems import load_engine
from benchmark.workload import Trial, Workload, dtype_name, progress
from models.parallel import shard_config
from weights.loader import read_config

MIB = 2**20


@dataclass(frozen=True)
class RankFigures:
    rank: int
    kv_heads: int
    weight_bytes: int  # what one decode step reads: the rank's layers, its LM head rows, one embedding row
    kv_cache_bytes: int
    peak_mem_bytes: int
    held_mem_bytes: int | None  # resident after the trials (None off Linux)
    trials: list[Trial]


def measure_ranks(w: Workload) -> list[RankFigures] | None:
    """Every rank's figures, on rank 0 (None on the others). Without w.parallel: one rank, the whole model."""
    tp = w.parallel
    loaded = load_engine(w)  # loads this rank's part and runs the warm-up
    trials = []
    for i in range(w.trials):
        if tp is not None:
            dist.barrier(group=tp.group)
        trials.append(loaded.measure())
        progress(f"trial {i + 1}/{w.trials}: {trials[-1].summary}")
    config = read_config(w.checkpoint)
    kv_heads = config.n_kv_heads if tp is None else shard_config(config, tp).n_kv_heads
    mine = RankFigures(
        0 if tp is None else tp.rank, kv_heads, loaded.extras().traffic.weight_bytes, trials[-1].kv_cache_bytes,
        memory_high_water(w.device), memory_in_use(w.device), trials,
    )
    if tp is None:
        return [mine]
    every: list[RankFigures | None] = [None] * tp.world
    dist.gather_object(mine, every if tp.rank == 0 else None, dst=0, group=tp.group)
    return every if tp.rank == 0 else None


def print_ranks(w: Workload, ranks: list[RankFigures], threads: int) -> None:
    config = read_config(w.checkpoint)
    decode = [t.decode_tok_s for t in ranks[0].trials]
    ttft = statistics.median(t.ttft_s for t in ranks[0].trials)
    backend = "one process" if len(ranks) == 1 else "NCCL" if w.device.type == "cuda" else "gloo"
    print(
        f"tensor parallel: {len(ranks)} rank(s) ({backend}), {threads} thread(s) each | "
        f"{w.checkpoint.name}, {dtype_name(w.dtype)}, batch {w.batch}, prompt {w.prompt_len}, {w.new_tokens} new tokens, "
        f"{'compiled' if w.compile else 'eager'} step, {w.trials} trials"
    )
    print(f"decode: {statistics.median(decode):.1f} tok/s (median; {min(decode):.1f}-{max(decode):.1f}) | TTFT: {ttft * 1000:.0f} ms\n")
    print("| rank | KV heads | weights read per step | KV cache | peak memory | held after |")
    print("|---|---|---|---|---|---|")
    for r in ranks:
        held = "-" if r.held_mem_bytes is None else f"{r.held_mem_bytes / MIB:.0f} MiB"
        print(
            f"| {r.rank} | {r.kv_heads} of {config.n_kv_heads} | {r.weight_bytes / MIB:.1f} MiB | {r.kv_cache_bytes / MIB:.1f} MiB | "
            f"{r.peak_mem_bytes / MIB:.0f} MiB | {held} |"
        )
    print(flush=True)


def ranks_json(ranks: list[RankFigures], out: Path) -> None:
    out.write_text(json.dumps({"ranks": [asdict(r) for r in ranks]}, indent=2) + "\n")
    progress(f"wrote {out}")
