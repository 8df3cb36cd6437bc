"""The engine computes what transformers computes, on tiny random checkpoints of every architecture."""

import copy
from pathlib import Path

import pytest
import torch

from conftest import ALL_KINDS
from tiny_checkpoints import tensors_in_file
from engine.decode import StepState, decode_step, prefill
from engine.generation import generate
from kv.cache import KVCache
from engine.sampling import SamplingConfig
from weights.forms import load_model

CPU = torch.device("cpu")


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_full_sequence_logits_equal_transformers(kind, tiny_checkpoint):
    folder, hf = tiny_checkpoint(kind)
    model = load_model(folder, torch.float32, CPU)
    prompt = random_prompt(120, seed=1)  # past llama3_rope's original context of 64
    expected = hf(torch.tensor([prompt])).logits[0]
    cache = KVCache.allocate(model.config, 1, len(prompt), torch.float32, CPU)
    got = prefill(model, cache, [prompt], all_logits=True)[0]
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("lengths", [[50, 50], [50, 17, 33]])
def test_batch_prefill_logits_equal_transformers_on_each_prompt(kind, lengths, tiny_checkpoint):
    """Equal lengths take SDPA's causal kernel with grouped heads; ragged ones the padded mask."""
    folder, hf = tiny_checkpoint(kind)
    model = load_model(folder, torch.float32, CPU)
    prompts = [random_prompt(n, seed=10 + row) for row, n in enumerate(lengths)]
    cache = KVCache.allocate(model.config, len(prompts), max(lengths), torch.float32, CPU)
    got = prefill(model, cache, prompts, all_logits=True)  # [B, T, V]
    for row, prompt in enumerate(prompts):
        expected = hf(torch.tensor([prompt])).logits[0]
        assert (got[row, : len(prompt)] - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_greedy_generation_equals_transformers_generate(kind, tiny_checkpoint):
    folder, hf = tiny_checkpoint(kind)
    model = load_model(folder, torch.float32, CPU)
    prompt = random_prompt(24, seed=2)
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = generate(model, [prompt], 32, eos_ids=frozenset()).tokens[0]
    assert got == expected[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_prefill_then_decode_gives_the_logits_of_one_full_forward(kind, tiny_checkpoint):
    folder, _ = tiny_checkpoint(kind)
    model = load_model(folder, torch.float32, CPU)
    sequence = random_prompt(40, seed=3)
    full_cache = KVCache.allocate(model.config, 1, len(sequence), torch.float32, CPU)
    full = prefill(model, full_cache, [sequence], all_logits=True)[0]  # [T, V]

    n_prompt = 10
    cache = KVCache.allocate(model.config, 1, len(sequence), torch.float32, CPU)
    prefill(model, cache, [sequence[:n_prompt]])
    finished = torch.zeros(1, dtype=torch.bool)
    eos = torch.tensor([-1])
    for i in range(n_prompt, len(sequence)):
        tokens = torch.tensor([sequence[i]])
        logits = decode_step(model, cache, StepState(tokens, finished, eos, SamplingConfig()))
        assert (logits[0] - full[i]).abs().max().item() <= 1e-4
    assert cache.length.tolist() == [len(sequence)] and cache.position.tolist() == [len(sequence)]


def test_bfloat16_logits_close_to_transformers_bfloat16(tiny_checkpoint):
    folder, hf = tiny_checkpoint("qwen2")
    model = load_model(folder, torch.bfloat16, CPU)
    prompt = random_prompt(30, seed=4)
    expected = copy.deepcopy(hf).to(torch.bfloat16)(torch.tensor([prompt])).logits[0].float()
    cache = KVCache.allocate(model.config, 1, len(prompt), torch.bfloat16, CPU)
    got = prefill(model, cache, [prompt], all_logits=True)[0].float()
    assert (got - expected).abs().max().item() <= 0.1 * expected.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cache_writes_move_the_exact_bits(dtype):
    """Compaction moves slots through integer views (CPU scatter_ is ~1000x slower on 16-bit floats):
    each value must land in its slot bit for bit, -0.0 and NaN included."""
    from kv.compaction import scatter_bits_

    bits = torch.int32 if dtype == torch.float32 else torch.int16
    buffer = torch.randn(2, 3, 10, 4).to(dtype)
    values = torch.randn(2, 3, 2, 4).to(dtype)
    values[0, 0, 0, :2] = torch.tensor([-0.0, float("nan")], dtype=dtype)
    slots = [[7, 2], [0, 9]]
    expected = buffer.clone()
    for b in range(2):
        for t in range(2):
            expected[b, :, slots[b][t]] = values[b, :, t]
    index = torch.tensor(slots)[:, None, :, None].expand(2, 3, 2, 4)
    scatter_bits_(buffer, 2, index, values)
    assert torch.equal(buffer.view(bits), expected.view(bits))


@pytest.mark.parametrize("rows", [1, 4, 8, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_linear_is_the_exact_product_rounded_once(rows, dtype):
    """Few rows take the 16-bit kernel; many rows may take float32 (CPUs without 16-bit matrix
    instructions): either way the result is the exact product, rounded to the dtype."""
    from models.linear import Linear

    torch.manual_seed(rows)
    layer = Linear(96, 40, bias=True).to(dtype)
    x = torch.randn(2, rows, 96).to(dtype)
    exact = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    got = layer(x)
    assert got.dtype == dtype and got.shape == (2, rows, 40)
    significand_bits = {torch.bfloat16: 8, torch.float16: 11}[dtype]
    bound = exact.abs() * 2.0 ** (1 - significand_bits) + 1e-3  # one unit in the last place, and float32 summation
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_are_laid_out_for_the_cpu_kernels_and_stay_tied(dtype, tiny_checkpoint):
    """float32 on CPU: column-major where a matrix has more outputs than inputs (the faster
    batch-1 product there), row-major elsewhere; 16-bit: the checkpoint's row-major everywhere."""
    model = load_model(tiny_checkpoint("llama_tied")[0], dtype, CPU)
    assert model.config.tie_word_embeddings
    assert model.embed.weight is model.lm_head.weight
    layer = model.layers[0]
    expected_column_major = {"lm_head": True, "wqkv": True, "w_gate_up": True, "wo": False, "w_down": False}  # 400x64 128x64 320x64 64x64 64x160
    linears = {"lm_head": model.lm_head, "wqkv": layer.attn.wqkv, "w_gate_up": layer.mlp.w_gate_up, "wo": layer.attn.wo, "w_down": layer.mlp.w_down}
    for name, linear in linears.items():
        column_major = expected_column_major[name] and dtype == torch.float32
        assert linear.weight.t().is_contiguous() == column_major, name
        assert linear.weight.is_contiguous() == (not column_major), name


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads the process's memory map (Linux)")
@pytest.mark.parametrize("kind,dtype,mapped", [("llama", torch.float32, {"embed.weight"}), ("llama", torch.bfloat16, set()), ("llama_tied", torch.float32, set())])
def test_only_an_untied_embedding_stays_in_the_file_and_copies_leave_no_map_behind(kind, dtype, mapped, tiny_checkpoint, tmp_path):
    """In the file's own dtype an untied embedding table is a view of the memory-mapped file (only
    the rows looked up become resident); every other weight is a copy, and no map of the file
    outlives the copying (the pages it touched would stay resident beside the copies)."""
    import shutil

    folder = tmp_path / kind  # a copy of its own: models other tests still hold map the shared one
    shutil.copytree(tiny_checkpoint(kind)[0], folder)  # float32 on disk
    in_file, every_map_used = tensors_in_file(load_model(folder, dtype, CPU), folder)
    assert in_file == mapped and every_map_used
