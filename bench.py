"""Decode speed of the engine, side by side with transformers: same checkpoint, dtype, batch and prompt.

    python bench.py [--checkpoint DIR] [--dtype bfloat16] [--prompt-len 128] [--new-tokens 128]
                    [--quant none|int8|int4] [--ceiling] [--json OUT.json]
    python bench.py --sweep 128,512,1024,2048 [--plot bench_sweep.png]
    python bench.py --checkpoint DIR --quant int4 --compare llama.cpp --gguf FILE.gguf
    python bench.py --paged                      (the engine on its paged cache too, side by side)
    python bench.py --as-user [--trials 3]       (generate.py's default command in fresh processes, cold and warm, beside llama.cpp)
    python bench.py --profile [--checkpoint DIR] (where one decode step's time goes, compiled and eager)
    python bench.py --speculate [--new-tokens 256] (speculative decoding on code-copying and free-text prompts, beside llama.cpp's prompt lookup)
    python bench.py --workload 64 [--workload-prompt-len 32-1024] [--workload-new-tokens 64-512] [--max-batch 8]
    python bench.py --workload 32 --serve        (serve.py under that load over HTTP: all at once, one at a time)
    python bench.py --prefix-reuse [--turns 4] [--conversations 32]   (serve.py with and without its prefix cache)
    torchrun --nproc-per-node 2 bench.py --checkpoint DIR      (the engine split over 2 ranks; per-rank memory)

The prompt is --batch rows of --prompt-len random token ids (seeded, the same for every system).
No EOS stops a run: every run makes exactly --new-tokens tokens per row. Each system (the engine,
transformers, transformers with its static cache) runs in a process of its own; they take their
trials in turn, and each figure is the median over --trials runs that follow one warm-up run.

With --compare llama.cpp the other system is llama.cpp (llama-cpp-python) on the GGUF file the
checkpoint came from, batch 1; the default model's file is found by itself.

With --workload N the benchmark is a serving one instead (benchmark/serving.py): N prompts of
random lengths, each with its own number of new tokens, answered --max-batch at a time by
continuous batching on the paged cache, by static batching on the contiguous cache (same memory)
and by transformers' batched generate: aggregate tok/s, KV cache peak, most prompts at once.
With --serve, the continuous batch in-process against serve.py over HTTP, every request at once
and one at a time, with time to first token, and a run with bad requests and hang-ups among the
load (benchmark/load.py); with llama-cpp-python installed and the bundled model (or --compare
llama.cpp --gguf FILE), its server under the same load too.

Under torchrun (any --nproc-per-node, 1 included) the engine alone runs, split over the ranks
(benchmark/parallel.py): decode tok/s and TTFT, and each rank's KV heads, weights read per step,
KV cache and memory.

Reported per system: decode tok/s and ms/token, time to first token, prefill tok/s, achieved
GB/s and its share of the machine's bandwidth roofline (and, with --ceiling, of the decode
step's bare matrix products), peak and held memory, KV cache size, and the CPU other processes
took. The table goes to stdout, progress to stderr. How each figure is measured is told in
benchmark/: systems.py (TTFT, decode tok/s), memory.py (bytes per token, memory), machine.py
(the ceilings).
"""

import argparse
import importlib.util
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from benchmark.as_user import PROMPT, measure_as_user, print_as_user
from benchmark.machine import Machine, bandwidth_roofline, describe_machine
from benchmark.parallel import measure_ranks, print_ranks, ranks_json
from benchmark.memory import gguf_traffic
from benchmark.report import Report, figures, print_report
from benchmark.prefix_reuse import add_prefix_reuse_args, run_prefix_reuse
from benchmark.step_profile import run_profile
from benchmark.serving import measure_serving, print_serving, random_requests, serving_json
from benchmark.sweep import plot_sweep, print_sweep
from benchmark.systems import load_engine, load_llama_cpp, load_transformers
from benchmark.workers import System, timed_in_turn
from benchmark.workload import ServingWorkload, Workload, progress, span
from cli import DTYPE_HELP, DTYPES, add_compression_args, add_paging_args, add_parallel_args, add_quant_args, checkpoint_and_quant, compression_config, pick_device, pick_dtype
from cli_features import attention_line, page_config, ranks_running, start_ranks
from kv.paged import PageConfig
from errors import UserError, run_command
from models.config import ModelConfig
from models.parallel import kv_head_place
from weights.forms import load_model
from weights.loader import read_config, stored_quantized
from weights.tokenizer import Tokenizer

