"""Prefix caching under chat load (bench.py --prefix-reuse): serve.py with its prefix cache and
with --no-prefix-cache, each in a process of its own, under two workloads of chat requests that
share a long system prompt (numbered facts, about --system-tokens tokens):

- one conversation of --turns turns: each turn sends the whole history again, as chat clients do;
  the time to first token of each turn;
- --conversations conversations at once, each with a question of its own: the time to first
  token at the median and the 95th percentile.

Time to first token is from sending the request to the first streamed text. At temperature 0 the
answers with and without the cache are compared (in float32 they are the same; in bfloat16 a
suffix prefilled apart from its prefix rounds differently and may change one), and every block is
back in the pool at the end (GET /stats). The chats at once find the system prompt the
conversation left in the cache, as on a server that has been up a while.
"""

import argparse
import json
import statistics
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmark.load import ServerProcess, streamed_chunks
from benchmark.report import number, table
from benchmark.workload import progress
from cli import checkpoint_and_quant
from errors import UserError
from weights.tokenizer import Tokenizer

QUESTIONS = ["What is the code of room {}?", "Which room has code {}?", "Say the code of room {} twice.", "Is room {} listed? Answer yes or no."]


@dataclass
class CacheRun:
    turn_ttft_s: list[float]  # the conversation's turns, in order
    ttft_p50_s: float  # the conversations at once
    ttft_p95_s: float
    cached_tokens: list[int]  # per turn, then per conversation (usage.prompt_tokens_details)
    answers: list[str]
    blocks_back: bool


def system_prompt(tokenizer: Tokenizer, tokens: int) -> str:
    """Numbered facts, as many as make about `tokens` tokens."""
    lines: list[str] = []
    while len(tokenizer.encode("\n".join(lines))) < tokens:
        n = len(lines) + 1
        lines.append(f"Fact {n}: the code of room {n} is {(n * 7919) % 10000:04d}.")
    return "You answer questions about these facts.\n" + "\n".join(lines)


