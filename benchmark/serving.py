"""The serving workload (bench.py --workload): many prompts of mixed lengths, each with its own
number of new tokens, answered max_batch at a time by these systems in turn:

- engine_continuous: engine.scheduler.serve, continuous batching on the paged cache, whose pool
  holds as many bytes as engine_static's cache unless --kv-blocks says otherwise;
- engine_static: the same prompts in batches of max_batch, in order, each batch one
  engine.generation.generate on the contiguous cache; a batch ends when its longest answer does;
- transformers: the same batches through transformers' generate, left-padded, each batch to its
  most new tokens (its rows cannot stop on their own without EOS);
- with --serve, instead of the last two: serve.py over HTTP, every request at once
  (server_concurrent) and one at a time (server_one_by_one), benchmark/load.py.

Throughput counts each prompt's own new tokens only, over the whole run (prefills included);
KV peak is the most cache memory held at once.
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmark.load import load_llama_server, load_server
from benchmark.machine import Machine, synchronize
from benchmark.report import MIB, number, table
from benchmark.workers import Loaded, System, SystemRun, timed_in_turn
from benchmark.workload import ServingTrial, ServingWorkload, dtype_name, progress
from engine.options import RunOptions, generate
from kv.paged import PageConfig
from engine.scheduler import Request, serve
from weights.forms import load_model


def random_requests(vocab_size: int, n: int, prompt_lens: tuple[int, int], new_tokens: tuple[int, int], seed: int) -> list[Request]:
    """n prompts of random token ids, their lengths and new tokens drawn uniformly from the ranges (inclusive)."""
    generator = torch.Generator().manual_seed(seed)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=generator))

    requests = []
    for _ in range(n):
        length, new = draw(*prompt_lens), draw(*new_tokens)
        requests.append(Request(torch.randint(vocab_size, (length,), generator=generator).tolist(), new))
    return requests


def batches(w: ServingWorkload) -> list[list[Request]]:
    return [w.requests[i : i + w.max_batch] for i in range(0, len(w.requests), w.max_batch)]


def batch_by_batch(w: ServingWorkload, run_batch: Callable[[list[Request]], tuple[int, int]]) -> ServingTrial:
    """One trial of a static batching system: its batches in order, each run by run_batch, which
    returns the batch's new tokens and its cache's bytes."""
    start = time.perf_counter()
    with torch.inference_mode():
        done = [run_batch(batch) for batch in batches(w)]
    synchronize(w.device)
    return ServingTrial(time.perf_counter() - start, sum(n for n, _ in done), max(kv for _, kv in done), w.max_batch)


def pool_pages(w: ServingWorkload) -> PageConfig:
    """Continuous batching's pool: --kv-blocks, else the blocks of static batching's cache bytes."""
    if w.pages.n_blocks is not None:
        return w.pages
    return PageConfig(w.pages.block_size, w.max_batch * w.row_slots // w.pages.block_size)


def load_engine_continuous(w: ServingWorkload) -> Loaded:
    progress(f"engine_continuous: loading {w.checkpoint} as {dtype_name(w.dtype)} on {w.device}")
    model = load_model(w.checkpoint, w.dtype, w.device, w.quant, w.group_size)
    pages = pool_pages(w)

    def measure() -> ServingTrial:
        with torch.inference_mode():
            run = serve(model, w.requests, w.max_batch, eos_ids=frozenset(), options=RunOptions(compression=w.compression, pages=pages, compile=w.compile, cuda_graph=w.device.type == "cuda", kv_dtype=w.kv_dtype))
        synchronize(w.device)
        return ServingTrial(run.seconds, run.new_tokens, run.kv_peak_bytes, run.most_rows)

    progress("engine_continuous: warm-up run" + (", which compiles the decode step" if w.compile else ""))
    measure()
    return Loaded(measure, lambda: None)


def load_engine_static(w: ServingWorkload) -> Loaded:
    progress(f"engine_static: loading {w.checkpoint} as {dtype_name(w.dtype)} on {w.device}")
    model = load_model(w.checkpoint, w.dtype, w.device, w.quant, w.group_size)

    def run_batch(batch: list[Request]) -> tuple[int, int]:
        """One batch to its end; each row stops at its own token count. Returns its new tokens and cache bytes."""
        limits = [r.max_new_tokens for r in batch]
        made = [0] * len(batch)

        def stop_at_limit(news: dict[int, int | None]) -> list[int]:
            for row, token in news.items():
                made[row] += token is not None
            return [row for row in news if made[row] >= limits[row]]

        result = generate(model, [r.prompt for r in batch], max(limits), eos_ids=frozenset(), on_tokens=stop_at_limit, n_slots=w.row_slots, options=RunOptions(compile=w.compile, compression=w.compression, cuda_graph=w.device.type == "cuda", kv_dtype=w.kv_dtype))
        return result.new_tokens, result.kv_peak_bytes

    measure = partial(batch_by_batch, w, run_batch)
    progress("engine_static: warm-up run" + (", which compiles the decode step" if w.compile else ""))
    measure()
    return Loaded(measure, lambda: None)


def load_transformers_batched(w: ServingWorkload) -> Loaded:
    import transformers

    transformers.logging.set_verbosity_error()
    progress(f"transformers: loading {w.peer_checkpoint or w.checkpoint} as {dtype_name(w.dtype)} on {w.device}")
    model = transformers.AutoModelForCausalLM.from_pretrained(w.peer_checkpoint or w.checkpoint, dtype=w.dtype).to(w.device).eval()

    def run_batch(batch: list[Request]) -> tuple[int, int]:
        longest = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[0] * (longest - len(r.prompt)) + r.prompt for r in batch], device=w.device)  # left-padded
        mask = torch.tensor([[0] * (longest - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=w.device)
        n = max(r.max_new_tokens for r in batch)
        out: Any = model.generate(
            ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, return_dict_in_generate=True
        )
        kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in out.cache.layers)
        return sum(r.max_new_tokens for r in batch), kv_bytes

    measure = partial(batch_by_batch, w, run_batch)
    progress("transformers: warm-up run")
    measure()
    return Loaded(measure, lambda: None)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the nearest ranks."""
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