PROMPT_SEED = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="model folder or hub repo id already downloaded; default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    p.add_argument("--prompt-len", type=int, help="random prompt tokens per row (default 128)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row, the first one by prefill")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help=DTYPE_HELP)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--trials", type=int, default=5, help="timed runs per system, after one warm-up run; figures are their medians")
    p.add_argument(
        "--compile", action=argparse.BooleanOptionalAction,
        help="torch.compile the engine's decode step; the warm-up run compiles it (default: on CPU, where it removes much of "
        "the per-op overhead; off on CUDA, where the CUDA graph removes it)",
    )
    p.add_argument(
        "--compare", choices=["transformers", "llama.cpp", "none"],
        help="also measure transformers or llama.cpp (default: llama.cpp for the bundled model at batch 1 when llama-cpp-python is installed, else transformers when it is)",
    )
    p.add_argument("--gguf", type=Path, help="--compare llama.cpp: the GGUF file it runs (default: the bundled SmolLM2's, with the default checkpoint)")
    p.add_argument("--ceiling", action="store_true", help="also time the bare matrix products of a decode step, for the table's bare-matmul ceiling share (%%)")
    p.add_argument("--json", type=Path, metavar="OUT", help="write every figure to this JSON file")
    p.add_argument("--sweep", metavar="LENGTHS", help="comma-separated prompt lengths, e.g. 128,512,1024,2048: one benchmark each, and a plot")
    p.add_argument("--plot", type=Path, metavar="OUT.png", help="where --sweep draws decode tok/s against prompt length (default bench_sweep.png)")
    p.add_argument("--seed", type=int, default=0, help="for the random KV policy")
    p.add_argument(
        "--as-user", action="store_true",
        help="time generate.py's default command on the bundled model as a user runs it: fresh processes, wall time from start to exit, "
        "a cold and a warm compile cache and eager, beside llama.cpp on the same GGUF file when llama-cpp-python is installed (benchmark/as_user.py)",
    )
    p.add_argument("--profile", action="store_true", help="where one decode step's time goes, by kind of op, compiled and eager (benchmark/step_profile.py)")
    s = p.add_argument_group("speculative decoding (benchmark/speculation.py)")
    s.add_argument("--speculate", action="store_true", help="prompt lookup against plain decoding, and llama.cpp's with and without its own, on HumanEval chat prompts")
    s.add_argument("--speculate-prompts", type=int, default=3, metavar="N", help="--speculate: prompts of each kind (HumanEval problems 0..N-1)")
    s.add_argument("--draft-tokens", type=int, default=8, help="--speculate: the most drafts one pass verifies, in both systems")
    add_prefix_reuse_args(p)
    w = p.add_argument_group("serving workload")
    w.add_argument("--workload", type=int, metavar="N", help="a serving benchmark of N prompts instead (see above)")
    w.add_argument("--workload-prompt-len", default="32-1024", metavar="MIN-MAX", help="--workload: prompt lengths, drawn uniformly")
    w.add_argument("--workload-new-tokens", default="64-512", metavar="MIN-MAX", help="--workload: new tokens per prompt, drawn uniformly")
    w.add_argument("--max-batch", type=int, default=8, help="--workload: prompts decoded at once, in every system")
    w.add_argument("--serve", action="store_true", help="--workload: serve.py over HTTP beside the in-process continuous batch (see above)")
    add_quant_args(p)
    add_compression_args(p)
    add_paging_args(p, "also measure the engine on its paged cache (engine_paged), beside the contiguous one")
    add_parallel_args(p)
    return p.parse_args(argv)


def positive(name: str, value: int, minimum: int = 1) -> int:
    if value < minimum:
        raise UserError(f"{name} must be >= {minimum}, got {value}")
    return value


def prompt_lengths(args: argparse.Namespace) -> list[int]:
    if args.sweep is None:
        if args.plot is not None:
            raise UserError("--plot draws the result of --sweep; add --sweep LENGTHS or drop --plot")
        return [positive("--prompt-len", 128 if args.prompt_len is None else args.prompt_len)]
    if args.prompt_len is not None:
        raise UserError("--sweep sets the prompt lengths; drop --prompt-len")
    try:
        lengths = sorted({int(item) for item in args.sweep.split(",")})
    except ValueError:
        raise UserError(f"--sweep takes comma-separated prompt lengths like 128,512,1024, got {args.sweep!r}") from None
    for length in lengths:
        positive("every --sweep length", length)
    if importlib.util.find_spec("matplotlib") is None:
        raise UserError("--sweep draws its plot with matplotlib, which is not installed: pip install matplotlib")
    return lengths