def chat_stream(port: int, messages: list[dict], max_tokens: int) -> tuple[str, float, int]:
    """One streamed chat answer at temperature 0: its text, its time to first text, its cached prompt tokens."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    text, first, cached = "", None, 0
    for seconds, chunk in streamed_chunks(port, "/v1/chat/completions", body):
        for choice in chunk["choices"]:
            piece = choice["delta"].get("content") or ""
            if (piece or choice.get("finish_reason")) and first is None:
                first = seconds
            text += piece
        if chunk.get("usage"):
            cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return text, first, cached


def run_server(checkpoint: Path, dtype: str, prefix_cache: bool, system: str, turns: int, conversations: int, max_tokens: int) -> CacheRun:
    name = "with the prefix cache" if prefix_cache else "--no-prefix-cache"

    def command(port: int) -> list[str]:
        options = [] if prefix_cache else ["--no-prefix-cache"]
        return [sys.executable, "serve.py", "--checkpoint", str(checkpoint), "--port", str(port), "--dtype", dtype, "--max-batch", "8", "--max-waiting", str(conversations), *options]

    progress(f"serve.py {name}: starting")
    server = ServerProcess(command, "/health")
    try:
        history = [{"role": "system", "content": system}]
        turn_ttft, cached, answers = [], [], []
        for turn in range(turns):
            history.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)].format(turn + 3)})
            text, ttft, hit = chat_stream(server.port, history, max_tokens)
            history.append({"role": "assistant", "content": text})
            turn_ttft.append(ttft)
            cached.append(hit)
            answers.append(text)
            progress(f"serve.py {name}: turn {turn + 1}: first token after {ttft:.2f} s, {hit} prompt tokens cached")
        results: list[tuple[str, float, int] | None] = [None] * conversations

        def converse(i: int) -> None:
            question = QUESTIONS[i % len(QUESTIONS)].format(i + 1)
            results[i] = chat_stream(server.port, [{"role": "system", "content": system}, {"role": "user", "content": question}], max_tokens)

        threads = [threading.Thread(target=converse, args=(i,)) for i in range(conversations)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        ttfts = sorted(r[1] for r in results)
        progress(f"serve.py {name}: {conversations} conversations at once: first token p50 {statistics.median(ttfts):.2f} s")
        stats = server.get("/stats")[1]
        return CacheRun(
            turn_ttft, statistics.median(ttfts), ttfts[int(0.95 * (len(ttfts) - 1))], cached + [r[2] for r in results],
            answers + [r[0] for r in results], stats["free_blocks"] == stats["pool_blocks"] and stats["running"] == 0,
        )
    finally:
        server.stop()


def measure_prefix_reuse(checkpoint: Path, dtype: str, system_tokens: int, turns: int, conversations: int, max_tokens: int, out: Path | None) -> None:
    tokenizer = Tokenizer.from_dir(checkpoint)
    system = system_prompt(tokenizer, system_tokens)
    runs = {cache: run_server(checkpoint, dtype, cache, system, turns, conversations, max_tokens) for cache in (True, False)}
    on, off = runs[True], runs[False]
    rows = [[f"turn {i + 1}: first token (s)", number(a), number(b), f"{a / b:.2f}"] for i, (a, b) in enumerate(zip(on.turn_ttft_s, off.turn_ttft_s))]
    rows += [
        [f"{conversations} at once: first token p50 (s)", number(on.ttft_p50_s), number(off.ttft_p50_s), f"{on.ttft_p50_s / off.ttft_p50_s:.2f}"],
        [f"{conversations} at once: first token p95 (s)", number(on.ttft_p95_s), number(off.ttft_p95_s), f"{on.ttft_p95_s / off.ttft_p95_s:.2f}"],
    ]
    print(f"model: {checkpoint.name}, --dtype {dtype} | system prompt: {len(tokenizer.encode(system))} tokens | answers of at most {max_tokens} tokens, temperature 0")
    print(table(["", "prefix cache", "--no-prefix-cache", "ratio"], rows))
    same = sum(a == b for a, b in zip(on.answers, off.answers))
    print(f"answers equal with and without the cache: {same} of {len(on.answers)}; every block back at the end: {on.blocks_back and off.blocks_back}")
    later = on.turn_ttft_s[1:]
    if later:
        print(f"later turns' first token against the first turn's, with the cache: {max(later) / on.turn_ttft_s[0]:.1%} at most")
    if out:
        out.write_text(json.dumps({"checkpoint": str(checkpoint), "dtype": dtype, "system_tokens": len(tokenizer.encode(system)), "with_cache": asdict(on), "without_cache": asdict(off)}, indent=1))
        progress(f"wrote {out}")


def add_prefix_reuse_args(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("prefix caching (benchmark/prefix_reuse.py)")
    r.add_argument("--prefix-reuse", action="store_true", help="serve.py with and without its prefix cache: a chat of --turns turns, and --conversations chats at once, over one system prompt")
    r.add_argument("--turns", type=int, default=4, help="--prefix-reuse: turns of the one conversation, each sending the whole history")
    r.add_argument("--conversations", type=int, default=32, help="--prefix-reuse: conversations sent at once, sharing the system prompt")
    r.add_argument("--system-tokens", type=int, default=1000, help="--prefix-reuse: the system prompt's length in tokens")


def run_prefix_reuse(args: argparse.Namespace) -> None:
    """bench.py --prefix-reuse, with bench.py's --checkpoint, --quant, --dtype, --new-tokens (each answer's most) and --json."""
    for flag, value in (("--turns", args.turns), ("--conversations", args.conversations), ("--system-tokens", args.system_tokens), ("--new-tokens", args.new_tokens)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    checkpoint, _ = checkpoint_and_quant(args.checkpoint, args.quant, args.group_size)
    measure_prefix_reuse(Path(checkpoint), args.dtype, args.system_tokens, args.turns, args.conversations, args.new_tokens, args.json)

