"""Run a Llama / Mistral / Qwen checkpoint on a prompt and stream the answer.

    python generate.py --checkpoint DIR --prompt "Why is the sky blue?"
    python generate.py --checkpoint DIR -i          (a chat: /reset starts over, /exit leaves)
    python generate.py --checkpoint DIR --prompt-file PROMPTS.txt --max-batch 8
                                                    (continuous batching: 8 rows at a time)
    torchrun --nproc-per-node 2 generate.py --checkpoint DIR --prompt "..."
                                                    (tensor parallelism: the model split over 2 processes)

Only the generated text goes to stdout; the one-line summary goes to stderr.

Sampling follows the checkpoint's generation_config.json as transformers does (greedy unless it
sets do_sample); a checkpoint that sets none of it (the bundled default model) samples as
llama-cli does: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, seeded (--seed), so a run is
reproducible. Each sampling flag overrides its value; --temperature 0 is greedy.
"""

COMPILE_NOTICE = "compiling the decode step (a group of transformer blocks, reused by every group of layers); --no-compile runs eager"

import argparse
import signal
import sys
from dataclasses import replace
from pathlib import Path

import torch

from cli import (
    SAMPLING_FIELDS, AnswerText, attention_line, sampling_with, COMPILE_FROM_TOKENS, DTYPE_HELP, DTYPES, add_compression_args, add_paging_args, add_parallel_args, add_quant_args, checkpoint_and_quant,
    compile_pays, compression_config, page_config, pick_device, pick_dtype, ranks_running, start_ranks,
)
from compression.config import CompressionConfig
from engine.chat import Conversation
from engine.generation import GenerationResult, Session, generate
from engine.paged_cache import PageConfig
from engine.sampling import SamplingConfig
from engine.scheduler import BatchRun, Request, serve
from errors import UserError, run_command
from models.parallel import TensorParallel, from_rank0, kv_head_place, launched_ranks
from weights.generation_config import sampling_defaults
from weights.loader import load_model, read_config
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
        f"(default: on CPU, for a chat or a run of {COMPILE_FROM_TOKENS} tokens or more, prompts x --max-new-tokens: "
        "the first run compiles, about 13 s, later ones load it from inductor's on-disk cache, about 2.5 s; --no-compile: eager)",
    )
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None, help="capture the decode step as a CUDA graph and replay it (default: on with CUDA)")
    add_quant_args(p)
    add_compression_args(p)
    add_paging_args(p, "hold the KV cache in blocks, each prompt only the blocks it uses (--max-batch always does)")
    add_parallel_args(p)
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
    )


def rows_at_once(args: argparse.Namespace, prompts: list[list[int]] | None) -> int:
    """How many sequences one decode step carries: one in a chat, else the batch of prompts, or with
    --max-batch at most that many of them."""
    if prompts is None:
        return 1
    return len(prompts) if args.max_batch is None else min(len(prompts), args.max_batch)


class CompileNotice:
    """Says once on stderr, just before the first decode step, that the step is being compiled
    (after every check of the input has passed, so a bad request stays one line of error)."""

    def __init__(self, compiling: bool):
        self.pending = compiling

    def __call__(self) -> None:
        if self.pending:
            print(COMPILE_NOTICE, file=sys.stderr, flush=True)
            self.pending = False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command(lambda: run(args))


def run(args: argparse.Namespace) -> None:
    compression = compression_config(args)
    if args.interactive and launched_ranks() > 1:
        raise UserError("--interactive reads stdin on one process; under torchrun give --prompt or --prompt-file")
    tp, device = start_ranks(args, pick_device(args.device))
    with ranks_running(tp):
        run_on(args, tp, device, compression)


def run_on(args: argparse.Namespace, tp: TensorParallel | None, device: torch.device, compression: CompressionConfig) -> None:
    """The run on this process: the whole model, or under torchrun this rank's part of it (only rank 0 prints)."""
    checkpoint, quant = checkpoint_and_quant(args.checkpoint, args.quant, args.group_size)
    compression = replace(compression, kv_heads=kv_head_place(read_config(checkpoint), tp))
    sampling = sampling_config(args, sampling_defaults(checkpoint))
    tokenizer = Tokenizer.from_dir(checkpoint)
    prompts = None
    if not args.interactive:  # rank 0 reads them (stdin reaches one process), every rank encodes them
        texts = from_rank0(read_prompts(args) if tp is None or tp.rank == 0 else None, tp)
        prompts = encode_prompts(tokenizer, texts, args.chat, args.system)
    dtype = pick_dtype(args.dtype, checkpoint, device, quant, rows=rows_at_once(args, prompts))
    model = load_model(checkpoint, dtype, device, quant, args.group_size, tp)
    if args.compile is None:
        args.compile = compile_pays(device, None if prompts is None else len(prompts) * args.max_new_tokens)
    torch.manual_seed(args.seed)  # every rank samples the same tokens from the same logits: no broadcast per step
    cuda_graph = device.type == "cuda" if args.cuda_graph is None else args.cuda_graph
    pages = page_config(args, device, args.paged or args.max_batch is not None)
    attention = attention_line(device, dtype, model.config, args.kv_dtype, pages, args.kv_store)
    if attention is not None:
        print(attention, file=sys.stderr)
    with torch.inference_mode():
        if prompts is None:
            session = Session(
                model, 1, chat_context(args, model), eos_ids=tokenizer.eos_ids, sampling=sampling, compression=compression, compile=args.compile,
                cuda_graph=cuda_graph, pages=pages, kv_dtype=args.kv_dtype,
            )
            chat(args, model, tokenizer, session)
        elif args.max_batch is not None:
            answer_continuously(args, model, tokenizer, prompts, sampling, compression, cuda_graph, pages)
        else:
            answer(args, model, tokenizer, prompts, sampling, compression, cuda_graph, pages)