def compared_system(args: argparse.Namespace, batch: int) -> str:
    """What the engine is compared with: transformers, llama.cpp or none."""
    if args.compare != "llama.cpp" and args.gguf is not None:
        raise UserError("--gguf is the file of --compare llama.cpp; add --compare llama.cpp or drop --gguf")
    if args.compare == "llama.cpp":
        if importlib.util.find_spec("llama_cpp") is None:
            raise UserError(
                "--compare llama.cpp needs llama-cpp-python, which is not installed: "
                'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python (it compiles llama.cpp, minutes), or --compare none'
            )
        if batch != 1:
            raise UserError("--compare llama.cpp measures batch 1 only; drop --batch")
        return "llama.cpp"
    if args.compare is None and args.checkpoint is None and batch == 1 and importlib.util.find_spec("llama_cpp") is not None:
        return "llama.cpp"  # the bundled model runs its GGUF file's own blocks: llama.cpp is the system to beat on that file
    installed = importlib.util.find_spec("transformers") is not None
    if args.compare == "transformers" and not installed:
        raise UserError("--compare transformers needs transformers, which is not installed: pip install transformers (or --compare none)")
    return ("transformers" if installed else "none") if args.compare is None else args.compare


def gguf_file(args: argparse.Namespace, compare: str) -> Path | None:
    """The GGUF file llama.cpp runs: --gguf, or the bundled SmolLM2's when the checkpoint is the default."""
    if compare != "llama.cpp":
        return None
    if args.gguf is None and args.checkpoint is not None:
        raise UserError("--compare llama.cpp runs a GGUF file: pass it with --gguf (python -m weights.packaged smollm2|qwen-coder --gguf prints the packaged ones)")
    if args.gguf is None:
        from weights.packaged import smollm2_gguf

        return smollm2_gguf()
    if not args.gguf.is_file():
        raise UserError(f"--gguf {args.gguf}: no such file")
    return args.gguf


