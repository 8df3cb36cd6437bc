"""evaluation/perplexity.py: its windows by hand, its negative log-likelihoods against transformers' loss,
and (real models, llama-cpp-python installed) the engine and llama.cpp on the same GGUF weights."""

import importlib.util
import math

import pytest
import torch

from evaluation.perplexity import engine_nll, llama_cpp_nll, perplexity, windows
from weights.forms import load_model

CPU = torch.device("cpu")


def test_windows_cut_consecutive_tokens_and_drop_a_last_single_one():
    assert windows(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5]]  # [6] alone predicts nothing
    assert windows(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert windows([5], 4) == []


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_engine_nll_is_transformers_loss(kind, tiny_checkpoint):
    folder, hf_model = tiny_checkpoint(kind)
    model = load_model(folder, torch.float32, CPU)
    window = torch.randint(3, 390, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    nll = engine_nll(model, window)
    assert len(nll) == 39
    loss = hf_model(torch.tensor([window]), labels=torch.tensor([window])).loss.item()  # mean over the 39 predictions
    assert sum(nll) / len(nll) == pytest.approx(loss, rel=1e-5)
    assert perplexity(lambda w: engine_nll(model, w), [window, window[:20]]) == pytest.approx(
        math.exp((sum(nll) + sum(nll[:19])) / 58), rel=1e-6
    )


@pytest.mark.real
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs llama-cpp-python")
def test_engine_and_llama_cpp_agree_on_the_same_gguf_weights():
    """SmolLM2's Q4_1 file: the engine in float32 computes with exactly the dequantized weights, and the
    quantized import with the same int4 values; llama.cpp rounds its activations to 8 bits inside its dot
    products, so the perplexities agree to within 2%, not exactly (measured here: 0.6% for the float32
    import, 0.5% for the quantized one; 0.2% on the 4096 tokens of prose in docs/quantization.md)."""
    from weights.packaged import smollm2_checkpoint, smollm2_gguf
    from weights.tokenizer import Tokenizer

    checkpoint = smollm2_checkpoint()
    text = open(torch.__file__).read()
    tokens = Tokenizer.from_dir(checkpoint).encode(text, add_special_tokens=False)[:2048]
    token_windows = windows(tokens, 512)
    exact = load_model(checkpoint, torch.float32, CPU)
    int4 = load_model(smollm2_checkpoint(quantized=True), torch.bfloat16, CPU)
    engine = perplexity(lambda w: engine_nll(exact, w), token_windows)
    quantized = perplexity(lambda w: engine_nll(int4, w), token_windows)
    llama_cpp = perplexity(llama_cpp_nll(smollm2_gguf(), 512), token_windows)
    assert engine == pytest.approx(llama_cpp, rel=0.02)
    assert quantized == pytest.approx(llama_cpp, rel=0.02)