def answer(
    args, model, tokenizer: Tokenizer, prompts: list[list[int]], sampling: SamplingConfig, compression: CompressionConfig, cuda_graph: bool,
    pages: PageConfig | None,
) -> None:
    """One run over a batch of prompts: a single answer streams, a batch prints once complete."""
    texts = [AnswerText(tokenizer, args.stop) for _ in prompts]
    streaming = len(prompts) == 1
    notice = CompileNotice(args.compile)

    def on_tokens(news: dict[int, int | None]) -> list[int]:
        notice()
        for row, token in news.items():
            if token is not None:
                piece = texts[row].push(token)
                if streaming:
                    print(piece, end="", flush=True)
        return [row for row in news if texts[row].stops.stopped]

    result = generate(
        model, prompts, args.max_new_tokens, eos_ids=eos_ids(args, tokenizer), sampling=sampling, compile=args.compile, on_tokens=on_tokens,
        compression=compression, cuda_graph=cuda_graph, pages=pages, kv_dtype=args.kv_dtype,
    )
    endings = [text.flush() for text in texts]
    if streaming:
        print(endings[0], flush=True)  # all of the answer before the summary, when both go to a terminal
    else:
        # A batch is printed once it is complete, answers in prompt order, a blank line apart.
        print("\n\n".join(text.text for text in texts), flush=True)
    print(summary(result, cuda_graph), file=sys.stderr)


def answer_continuously(
    args, model, tokenizer: Tokenizer, prompts: list[list[int]], sampling: SamplingConfig, compression: CompressionConfig, cuda_graph: bool,
    pages: PageConfig,
) -> None:
    """Continuous batching: each answer is printed once it and every answer before it are
    complete, so they come out in prompt order, a blank line apart."""
    texts = [AnswerText(tokenizer, args.stop) for _ in prompts]
    done = [False] * len(prompts)
    printed = 0

    notice = CompileNotice(args.compile)

    def on_tokens(news: dict[int, int | None]) -> list[int]:
        nonlocal printed
        notice()
        for prompt, token in news.items():
            if token is not None:
                texts[prompt].push(token)
                continue
            texts[prompt].flush()  # its answer is complete
            done[prompt] = True
            while printed < len(prompts) and done[printed]:
                print(("\n" if printed else "") + texts[printed].text, flush=True)
                printed += 1
        return [prompt for prompt, token in news.items() if token is not None and texts[prompt].stops.stopped]

    requests = [Request(prompt, args.max_new_tokens) for prompt in prompts]
    run = serve(
        model, requests, args.max_batch, eos_ids=eos_ids(args, tokenizer), sampling=sampling, compression=compression, pages=pages,
        compile=args.compile, cuda_graph=cuda_graph, on_tokens=on_tokens, kv_dtype=args.kv_dtype,
    )
    print(batch_summary(run), file=sys.stderr)


def eos_ids(args: argparse.Namespace, tokenizer: Tokenizer) -> frozenset[int]:
    return frozenset() if args.ignore_eos else tokenizer.eos_ids


def batch_summary(run: BatchRun) -> str:
    return (
        f"prompts: {len(run.tokens)} | prompt tokens: {run.prompt_tokens} | new tokens: {run.new_tokens} | "
        f"{run.new_tokens / run.seconds:.1f} new tok/s over {run.seconds:.1f} s ({run.steps} steps, at most {run.most_rows} prompts at once) | "
        f"KV cache: {run.kv_peak_bytes / 2**20:.1f} of {run.kv_cache_bytes / 2**20:.1f} MiB at its peak"
    )


def chat_context(args: argparse.Namespace, model) -> int:
    limit = model.config.max_position_embeddings
    context = min(limit, 4096) if args.context is None else args.context
    if not 2 <= context <= limit:
        raise UserError(f"--context must be between 2 and the model's {limit} positions, got {context}")
    return context


def chat(args: argparse.Namespace, model, tokenizer: Tokenizer, session: Session) -> None:
    """The interactive loop: one user message per line of stdin; /reset, /exit; Ctrl-C stops an answer."""
    if not tokenizer.has_chat_template:
        raise UserError("--interactive needs a checkpoint with a chat template; give a prompt instead")
    if args.chat is False:
        raise UserError("--interactive is a chat over the chat template; drop --no-chat")
    conversation = Conversation(session, tokenizer, args.system, model.config.max_position_embeddings)
    notice = CompileNotice(args.compile)  # one session for the whole chat: its first answer compiles
    print(f"chat: {session.cache.n_slots} cache slots; /reset starts over, /exit or end of input leaves, Ctrl-C stops an answer", file=sys.stderr)
    while True:
        print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        message = line.strip()
        if not line or message == "/exit":
            return
        if message == "/reset":
            conversation.reset()
            print("(a new conversation)", file=sys.stderr)
            continue
        if not message:
            continue
        text = AnswerText(tokenizer, args.stop)
        interrupted = []

        def on_tokens(news: dict[int, int | None]) -> list[int]:
            notice()
            if news.get(0) is not None:
                print(text.push(news[0]), end="", flush=True)
            return [0] if text.stops.stopped or interrupted else []

        previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
        try:
            conversation.turn(message, args.max_new_tokens, on_tokens)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        finally:
            signal.signal(signal.SIGINT, previous)
        print(text.flush(), flush=True)
        if interrupted:
            print("(answer stopped)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
