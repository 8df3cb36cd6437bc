"""Run a Llama / Mistral / Qwen checkpoint on a prompt and stream the answer.

    python generate.py --checkpoint DIR --prompt "Why is the sky blue?"
    python generate.py --checkpoint DIR -i          (a chat: /reset starts over, /exit leaves)
    python generate.py --checkpoint DIR --prompt-file PROMPTS.txt --max-batch 8
                                                    (continuous batching: 8 rows at a time)
    python generate.py --checkpoint DIR --speculate ngram --prompt "Rewrite this code: ..."
                                                    (speculative decoding: the same answer, faster where it copies its input)
    torchrun --nproc-per-node 2 generate.py --checkpoint DIR --prompt "..."
                                                    (tensor parallelism: the model split over 2 processes)

Only the generated text goes to stdout; the one-line summary goes to stderr.

Sampling follows the checkpoint's generation_config.json as transformers does (greedy unless it
sets do_sample); a checkpoint that sets none of it (the bundled default model) samples as
llama-cli does: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, seeded (--seed), so a run is
reproducible. Each sampling flag overrides its value; --temperature 0 is greedy.
"""

import argparse
import sys
from pathlib import Path

import torch

from cli import (
    COMPILE_FROM_TOKENS, DTYPE_HELP, DTYPES, SAMPLING_FIELDS, SAVED_STEP_FROM_TOKENS, AnswerText, CompileNotice, add_compression_args, add_paging_args, add_parallel_args,
    add_quant_args, answer_eos, checkpoint_and_quant, compile_pays, compression_config, launched_ranks, pick_device, pick_dtype, sampling_with,
)
from engine.generation import Eager, GenerationResult, Runner, generate
from engine.sampling import SamplingConfig
from errors import UserError, run_command
from weights.generation_config import sampling_defaults
from weights.loader import load_model, stored_quantized
from weights.tokenizer import Tokenizer

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", nargs="?", help="the prompt (same as --prompt)")
    p.add_argument("--checkpoint", help="model folder (config.json, safetensors, tokenizer.json) or a hub repo id already downloaded; default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--prompt", help="the prompt; without it and without --prompt-file the prompt is read from stdin")
    p.add_argument("--prompt-file", type=Path, help="a file with one prompt per line; the lines run as one batch, or --max-batch at a time")
    p.add_argument(
        "--max-batch", type=int,
        help="--prompt-file: continuous batching on the paged cache, at most this many prompts at once; a finished one leaves, "
        "the next one joins between decode steps (default: all the lines as one static batch)",
    )
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None, help="wrap the prompt in the checkpoint's chat template (default: when it has one)")
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("-i", "--interactive", action="store_true", help="chat: read one message per line from stdin; each turn prefills only what it adds")
    p.add_argument("--context", type=int, help="--interactive: cache slots for the whole conversation (default: the model's limit, at most 4096)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per answer")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token: exactly --max-new-tokens per answer (for timing runs)")
    g = p.add_argument_group("sampling (defaults: the checkpoint's generation_config.json, else llama-cli's; see above)")
    g.add_argument("--temperature", type=float, help="0 is greedy decoding")
    g.add_argument("--top-k", type=int, help="sample from the k most likely tokens only (0: off)")
    g.add_argument("--top-p", type=float, help="sample from the smallest set holding this probability mass (1: off)")
    g.add_argument("--min-p", type=float, help="drop tokens less likely than this fraction of the most likely one (0: off)")
    g.add_argument("--repetition-penalty", type=float, help="divide the logits of tokens already in the prompt or answer by this (1: off)")
    g.add_argument("--stop", action="append", default=[], metavar="STRING", help="end the answer before this text (repeatable)")
    g.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help=DTYPE_HELP)
    p.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=None,
        help="torch.compile the decode step, a group of transformer blocks compiled once and reused by every group of layers "
        f"(default: on CPU, for a chat or a run of {SAVED_STEP_FROM_TOKENS} tokens or more, prompts x --max-new-tokens, "
        f"{COMPILE_FROM_TOKENS} with a KV policy or a quantized or paged cache; the first run on a machine compiles, "
        "later ones load the saved step, under a second, or torch.compile's from inductor's cache, about 2.5 s; --no-compile: eager)",
    )
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None, help="capture the decode step as a CUDA graph and replay it (default: on with CUDA)")
    add_quant_args(p)
    add_compression_args(p)
    add_paging_args(p, "hold the KV cache in blocks, each prompt only the blocks it uses (--max-batch always does)")
    add_parallel_args(p)
    g = p.add_argument_group("speculative decoding (one prompt; the answer is unchanged, only faster)")
    g.add_argument(
        "--speculate", metavar="ngram|draft:DIR",
        help="guess the next tokens and check several in one forward pass: ngram looks them up in the prompt and the answer so far, "
        "draft:DIR asks a smaller model that has this checkpoint's tokenizer",
    )
    g.add_argument("--draft-tokens", type=int, default=8, help="--speculate: the most guesses one pass checks (each round checks as many as its measured cost pays for)")
    args = p.parse_args(argv)
    if args.text is not None and args.prompt is not None:
        p.error("give the prompt either as an argument or with --prompt, not both")
    args.prompt = args.prompt if args.prompt is not None else args.text
    if args.prompt is not None and args.prompt_file is not None:
        p.error("--prompt and --prompt-file are exclusive")
    if args.interactive and (args.prompt is not None or args.prompt_file is not None):
        p.error("--interactive reads its messages from stdin; drop the prompt or --prompt-file")
    if args.max_batch is not None and args.prompt_file is None:
        p.error("--max-batch runs the prompts of --prompt-file a few at a time; add --prompt-file")
    if args.ignore_eos and args.interactive:
        p.error("--ignore-eos would never end a chat answer; drop it with --interactive")
    if args.context is not None and not args.interactive:
        p.error("--context sizes an --interactive chat's cache; a one-shot run sizes it from the prompt")
    if any(not stop for stop in args.stop):
        p.error("--stop needs a non-empty string")
    if args.speculate is not None and args.speculate != "ngram" and not args.speculate.startswith("draft:"):
        p.error(f"--speculate takes ngram or draft:DIR, got {args.speculate!r}")
    if args.speculate is not None and (args.interactive or args.prompt_file is not None):
        p.error("--speculate runs one prompt; drop --interactive or --prompt-file")
    if args.draft_tokens < 1:
        p.error(f"--draft-tokens must be >= 1, got {args.draft_tokens}")
    return args


