"""Perplexity of a text under the engine's model, in any weight format, and under llama.cpp.

    python -m evaluation.perplexity --checkpoint DIR --text FILE [--text FILE ...]
        [--dtype bfloat16] [--quant none|int8|int4] [--group-size 32] [--gguf FILE.gguf]
        [--tokens 4096] [--window 512] [--kv-dtype int8 --kv-dtype int4 ...]

Each text is tokenized once by the checkpoint's tokenizer and its first --tokens tokens cut into
windows of --window. Every window is one prefill that starts from an empty cache; each of its
tokens after the first is predicted from those before it in the window. The perplexity is
exp(mean negative log-likelihood) over all of them. With --gguf, llama.cpp (llama-cpp-python)
scores the very same token ids in the same windows, so the two figures compare the weights alone.
Each --kv-dtype scores them again with the cache stored that way (kv/quantized.py): the
window's attention reads its keys and values back from the codes, as a decode step would.
"""

import argparse
import math
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from cli import DTYPE_HELP, DTYPES, add_quant_args, checkpoint_and_quant, pick_dtype
from engine.decode import prefill
from errors import UserError, run_command
from kv import KV_BITS, KV_CHANNEL_CODES, KV_DTYPES
from kv.contiguous import contiguous_cache
from models.transformer import Transformer
from weights.forms import load_model
from weights.tokenizer import Tokenizer

CPU = torch.device("cpu")


def windows(tokens: list[int], size: int) -> list[list[int]]:
    """Consecutive windows of `size` tokens; a last one shorter than two tokens predicts nothing and is dropped."""
    return [tokens[i : i + size] for i in range(0, len(tokens), size) if len(tokens[i : i + size]) > 1]


def nll_of(logits: torch.Tensor, window: list[int]) -> list[float]:
    """The negative log-likelihood of each token of the window after the first, from the logits
    [T, V] at every position of the window (the last position's predict nothing here)."""
    logprobs = F.log_softmax(logits[:-1].float(), dim=-1)  # [T-1, V]
    return (-logprobs.gather(1, torch.tensor(window[1:])[:, None]))[:, 0].tolist()


def engine_nll(model: Transformer, window: list[int], kv_dtype: str = "auto") -> list[float]:
    """nll_of the engine's logits: one prefill of the window into an empty cache stored as kv_dtype says."""
    cache = contiguous_cache(model, 1, len(window), kv_dtype, CPU)
    with torch.inference_mode():
        return nll_of(prefill(model, cache, [window], all_logits=True)[0], window)  # logits [T, V]


def llama_cpp_nll(gguf: Path, window_size: int) -> Callable[[list[int]], list[float]]:
    """A scorer like engine_nll, run by llama.cpp on the GGUF file."""
    import numpy as np
    from llama_cpp import Llama

    threads = torch.get_num_threads()
    llm = Llama(model_path=str(gguf), n_ctx=window_size, n_batch=window_size, n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False)

    def score(window: list[int]) -> list[float]:
        llm.reset()
        llm.eval(window)
        return nll_of(torch.from_numpy(np.asarray(llm.scores[: len(window)], dtype=np.float32)), window)

    return score


def perplexity(score: Callable[[list[int]], list[float]], token_windows: list[list[int]]) -> float:
    nll = [value for window in token_windows for value in score(window)]
    return math.exp(sum(nll) / len(nll))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evaluation.perplexity", description="Perplexity of texts under the engine (and llama.cpp).")
    p.add_argument("--checkpoint", required=True, help="model folder (its tokenizer tokenizes the texts)")
    p.add_argument("--text", type=Path, action="append", required=True, help="a UTF-8 text file (repeatable)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help=DTYPE_HELP)
    p.add_argument("--tokens", type=int, default=4096, help="the first this many tokens of each text")
    p.add_argument("--window", type=int, default=512, help="tokens per prefill; each starts from an empty cache")
    p.add_argument("--gguf", type=Path, help="also score the texts with llama.cpp on this GGUF file")
    p.add_argument(
        "--kv-dtype", action="append", choices=["auto", *KV_DTYPES, *KV_BITS, *KV_CHANNEL_CODES], metavar="KV_DTYPE",
        help="how the engine's cache stores keys and values (as generate.py's; repeatable: each is scored; default auto, the model's dtype)",
    )
    add_quant_args(p)
    return p.parse_args(argv)


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text ({e}); pass a text file") from e


def run(args: argparse.Namespace) -> None:
    if args.tokens < 2 or args.window < 2:
        raise UserError("--tokens and --window must each be at least 2")
    for path in [*args.text, *([args.gguf] if args.gguf else [])]:
        if not path.is_file():
            raise UserError(f"{path}: no such file")
    checkpoint, quant = checkpoint_and_quant(args.checkpoint, args.quant, args.group_size)
    tokenizer = Tokenizer.from_dir(checkpoint)
    texts = {path: windows(tokenizer.encode(read_text(path), add_special_tokens=False)[: args.tokens], args.window) for path in args.text}
    model = load_model(checkpoint, pick_dtype(args.dtype, checkpoint, CPU, quant), CPU, quant, args.group_size)
    weights = f"{quant if quant != 'none' else 'as stored'}, {str(model.dtype).removeprefix('torch.')}"
    scorers = {f"engine ({weights}, KV {kv})": partial(engine_nll, model, kv_dtype=kv) for kv in args.kv_dtype or ["auto"]}
    if args.gguf is not None:
        scorers[f"llama.cpp ({args.gguf.name})"] = llama_cpp_nll(args.gguf, args.window)
    for path, token_windows in texts.items():
        n = sum(len(w) - 1 for w in token_windows)
        for name, score in scorers.items():
            print(f"{path.name}: {n} predicted tokens | {name}: perplexity {perplexity(score, token_windows):.4f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
