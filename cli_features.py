"""Command-line helpers for the features (cli.py defines their options): the run's features as
RunOptions, the paged cache's shape, the attention line on CUDA, the tensor-parallel ranks, and
generate.py's interactive chat and continuous batching. A script imports this module only when a
feature is asked for."""

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from cli import AnswerText, CompileNotice, answer_eos, compression_config, launched_ranks
from engine.chat import Conversation
from engine.options import RunOptions, open_session
from engine.sampling import SamplingConfig
from engine.scheduler import Request, serve
from engine.speculative import Speculation
from errors import UserError
from kv.flash import why_not_flash
from kv.paged import PageConfig, default_block_size
from kv.quantized import kv_storage
from models import parallel
from models.config import ModelConfig
from models.parallel import TensorParallel, kv_head_place
from models.transformer import Transformer
from weights.forms import load_model
from weights.loader import read_config
from weights.tokenizer import Tokenizer


def run_options(args: argparse.Namespace, device: torch.device, paged: bool, cuda_graph: bool) -> RunOptions:
    """The features a script's options ask for (paged: the run pages its cache)."""
    return RunOptions(args.compile, cuda_graph, compression_config(args), page_config(args, device, paged), args.kv_dtype, prefix_cache=args.prefix_cache)


def speculation(args: argparse.Namespace, checkpoint: Path, dtype: torch.dtype, device: torch.device) -> Speculation | None:
    """--speculate: prompt lookup, or a draft model loaded here, whose tokenizer must be the checkpoint's."""
    if args.speculate is None:
        return None
    if args.speculate == "ngram":
        return Speculation(None, args.draft_tokens)
    draft = Path(args.speculate.removeprefix("draft:"))
    if not (draft / "config.json").is_file():
        raise UserError(f"--speculate draft:{draft}: no checkpoint there (no config.json); give a local model folder")
    if vocabulary(draft) != vocabulary(checkpoint):
        raise UserError(f"--speculate draft:{draft}: its tokenizer is not the checkpoint's; a draft model must share the target's vocabulary")
    return Speculation(load_model(draft, dtype, device), args.draft_tokens)


def vocabulary(checkpoint: Path) -> tuple:
    """A tokenizer's token ids: its model's vocabulary and its added tokens."""
    file = checkpoint / "tokenizer.json"
    if not file.is_file():
        raise UserError(f"{checkpoint} has no tokenizer.json, so its vocabulary cannot be compared; --speculate draft: needs one in both folders")
    tokenizer = json.loads(file.read_text())
    return json.dumps(tokenizer.get("model", {}).get("vocab"), sort_keys=True), json.dumps(tokenizer.get("added_tokens"), sort_keys=True)


def page_config(args: argparse.Namespace, device: torch.device, paged: bool) -> PageConfig | None:
    """The paged cache's shape when this run pages its cache (--paged, or continuous batching), else None."""
    if not paged:
        if args.block_size is not None or args.kv_blocks is not None:
            raise UserError("--block-size and --kv-blocks size a paged cache; add --paged (or --max-batch) or drop them")
        return None
    return PageConfig(default_block_size(device) if args.block_size is None else args.block_size, args.kv_blocks)


def attention_line(device: torch.device, dtype: torch.dtype, config: ModelConfig, kv_dtype: str, pages: PageConfig | None, store_slots: int) -> str | None:
    """One line for stderr on CUDA: which kernel a decode step's attention runs, and why when it is
    not flash-attn (None on CPU, whose one path is SDPA)."""
    if device.type != "cuda":
        return None
    cache_dtype, bits, _ = kv_storage(kv_dtype, dtype)
    block_size = None if pages is None else pages.block_size
    reason = why_not_flash(device, dtype, None if bits else cache_dtype, config.head_dim, block_size, store_slots > 0)
    if reason is None:
        return "attention: flash-attn in decode steps" + (" through the block table" if pages else "") + ", SDPA in prefill"
    return f"attention: SDPA{' over gathered blocks' if pages else ''}, not flash-attn: {reason}"


def start_ranks(args: argparse.Namespace, device: torch.device) -> tuple[TensorParallel | None, torch.device]:
    """Under torchrun with N > 1 ranks, join them (this rank's place and device); else (None, device)."""
    if launched_ranks() == 1:
        return None, device
    if args.rank_timeout <= 0:
        raise UserError(f"--rank-timeout must be positive, got {args.rank_timeout}")
    return parallel.start(device, args.rank_timeout)