def sampling_config(args: argparse.Namespace, checkpoint_defaults: dict[str, float | int] | None) -> SamplingConfig:
    """Each flag given wins; the rest come from the checkpoint, else from llama-cli."""
    return sampling_with({name: getattr(args, name) for name in SAMPLING_FIELDS}, checkpoint_defaults)


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt_file is not None:
        if not args.prompt_file.is_file():
            raise UserError(f"--prompt-file {args.prompt_file} does not exist")
        prompts = [line for line in args.prompt_file.read_text().splitlines() if line.strip()]
        if not prompts:
            raise UserError(f"--prompt-file {args.prompt_file} has no non-empty line")
        return prompts
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise UserError("the prompt is empty; pass it as an argument, with --prompt, --prompt-file or on stdin")
    return [prompt]


def encode_prompts(tokenizer: Tokenizer, prompts: list[str], chat: bool | None, system: str | None) -> list[list[int]]:
    if chat is None:
        chat = tokenizer.has_chat_template
    if chat and not tokenizer.has_chat_template:
        raise UserError("--chat was requested but the checkpoint has no chat template; use --no-chat")
    if not chat:
        if system is not None:
            raise UserError("--system needs the chat template; drop --no-chat or --system")
        return [tokenizer.encode(p) for p in prompts]
    head = [{"role": "system", "content": system}] if system is not None else []
    return [tokenizer.encode_chat(head + [{"role": "user", "content": p}]) for p in prompts]


def summary(result: GenerationResult, cuda_graph: bool) -> str:
    prefill_rate = result.prompt_tokens / result.prefill_s if result.prefill_s else 0.0
    return (
        f"prompt tokens: {result.prompt_tokens} | new tokens: {result.new_tokens} | "
        f"prefill: {prefill_rate:.1f} tok/s | decode: {result.decode_tok_s:.1f} tok/s | "
        + (f"{'graph capture' if cuda_graph else 'compile'}: {result.setup_s:.1f} s | " if result.setup_s else "")
        + f"KV cache: {result.kv_cache_bytes / 2**20:.1f} MiB"
        + (f" ({result.kv_peak_bytes / 2**20:.1f} MiB held at most)" if result.kv_peak_bytes < result.kv_cache_bytes else "")
        + (f" | compactions: {result.compression.compactions}" if result.compression is not None else "")
        + (f" | {result.speculation}" if result.speculation is not None else "")
    )


def rows_at_once(args: argparse.Namespace, prompts: list[list[int]] | None) -> int:
    """How many sequences one decode step carries: one in a chat, else the batch of prompts, or with
    --max-batch at most that many of them."""
    if prompts is None:
        return 1
    return len(prompts) if args.max_batch is None else min(len(prompts), args.max_batch)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command(lambda: run(args))


def run(args: argparse.Namespace) -> None:
    compression_config(args)  # a bad KV-policy option fails before anything loads
    if launched_ranks() == 1:
        run_on(args, None, pick_device(args.device))
        return
    from cli_features import ranks_running, start_ranks  # tensor parallelism, under torchrun only

    if args.speculate is not None:
        raise UserError("--speculate runs on one process; drop it or run without torchrun")
    if args.interactive:
        raise UserError("--interactive reads stdin on one process; under torchrun give --prompt or --prompt-file")
    tp, device = start_ranks(args, pick_device(args.device))
    with ranks_running(tp):
        run_on(args, tp, device)


