"""CUDA-only paths; every test here skips on a machine without CUDA."""

import importlib.util

import pytest
import torch

from compression.config import CompressionConfig
from engine.options import RunOptions, generate
from weights.forms import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def prompts_of(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_graph_replay_equals_eager_token_for_token(kind, tiny_checkpoint):
    model = load_model(tiny_checkpoint(kind)[0], torch.float32, CUDA)
    prompts = prompts_of([6, 21, 13])
    eager = generate(model, prompts, 40, eos_ids=frozenset()).tokens
    graphed = generate(model, prompts, 40, eos_ids=frozenset(), options=RunOptions(cuda_graph=True)).tokens
    assert graphed == eager


@pytest.mark.parametrize("policy", ["beacon", "snapkv", "streaming", "h2o"])
def test_compaction_between_replays_keeps_graph_and_eager_equal(policy, tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CUDA)
    prompts = prompts_of([5, 17], seed=1)
    config = CompressionConfig(policy=policy, budget=12, hysteresis=6, window=4, n_beacon=4, n_recent=6)
    eager = generate(model, prompts, 80, eos_ids=frozenset(), options=RunOptions(compression=config))
    graphed = generate(model, prompts, 80, eos_ids=frozenset(), options=RunOptions(compression=config, cuda_graph=True))
    assert graphed.compression.compactions == eager.compression.compactions > 0
    assert graphed.tokens == eager.tokens


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn (the cuda extra)")
def test_flash_decode_equals_sdpa(tiny_checkpoint, monkeypatch):
    """Both kernels are fed the same tokens (teacher forcing): in bfloat16 they round differently,
    and runs that each decode greedily would part at the first near-tie."""
    import kv.flash
    from engine.decode import StepState, decode_step, prefill
    from kv.cache import KVCache
    from engine.sampling import SamplingConfig

    model = load_model(tiny_checkpoint("qwen3")[0], torch.bfloat16, CUDA)
    prompts = prompts_of([9, 30, 17], seed=2)
    forced = torch.tensor(prompts_of([32, 32, 32], seed=3), device=CUDA).T  # [steps, B]

    def decode_logits() -> torch.Tensor:
        cache = KVCache.allocate(model.config, 3, 64, torch.bfloat16, CUDA)
        prefill(model, cache, prompts)
        finished, eos = torch.zeros(3, dtype=torch.bool, device=CUDA), torch.tensor([-1], device=CUDA)
        steps = [decode_step(model, cache, StepState(fed.clone(), finished, eos, SamplingConfig())) for fed in forced]
        return torch.stack(steps).float()

    with_flash = decode_logits()
    monkeypatch.setattr(kv.flash, "kernel", None)
    with_sdpa = decode_logits()
    assert (with_flash - with_sdpa).abs().max().item() <= 2e-2 * with_sdpa.abs().max().item()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_linear_on_cuda_equals_the_dequantized_product(mode):
    from models.quantized import quantize, quantized_linear

    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(64, 256, generator=g), torch.randn(3, 256, generator=g)
    quantized = quantize(weight, mode, 64)
    layer = quantized_linear(quantized, None, torch.bfloat16, CUDA)
    expected = x @ quantized.dequantize().t()  # [3, 64] in float32
    got = layer(x.to(CUDA, torch.bfloat16)).float().cpu()
    assert torch.allclose(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_graph_replay_of_a_quantized_model_equals_eager(mode, tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.bfloat16, CUDA, quant=mode)
    prompts = prompts_of([6, 21])
    eager = generate(model, prompts, 30, eos_ids=frozenset()).tokens
    graphed = generate(model, prompts, 30, eos_ids=frozenset(), options=RunOptions(cuda_graph=True)).tokens
    assert graphed == eager


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn (the cuda extra)")
def test_flash_decode_through_the_block_table_equals_sdpa_on_the_contiguous_cache(tiny_checkpoint, monkeypatch):
    """Pages of 256 slots, read by flash-attn through the block table; fed the same tokens. The
    reference runs without flash-attn: a bfloat16 contiguous cache on CUDA would take it too."""
    import kv.flash
    from engine.decode import StepState, decode_step, prefill
    from kv.cache import KVCache
    from kv.paged import PageConfig, PagedKVCache
    from engine.sampling import SamplingConfig

    model = load_model(tiny_checkpoint("qwen3")[0], torch.bfloat16, CUDA)
    prompts = prompts_of([9, 300, 17], seed=4)
    forced = torch.tensor(prompts_of([24, 24, 24], seed=5), device=CUDA).T  # [steps, B]

    def decode_logits(cache) -> torch.Tensor:
        prefill(model, cache, prompts)
        finished, eos = torch.zeros(3, dtype=torch.bool, device=CUDA), torch.tensor([-1], device=CUDA)
        return torch.stack([decode_step(model, cache, StepState(fed.clone(), finished, eos, SamplingConfig())) for fed in forced]).float()

    paged = PagedKVCache.allocate(model.config, 3, 512, torch.bfloat16, CUDA, PageConfig(block_size=256))
    for row, prompt in enumerate(prompts):
        paged.fit(row, len(prompt) + len(forced))
    with_pages = decode_logits(paged)
    monkeypatch.setattr(kv.flash, "kernel", None)
    with_sdpa = decode_logits(KVCache.allocate(model.config, 3, 512, torch.bfloat16, CUDA))
    assert (with_pages - with_sdpa).abs().max().item() <= 2e-2 * with_sdpa.abs().max().item()


@pytest.mark.parametrize("policy", ["none", "beacon"])
def test_graph_replay_of_continuous_batching_equals_eager(policy, tiny_checkpoint):
    from kv.paged import PageConfig
    from engine.scheduler import Request, serve

    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CUDA)
    requests = [Request(p, n) for p, n in zip(prompts_of([5, 40, 12, 3, 27], seed=6), [10, 30, 5, 20, 8])]
    config = CompressionConfig(policy=policy, budget=6, hysteresis=3, window=3, n_beacon=4, n_recent=4)
    eager = serve(model, requests, 2, eos_ids=frozenset(), options=RunOptions(compression=config, pages=PageConfig(block_size=4)))
    graphed = serve(model, requests, 2, eos_ids=frozenset(), options=RunOptions(compression=config, pages=PageConfig(block_size=4), cuda_graph=True))
    assert graphed.tokens == eager.tokens


def test_requests_with_their_own_sampling_under_a_graph_equal_eager(tiny_checkpoint):
    """The graph is captured while the first rows are greedy; later requests join with
    temperature, top-k/p, min-p and a penalty, each seeded: they sample as in the eager run."""
    from kv.paged import PageConfig
    from engine.sampling import RowSampling, SamplingConfig
    from engine.scheduler import Request, serve

    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CUDA)
    settings = [None, None, SamplingConfig(temperature=0.9, top_k=20), SamplingConfig(temperature=1.1, top_p=0.8, repetition_penalty=1.3),
                SamplingConfig(temperature=0.7, min_p=0.1)]
    requests = [Request(p, 12, s, seed=i) for i, (p, s) in enumerate(zip(prompts_of([5, 9, 12, 3, 7], seed=7), settings))]
    runs = [
        serve(model, requests, 2, eos_ids=frozenset(), sampling=RowSampling([SamplingConfig()] * 2, CUDA, seeded=True), options=RunOptions(pages=PageConfig(block_size=4), cuda_graph=graph))
        for graph in (False, True)
    ]
    assert runs[1].tokens == runs[0].tokens


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_graph_replay_over_a_quantized_kv_cache_equals_eager(kv_dtype, tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CUDA)
    prompts = prompts_of([5, 17], seed=4)
    config = CompressionConfig(policy="snapkv", budget=12, hysteresis=6, window=4, n_recent=6)
    eager = generate(model, prompts, 60, eos_ids=frozenset(), options=RunOptions(compression=config, kv_dtype=kv_dtype))
    graphed = generate(model, prompts, 60, eos_ids=frozenset(), options=RunOptions(compression=config, kv_dtype=kv_dtype, cuda_graph=True))
    assert eager.compression.compactions > 0
    assert graphed.tokens == eager.tokens