@contextlib.contextmanager
def ranks_running(tp: TensorParallel | None) -> Iterator[None]:
    """Around a tensor-parallel run: only rank 0 prints (the others' output goes nowhere; errors
    still reach every rank's stderr), a failed collective is one clear error on every rank, and
    the process group ends with the run."""
    if tp is None:
        yield
        return
    finished = False
    try:
        with open(os.devnull, "w") as nowhere, contextlib.ExitStack() as quiet:
            if tp.rank > 0:
                quiet.enter_context(contextlib.redirect_stdout(nowhere))
                quiet.enter_context(contextlib.redirect_stderr(nowhere))
            yield
        finished = True
    except RuntimeError as e:
        # What a collective raises when a peer is gone or a wait times out: NCCL's DistError, gloo's
        # RuntimeError from its own sources. Any other RuntimeError is a bug, and keeps its traceback.
        if not isinstance(e, dist.DistError) and "gloo" not in str(e):
            raise
        detail = str(e).strip().splitlines()[0]
        raise UserError(
            f"rank {tp.rank} of {tp.world}: a collective with the other ranks failed ({detail}); "
            "another rank died, hung past --rank-timeout, or stopped on an error of its own (see its message)"
        ) from None
    finally:
        parallel.stop(tp, finished)


def feature_options(args: argparse.Namespace, checkpoint: Path, model: Transformer, tp: TensorParallel | None, dtype: torch.dtype, cuda_graph: bool) -> RunOptions:
    """generate.py's features; on CUDA, says which attention kernel runs."""
    device = model.device
    options = run_options(args, device, args.paged or args.max_batch is not None, cuda_graph)
    options = replace(options, speculation=speculation(args, checkpoint, dtype, device))
    # The random policy's draws follow the whole model's KV heads, whichever rank holds them.
    options = replace(options, compression=replace(options.compression, kv_heads=kv_head_place(read_config(checkpoint), tp)))
    attention = attention_line(device, dtype, model.config, args.kv_dtype, options.pages, args.kv_store)
    if attention is not None:
        print(attention, file=sys.stderr)
    return options


def answer_continuously(args, model, tokenizer: Tokenizer, prompts: list[list[int]], sampling: SamplingConfig, options) -> None:
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
        return [prompt for prompt, token in news.items() if token is not None and texts[prompt].stopped]

    requests = [Request(prompt, args.max_new_tokens) for prompt in prompts]
    run = serve(model, requests, args.max_batch, eos_ids=answer_eos(args, tokenizer), sampling=sampling, options=options, on_tokens=on_tokens)
    print(batch_summary(run), file=sys.stderr)


def batch_summary(run) -> str:
    return (
        f"prompts: {len(run.tokens)} | prompt tokens: {run.prompt_tokens} ({run.cached_tokens} cached) | new tokens: {run.new_tokens} | "
        f"{run.new_tokens / run.seconds:.1f} new tok/s over {run.seconds:.1f} s ({run.steps} steps, at most {run.most_rows} prompts at once) | "
        f"KV cache: {run.kv_peak_bytes / 2**20:.1f} of {run.kv_cache_bytes / 2**20:.1f} MiB at its peak"
    )


def chat_context(args: argparse.Namespace, model) -> int:
    limit = model.config.max_position_embeddings
    context = min(limit, 4096) if args.context is None else args.context
    if not 2 <= context <= limit:
        raise UserError(f"--context must be between 2 and the model's {limit} positions, got {context}")
    return context


def chat(args: argparse.Namespace, model, tokenizer: Tokenizer, sampling: SamplingConfig, options, notice: CompileNotice) -> None:
    """The interactive loop: one user message per line of stdin; /reset, /exit; Ctrl-C stops an answer."""
    if not tokenizer.has_chat_template:
        raise UserError("--interactive needs a checkpoint with a chat template; give a prompt instead")
    if args.chat is False:
        raise UserError("--interactive is a chat over the chat template; drop --no-chat")
    session = open_session(model, 1, chat_context(args, model), options or RunOptions(), eos_ids=tokenizer.eos_ids, sampling=sampling)
    conversation = Conversation(session, tokenizer, args.system, model.config.max_position_embeddings)
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
            return [0] if text.stopped or interrupted else []

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