def plain_cache(args: argparse.Namespace) -> bool:
    """Whether the run keeps the plain cache: no KV policy or store, the model's dtype for the
    keys and values (--kv-dtype auto), no paged cache, no continuous batch."""
    asked = compression_config(args).enabled or args.kv_store or args.kv_dtype != "auto" or args.paged or args.max_batch is not None
    return not (asked or args.block_size is not None or args.kv_blocks is not None)


def run_on(args: argparse.Namespace, tp, device: torch.device) -> None:
    """The run on this process: the whole model, or under torchrun this rank's part of it (only rank 0 prints)."""
    checkpoint, quant = checkpoint_and_quant(args.checkpoint, args.quant, args.group_size)
    sampling = sampling_config(args, sampling_defaults(checkpoint))
    tokenizer = Tokenizer.from_dir(checkpoint)
    prompts = None
    if not args.interactive:  # rank 0 reads them (stdin reaches one process), every rank encodes them
        texts = read_prompts(args) if tp is None or tp.rank == 0 else None
        if tp is not None:
            from models.parallel import from_rank0

            texts = from_rank0(texts, tp)
        prompts = encode_prompts(tokenizer, texts, args.chat, args.system)
    dtype = pick_dtype(args.dtype, checkpoint, device, quant, rows=rows_at_once(args, prompts))
    if tp is not None:
        from weights.sharding import load_rank

        model = load_rank(checkpoint, dtype, device, tp, quant)
    elif quant != "none" or stored_quantized(checkpoint):
        from weights.quantized_loading import load_quantized

        model = load_quantized(checkpoint, dtype, device, quant, args.group_size)
    else:
        model = load_model(checkpoint, dtype, device)
    saved = tp is None and device.type == "cpu" and plain_cache(args)  # the saved step serves it
    if args.compile is None:
        args.compile = compile_pays(device, None if prompts is None else len(prompts) * args.max_new_tokens, saved)
    torch.manual_seed(args.seed)  # every rank samples the same tokens from the same logits: no broadcast per step
    cuda_graph = device.type == "cuda" if args.cuda_graph is None else args.cuda_graph
    plain = saved and prompts is not None and args.speculate is None and not cuda_graph
    with torch.inference_mode():
        runner, compiles = Eager(), bool(args.compile)
        if args.compile and saved:  # the plain cache's compiled step: built once per machine, then loaded
            from engine.saved_step import Saved, saved_already

            runner, compiles = Saved(), not saved_already(model, 1 if prompts is None else len(prompts))
            if args.speculate is not None:
                from engine.speculative import verify_saved_already

                compiles = compiles or not verify_saved_already(model, args.draft_tokens)
        notice = CompileNotice(compiles)
        if plain:
            answer(args, model, tokenizer, prompts, sampling, None, runner, notice)
            return
        from cli_features import answer_continuously, chat, feature_options  # the features, only when asked for

        options = feature_options(args, checkpoint, model, tp, dtype, cuda_graph)
        if prompts is None:
            chat(args, model, tokenizer, sampling, options, notice)
        elif args.max_batch is not None:
            answer_continuously(args, model, tokenizer, prompts, sampling, options)
        else:
            answer(args, model, tokenizer, prompts, sampling, options, None, notice)


def answer(args, model, tokenizer: Tokenizer, prompts: list[list[int]], sampling: SamplingConfig, options, runner: Runner | None, notice: CompileNotice) -> None:
    """One run over a batch of prompts: a single answer streams, a batch prints once complete.
    options: the run's features (engine.options.RunOptions), or None for the plain engine, whose
    step runs as the runner says."""
    texts = [AnswerText(tokenizer, args.stop) for _ in prompts]
    streaming = len(prompts) == 1

    def on_tokens(news: dict[int, int | None]) -> list[int]:
        notice()
        for row, token in news.items():
            if token is not None:
                piece = texts[row].push(token)
                if streaming:
                    print(piece, end="", flush=True)
        return [row for row in news if texts[row].stopped]

    if options is None:
        result = generate(model, prompts, args.max_new_tokens, eos_ids=answer_eos(args, tokenizer), sampling=sampling, on_tokens=on_tokens, runner=runner)
    else:
        from engine import options as features

        result = features.generate(model, prompts, args.max_new_tokens, eos_ids=answer_eos(args, tokenizer), sampling=sampling, on_tokens=on_tokens, options=options)
    endings = [text.flush() for text in texts]
    if streaming:
        print(endings[0], flush=True)  # all of the answer before the summary, when both go to a terminal
    else:
        # A batch is printed once it is complete, answers in prompt order, a blank line apart.
        print("\n\n".join(text.text for text in texts), flush=True)
    print(summary(result, options is not None and options.cuda_graph), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