@dataclass(frozen=True)
class ServingFigures:
    tok_s: float  # median over the trials
    seconds: float
    kv_peak_mib: float
    most_rows: int
    peak_mem_mib: float  # the process's (for the server's systems, the server process's)
    tok_s_trials: list[float]
    ttft_p50_s: float | None = None  # medians over the trials of each trial's percentile (the server's systems)
    ttft_p95_s: float | None = None
    extras: dict | None = None  # the server's systems: the last trial's answers, and the run with faults

    @classmethod
    def of(cls, run: SystemRun, extras: dict | None) -> "ServingFigures":
        trials = run.trials
        middle = sorted(trials, key=lambda t: t.tok_s)[len(trials) // 2]
        ttfts = [t.ttft_s for t in trials if t.ttft_s]
        return cls(
            statistics.median(t.tok_s for t in trials), statistics.median(t.seconds for t in trials), middle.kv_peak_bytes / MIB,
            max(t.most_rows for t in trials), (extras["peak_mem_bytes"] if extras else run.peak_mem_bytes) / MIB, [t.tok_s for t in trials],
            statistics.median(percentile(t, 50) for t in ttfts) if ttfts else None, statistics.median(percentile(t, 95) for t in ttfts) if ttfts else None,
            extras,
        )


def measure_serving(w: ServingWorkload, compare: str, over_http: bool, gguf: Path | None = None, threads: int = 1) -> dict[str, ServingFigures]:
    """over_http: the in-process continuous batch against serve.py, all at once and one at a time,
    and with gguf, llama-cpp-python's server on that file, with `threads` threads."""
    systems: dict[str, System] = {"engine_continuous": (load_engine_continuous, ())}
    if over_http:
        pool = pool_pages(w).n_blocks
        systems |= {"server_concurrent": (load_server, (pool, True)), "server_one_by_one": (load_server, (pool, False))}
        if gguf is not None:
            systems["llama_server"] = (load_llama_server, (gguf, threads))
    else:
        systems["engine_static"] = (load_engine_static, ())
        if compare == "transformers":
            systems["transformers"] = (load_transformers_batched, ())
    return {name: ServingFigures.of(run, extras) for name, (run, extras) in timed_in_turn(w, systems).items()}


def describe_serving(w: ServingWorkload, machine: Machine) -> str:
    lengths = [len(r.prompt) for r in w.requests]
    new = [r.max_new_tokens for r in w.requests]
    device = machine.accelerator or f"{machine.cpu}, {machine.cores} cores"
    policy = "" if not w.compression.enabled else f" | KV policy {w.compression.policy}, budget {w.compression.budget}"
    return "\n".join([
        f"machine: {device} | torch {machine.torch}, {machine.threads} threads",
        f"model: {w.checkpoint.name}, {dtype_name(w.dtype)} on {w.device}{', compiled decode step' if w.compile else ''}{policy}",
        f"workload: {len(w.requests)} prompts of {min(lengths)}-{max(lengths)} tokens ({w.prompt_tokens} in all), "
        f"{min(new)}-{max(new)} new tokens each ({w.new_tokens} in all), at most {w.max_batch} at once | "
        f"pool of {pool_pages(w).n_blocks} blocks of {w.pages.block_size} slots | median of {w.trials} trials",
    ])


def print_serving(w: ServingWorkload, machine: Machine, figures: dict[str, ServingFigures]) -> None:
    names = list(figures)
    rows = [
        ["throughput (new tok/s)", *(number(figures[n].tok_s) for n in names)],
        ["whole run (s)", *(number(figures[n].seconds) for n in names)],
        ["KV cache at its peak (MiB)", *(number(figures[n].kv_peak_mib) if figures[n].kv_peak_mib else "-" for n in names)],
        ["most prompts at once", *(str(figures[n].most_rows) for n in names)],
        ["process peak memory (MiB)", *(number(figures[n].peak_mem_mib) for n in names)],
    ]
    if "server_concurrent" in figures:
        rows += [
            ["time to first token, p50 (s)", *(number(figures[n].ttft_p50_s) if figures[n].ttft_p50_s is not None else "-" for n in names)],
            ["time to first token, p95 (s)", *(number(figures[n].ttft_p95_s) if figures[n].ttft_p95_s is not None else "-" for n in names)],
        ]
    print(describe_serving(w, machine), table(["", *names], rows), sep="\n\n")
    continuous = figures["engine_continuous"]
    for name in names[1:]:
        print(f"engine_continuous/{name}: throughput {continuous.tok_s / figures[name].tok_s:.2f}x")
    if "server_concurrent" in figures:
        print_server_checks(figures)
    print(flush=True)


def print_server_checks(figures: dict[str, ServingFigures]) -> None:
    """The server's throughput against one request at a time, its answers against them, and the run with faults."""
    together, alone = figures["server_concurrent"], figures["server_one_by_one"]
    print(f"server_concurrent/server_one_by_one: throughput {together.tok_s / alone.tok_s:.2f}x")
    same = sum(a == b for a, b in zip(together.extras["texts"], alone.extras["texts"]))
    counts = sum(a == b for a, b in zip(together.extras["tokens"], alone.extras["tokens"]))
    n = len(alone.extras["texts"])
    print(f"answers all at once against one at a time: {counts} of {n} with as many tokens, {same} of {n} identical text")
    f = together.extras["faults"]
    print(
        f"with faults: {f['bad_with_4xx_error_body']} of {f['bad_requests']} bad requests got a 4xx with an error body; {f['hung_up']} clients hung up "
        f"({f['cancelled']} requests cancelled); {f['answers_equal_clean_run']} of {f['answers']} answers equal the clean run's; "
        f"pool after the load: {f['free_blocks']} of {f['pool_blocks']} blocks free"
    )


def serving_json(w: ServingWorkload, machine: Machine, figures: dict[str, ServingFigures]) -> dict[str, Any]:
    return {
        "machine": asdict(machine),
        "config": {
            "checkpoint": str(w.checkpoint), "dtype": dtype_name(w.dtype), "device": str(w.device), "compile": w.compile,
            "max_batch": w.max_batch, "trials": w.trials, "block_size": w.pages.block_size, "pool_blocks": pool_pages(w).n_blocks,
            "prompt_lengths": [len(r.prompt) for r in w.requests], "new_tokens": [r.max_new_tokens for r in w.requests],
            "kv_policy": asdict(w.compression), "quant": w.quant,
        },
        **{name: asdict(f) for name, f in figures.items()},
    }
