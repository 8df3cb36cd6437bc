"""Run a Llama / Qwen checkpoint on a prompt and stream the answer.

    python generate.py --checkpoint DIR --prompt "Why is the sky blue?"

Only the generated text goes to stdout; the one-line summary goes to stderr.
"""

import argparse
import sys
from pathlib import Path

import torch

from compression.config import AGGREGATIONS, POLICIES, CompressionConfig
from engine.generation import GenerationResult, generate
from engine.sampling import SamplingConfig
from models.errors import UserError, run_command
from weights.download import resolve_checkpoint
from weights.loader import load_model, stored_dtype
from weights.packaged import smollm2_checkpoint
from weights.tokenizer import StreamDecoder, Tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", nargs="?", help="the prompt (same as --prompt)")
    p.add_argument("--checkpoint", help="model folder (config.json, safetensors, tokenizer.json) or a hub repo id already downloaded; default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--prompt", help="the prompt; without it and without --prompt-file the prompt is read from stdin")
    p.add_argument("--prompt-file", type=Path, help="a file with one prompt per line; the lines run as one batch")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None, help="wrap the prompt in the checkpoint's chat template (default: when it has one)")
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy decoding")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens only (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set holding this probability mass (1: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: the checkpoint's dtype, bfloat16 instead of float16 on CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (slow to start, checks it is graph-capturable)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None, help="capture the decode step as a CUDA graph and replay it (default: on with CUDA)")
    add_compression_args(p)
    args = p.parse_args(argv)
    if args.text is not None and args.prompt is not None:
        p.error("give the prompt either as an argument or with --prompt, not both")
    args.prompt = args.prompt if args.prompt is not None else args.text
    if args.prompt is not None and args.prompt_file is not None:
        p.error("--prompt and --prompt-file are exclusive")
    return args


def add_compression_args(p: argparse.ArgumentParser) -> None:
    d = CompressionConfig()
    g = p.add_argument_group("KV-cache compression")
    g.add_argument("--kv-policy", choices=POLICIES, default=d.policy, help="which generated tokens stay in the cache (none: all of them)")
    g.add_argument("--kv-budget", type=int, default=d.budget, help="generated tokens kept by a compaction, the recent window excluded")
    g.add_argument("--kv-hysteresis", type=int, default=d.hysteresis, help="compaction starts when the kept part exceeds budget + this")
    g.add_argument("--kv-window", type=int, default=d.window, help="most recent tokens, never evicted")
    g.add_argument("--n-beacon", type=int, default=d.n_beacon, help="BeaconKV: beacon queries per layer and head")
    g.add_argument("--n-recent", type=int, default=d.n_recent, help="recent queries that score the cache (all policies that use queries)")
    g.add_argument("--kv-aggregation", choices=AGGREGATIONS, default=d.aggregation, help="BeaconKV: how scores combine over queries and the heads of a KV group")


def compression_config(args: argparse.Namespace) -> CompressionConfig:
    return CompressionConfig(
        policy=args.kv_policy,
        budget=args.kv_budget,
        hysteresis=args.kv_hysteresis,
        window=args.kv_window,
        n_beacon=args.n_beacon,
        n_recent=args.n_recent,
        aggregation=args.kv_aggregation,
        seed=args.seed,
    )


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device cuda was requested but this torch ({torch.__version__}) sees no CUDA device; use --device cpu")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    dtype = DTYPES.get(checkpoint_dtype or "", torch.float32)
    # float16 matmuls are emulated and slow on CPU; bfloat16 has the same size and native kernels.
    return torch.bfloat16 if dtype == torch.float16 and device.type == "cpu" else dtype


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


def summary(result: GenerationResult) -> str:
    prefill_rate = result.prompt_tokens / result.prefill_s if result.prefill_s else 0.0
    decoded = result.decode_steps * len(result.tokens)
    decode_rate = decoded / result.decode_s if result.decode_s else 0.0
    return (
        f"prompt tokens: {result.prompt_tokens} | new tokens: {result.new_tokens} | "
        f"prefill: {prefill_rate:.1f} tok/s | decode: {decode_rate:.1f} tok/s | "
        f"KV cache: {result.kv_cache_bytes / 2**20:.1f} MiB"
        + (f" | compactions: {result.compression.compactions}" if result.compression is not None else "")
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command(lambda: run(args))


def run(args: argparse.Namespace) -> None:
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    compression = compression_config(args)
    device = pick_device(args.device)
    checkpoint = smollm2_checkpoint() if args.checkpoint is None else resolve_checkpoint(args.checkpoint)
    tokenizer = Tokenizer.from_dir(checkpoint)
    prompts = encode_prompts(tokenizer, read_prompts(args), args.chat, args.system)
    model = load_model(checkpoint, pick_dtype(args.dtype, stored_dtype(checkpoint), device), device)
    torch.manual_seed(args.seed)

    stream = StreamDecoder(tokenizer) if len(prompts) == 1 else None

    def print_tokens(tokens: list[int | None]) -> None:
        if stream is not None and tokens[0] is not None:
            print(stream.push(tokens[0]), end="", flush=True)

    with torch.inference_mode():
        cuda_graph = device.type == "cuda" if args.cuda_graph is None else args.cuda_graph
        result = generate(model, prompts, args.max_new_tokens, tokenizer.eos_ids, sampling, args.compile, print_tokens, compression, cuda_graph)
    if stream is not None:
        print(stream.flush(), flush=True)  # all of the answer before the summary, when both go to a terminal
    else:
        # A batch is printed once it is complete, answers in prompt order, a blank line apart.
        print("\n\n".join(tokenizer.decode(ids) for ids in result.tokens), flush=True)
    print(summary(result), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