def random_prompts(vocab_size: int, batch: int, length: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(vocab_size, (batch, length), generator=generator).tolist()


def peer_checkpoint(args: argparse.Namespace, checkpoint: Path, compare: str) -> Path | None:
    """The float checkpoint transformers runs when the engine runs one saved quantized, which only
    the engine reads: the bundled model's float copy. None: the engine's own."""
    if compare != "transformers" or not stored_quantized(checkpoint):
        return None
    if args.checkpoint is not None:
        raise UserError(f"{checkpoint} is saved quantized, which transformers cannot load; use --compare llama.cpp (with --gguf) or none")
    return checkpoint_and_quant(None, "none", args.group_size)[0]


def measure(w: Workload, model_type: str, machine: Machine, compare: str, pages: PageConfig | None) -> Report:
    """One benchmark point: every system on one workload."""
    systems: dict[str, System] = {"engine": (load_engine, ())}
    if pages is not None:
        systems["engine_paged"] = (load_engine, (pages,))
    if compare == "transformers":
        systems["transformers"] = (load_transformers, (False,))
        systems["transformers_static"] = (load_transformers, (True,))
    if compare == "llama.cpp":
        systems["llama.cpp"] = (load_llama_cpp, ())
    runs = timed_in_turn(w, systems)
    _, engine = runs["engine"]
    figures_by_system = {}
    for name, (run, _) in runs.items():
        # llama.cpp reads its GGUF file's weights, not the engine's; its figures use its own bytes.
        traffic = gguf_traffic(w.gguf, engine.traffic) if name == "llama.cpp" else engine.traffic
        matmul = engine.matmul_ceiling_tok_s if name != "llama.cpp" else None
        figures_by_system[name] = figures(run, w, traffic, bandwidth_roofline(machine, traffic), matmul)
    return Report(w, model_type, machine, engine.traffic, engine.matmul_ceiling_tok_s, figures_by_system, engine.compression)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command(lambda: run(args))


def run(args: argparse.Namespace) -> None:
    if "WORLD_SIZE" in os.environ:  # started by torchrun
        run_ranks(args)
        return
    if args.serve and args.workload is None:
        raise UserError("--serve puts serve.py under the load of --workload N; add --workload 32, say")
    if args.workload is not None:
        run_workload(args)
        return
    if args.as_user:
        run_as_user(args)
        return
    if args.speculate:
        run_speculation(args)
        return
    if args.profile:
        run_profile(args, lambda vocab_size: random_prompts(vocab_size, 1, args.prompt_len or 128)[0])
        return
    if args.prefix_reuse:
        run_prefix_reuse(args)
        return
    batch = positive("--batch", args.batch)
    trials = positive("--trials", args.trials)
    new_tokens = positive("--new-tokens", args.new_tokens, minimum=2)  # the first new token comes from prefill
    lengths = prompt_lengths(args)
    compare = compared_system(args, batch)
    plot = args.plot or Path("bench_sweep.png")
    for out in (args.json, plot):
        if out is not None and not out.parent.is_dir():
            raise UserError(f"cannot write {out}: folder {out.parent} does not exist")
    device = pick_device(args.device)
    checkpoint, quant = checkpoint_and_quant(args.checkpoint, args.quant, args.group_size)
    gguf = gguf_file(args, compare)
    config = read_config(checkpoint)
    dtype = pick_dtype(args.dtype, checkpoint, device, quant, rows=batch)
    if lengths[-1] + new_tokens > config.max_position_embeddings:
        raise UserError(
            f"prompt of {lengths[-1]} + {new_tokens} new tokens exceeds the model's {config.max_position_embeddings} positions; "
            "use a shorter prompt or fewer --new-tokens"
        )

    compile_step = device.type == "cpu" if args.compile is None else args.compile
    pages = page_config(args, device, args.paged)
    say_attention(device, dtype, config, args, pages)
    machine = describe_machine(device)
    reports = []
    for length in lengths:
        prompts = random_prompts(config.vocab_size, batch, length)
        w = Workload(
            checkpoint, dtype, device, prompts, new_tokens, trials, compile_step, args.ceiling, compression_config(args), quant, args.group_size, gguf,
            peer_checkpoint=peer_checkpoint(args, checkpoint, compare), kv_dtype=args.kv_dtype,
        )
        reports.append(measure(w, config.model_type, machine, compare, pages))
        print_report(reports[-1])
    if args.sweep is not None:
        print_sweep(reports)
        plot_sweep(reports, plot)
    if args.json is not None:
        data = reports[0].to_json() if args.sweep is None else {"sweep": [r.to_json() for r in reports], "plot": str(plot)}
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        progress(f"wrote {args.json}")


def say_attention(device: torch.device, dtype: torch.dtype, config: ModelConfig, args: argparse.Namespace, pages: PageConfig | None) -> None:
    line = attention_line(device, dtype, config, args.kv_dtype, pages, args.kv_store)
    if line is not None:
        progress(line)


def run_as_user(args: argparse.Namespace) -> None:
    if args.checkpoint is not None or args.sweep is not None or args.batch != 1 or args.compare not in (None, "llama.cpp"):
        raise UserError("--as-user times the bundled model's default command beside llama.cpp; drop --checkpoint, --sweep, --batch and --compare")
    from weights.packaged import smollm2_checkpoint, smollm2_gguf

    trials = positive("--trials", args.trials)
    new_tokens = positive("--new-tokens", args.new_tokens, minimum=2)
    gguf = smollm2_gguf() if importlib.util.find_spec("llama_cpp") is not None else None
    if gguf is None:
        progress("llama-cpp-python is not installed: the engine's runs alone")
    prompt = Tokenizer.from_dir(smollm2_checkpoint(quantized=True)).encode_chat([{"role": "user", "content": PROMPT}])
    runs = measure_as_user(gguf, prompt, new_tokens, trials, torch.get_num_threads())
    print_as_user(runs, describe_machine(torch.device("cpu")), new_tokens, trials)


def run_speculation(args: argparse.Namespace) -> None:
    from benchmark.speculation import measure_speculation

    n_prompts = positive("--speculate-prompts", args.speculate_prompts)
    if n_prompts > 100:
        raise UserError("--speculate-prompts: the benchmark uses HumanEval problems 0-99 only; give at most 100")
    device = pick_device(args.device)
    checkpoint, quant = checkpoint_and_quant(args.checkpoint, args.quant, args.group_size)
    gguf = gguf_file(args, "llama.cpp") if importlib.util.find_spec("llama_cpp") is not None else None
    if gguf is None:
        progress("llama-cpp-python is not installed: the engine's runs alone")
    model = load_model(checkpoint, pick_dtype(args.dtype, checkpoint, device, quant), device, quant, args.group_size)
    compile_step = device.type == "cpu" if args.compile is None else args.compile
    new_tokens, max_draft = positive("--new-tokens", args.new_tokens, minimum=2), positive("--draft-tokens", args.draft_tokens)
    measure_speculation(model, checkpoint, gguf, n_prompts, new_tokens, max_draft, compile_step)


def run_workload(args: argparse.Namespace) -> None:
    n = positive("--workload", args.workload)
    prompt_lens = span("--workload-prompt-len", args.workload_prompt_len)
    new_tokens = span("--workload-new-tokens", args.workload_new_tokens)
    max_batch = positive("--max-batch", args.max_batch)
    trials = positive("--trials", args.trials)
    if (args.compare == "llama.cpp" and not args.serve) or args.sweep is not None or args.prompt_len is not None or args.batch != 1:
        raise UserError(
            "--workload draws its own prompts and compares with transformers (llama.cpp's server with --serve); "
            "drop --sweep, --prompt-len, --batch, or --compare llama.cpp without --serve"
        )
    compare = compared_system(args, 1)
    gguf = gguf_file(args, compare) if compare == "llama.cpp" else None  # installed: compared_system says so
    if args.json is not None and not args.json.parent.is_dir():
        raise UserError(f"cannot write {args.json}: folder {args.json.parent} does not exist")
    device = pick_device(args.device)
    checkpoint, quant = checkpoint_and_quant(args.checkpoint, args.quant, args.group_size)
    config = read_config(checkpoint)
    if prompt_lens[1] + new_tokens[1] > config.max_position_embeddings:
        raise UserError(f"prompts of up to {prompt_lens[1]} + {new_tokens[1]} new tokens exceed the model's {config.max_position_embeddings} positions")
    dtype = pick_dtype(args.dtype, checkpoint, device, quant, rows=min(n, max_batch))
    requests = random_requests(config.vocab_size, n, prompt_lens, new_tokens, PROMPT_SEED)
    compile_step = device.type == "cpu" if args.compile is None else args.compile
    pages = page_config(args, device, True)
    say_attention(device, dtype, config, args, pages)
    w = ServingWorkload(
        checkpoint, dtype, device, requests, max_batch, trials, compile_step, compression_config(args), pages, quant, args.group_size,
        peer_checkpoint=peer_checkpoint(args, checkpoint, compare), kv_dtype=args.kv_dtype,
    )
    machine = describe_machine(device)
    figures_by_system = measure_serving(w, compare, args.serve, gguf, torch.get_num_threads())
    print_serving(w, machine, figures_by_system)
    if args.json is not None:
        args.json.write_text(json.dumps(serving_json(w, machine, figures_by_system), indent=2) + "\n")
        progress(f"wrote {args.json}")


def run_ranks(args: argparse.Namespace) -> None:
    """Under torchrun: the engine alone, split over the ranks; rank 0 prints each rank's figures."""
    if args.workload is not None or args.sweep is not None or args.paged or args.ceiling or args.compare not in (None, "none"):
        raise UserError("under torchrun bench.py measures the engine alone, split over the ranks; drop --workload, --sweep, --paged, --ceiling and --compare")
    batch = positive("--batch", args.batch)
    trials = positive("--trials", args.trials)
    new_tokens = positive("--new-tokens", args.new_tokens, minimum=2)
    length = prompt_lengths(args)[0]
    if args.json is not None and not args.json.parent.is_dir():
        raise UserError(f"cannot write {args.json}: folder {args.json.parent} does not exist")
    tp, device = start_ranks(args, pick_device(args.device))
    with ranks_running(tp):
        checkpoint, quant = checkpoint_and_quant(args.checkpoint, args.quant, args.group_size)
        config = read_config(checkpoint)
        if length + new_tokens > config.max_position_embeddings:
            raise UserError(f"prompt of {length} + {new_tokens} new tokens exceeds the model's {config.max_position_embeddings} positions")
        dtype = pick_dtype(args.dtype, checkpoint, device, quant, rows=batch)
        compile_step = device.type == "cpu" if args.compile is None else args.compile
        prompts = random_prompts(config.vocab_size, batch, length)
        compression = replace(compression_config(args), kv_heads=kv_head_place(config, tp))
        w = Workload(checkpoint, dtype, device, prompts, new_tokens, trials, compile_step, False, compression, quant, args.group_size, parallel=tp,
                     kv_dtype=args.kv_dtype)
        ranks = measure_ranks(w)
        if ranks is not None:
            print_ranks(w, ranks, torch.get_num_threads())
            if args.json is not None:
                ranks_json(ranks, args.json)


if __name__ == "__main__":
    sys.exit(main())
