"""Weight-only quantization (models/quantized.py, weights/gguf_blocks.py, the loader's --quant).

Every reference here is computed by the test itself from the portable definition
w[n, k] = values[n, k] * scales[n, k // g] + zeros[n, k // g] (zeros 0 for int8), never by
QuantizedWeight.dequantize, so the layers, the quantizers and the GGUF block readers are each
checked against an independent computation.
"""

import json
from pathlib import Path
import zlib

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open
from torch import nn

import generate
from engine.generation import generate as generate_tokens
from engine.options import RunOptions
from engine.options import generate as generate_with
from kv.cache import KVCache
from errors import UserError
from models.transformer import CacheRead
from models.quantized import Int4Linear, Int8Embedding, Int8Linear, QuantizedWeight, quantize_int4, quantize_int8
from test_gguf import write_gguf
from tiny_checkpoints import tensors_in_file
from weights.gguf import import_gguf
from weights.gguf_blocks import int4_weight
from weights.forms import load_model
from weights.loader import QUANTIZED_KEY

CPU = torch.device("cpu")
LINEAR_NAMES = ("attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down")


def brute_dequantize(q: QuantizedWeight) -> torch.Tensor:
    """float64 [N, K] from the definition, each column k reading its group k // g by indexing."""
    N, K = q.values.shape
    G = q.scales.shape[1]
    assert K % G == 0
    group = torch.arange(K) // (K // G)  # [K] the group of each input
    w = q.values.double() * q.scales.double()[:, group]
    if q.zeros is not None:
        w = w + q.zeros.double()[:, group]
    return w


def magnitude(q: QuantizedWeight) -> torch.Tensor:
    """|values * scales| + |zeros| per element: what the rounding of a scale and a zero can scale."""
    group = torch.arange(q.values.shape[1]) // q.group_size
    mag = (q.values.double() * q.scales.double()[:, group]).abs()
    return mag if q.zeros is None else mag + q.zeros.double().abs()[:, group]


def float32_rounding_bound(q: QuantizedWeight) -> torch.Tensor:
    """How far two float32 evaluations of one 4-bit group's affine map, (v - 8) * s + z here and
    q * d + m (or q * s - dm) in gguf, may differ: a few roundings of 2**-24 of terms at most
    24 |s| + |z| in size (q <= 15, m = z - 8 s)."""
    group = torch.arange(q.values.shape[1]) // q.group_size
    return 4 * 2.0**-24 * (24 * q.scales.double().abs() + q.zeros.double().abs())[:, group]


def all_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of one causal forward over an empty cache of exactly T slots."""
    B, T = tokens.shape
    c = model.config
    cache = KVCache.allocate(c, B, T, model.dtype, torch.device("cpu"))
    slots = torch.arange(T).expand(B, T)
    return model(tokens, slots, CacheRead(cache.layers(None), slots, None))


def random_tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 384, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# 1. The layers against x @ W.T + bias, W from the definition


def random_quantized(mode: str, group_size: int | None, N: int, K: int, gen: torch.Generator) -> QuantizedWeight:
    """Random values, scales and zeros straight in the portable form (not through a quantizer)."""
    if mode == "int8":
        values = torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8)
        return QuantizedWeight(values, torch.rand(N, 1, generator=gen) * 0.01 + 1e-3)
    G = K // group_size
    values = torch.randint(-8, 8, (N, K), generator=gen, dtype=torch.int8)
    return QuantizedWeight(values, torch.rand(N, G, generator=gen) * 0.1 + 0.01, torch.randn(N, G, generator=gen) * 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("mode,group_size", [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)], ids=["int8", "int4_g32", "int4_g64", "int4_g128"])
def test_quantized_linear_equals_brute_force_product(mode, group_size, bias, dtype):
    """float32: within 1e-5 of |x| @ |W|.T + |b| per output (the magnitude the sums are made of;
    measured about 2e-7). bfloat16: within 2**-7 of it, four roundings to bfloat16 of 2**-9 each
    (the layer's scales, zeros and bias, and the output; measured about 1.5e-3)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{mode}{group_size}{bias}".encode()))
    N, K = 48, 256  # N a multiple of 16 (torch's int4 packing); K divisible by every group size
    q = random_quantized(mode, group_size, N, K, gen)
    b = torch.randn(N, generator=gen) if bias else None
    layer_class = Int8Linear if mode == "int8" else Int4Linear
    layer = layer_class(q, b, dtype, CPU)
    W = brute_dequantize(q)
    mag_W = magnitude(q)
    bound = 1e-5 if dtype == torch.float32 else 2.0**-7
    for shape in [(3, 5, K), (1, 1, K), (2, 1, K)]:  # many rows, one row, one row per batch entry
        x = torch.randn(shape, generator=gen).to(dtype)
        got = layer(x)
        assert got.shape == (*shape[:-1], N) and got.dtype == dtype
        expected = x.double() @ W.T
        mag = x.double().abs() @ mag_W.T
        if b is not None:
            expected, mag = expected + b.double(), mag + b.double().abs()
        assert ((got.double() - expected).abs() <= bound * mag).all(), (shape, ((got.double() - expected).abs() / mag).max().item())


# ---------------------------------------------------------------------------------------------
# 2. The quantizers


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_int8_round_trip_within_half_a_step(scale):
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(40, 96, generator=gen) * scale
    w[3] = 0.0  # an all-zero row must not divide by zero
    w[5, 17] = 50 * scale  # an outlier sets its row's step
    q = quantize_int8(w)
    assert q.values.dtype == torch.int8 and q.values.shape == w.shape and q.scales.shape == (40, 1) and q.zeros is None
    assert q.values.min() >= -127 and q.values.max() <= 127
    assert torch.isfinite(q.scales).all() and (q.scales > 0).all()
    # Symmetric: the largest magnitude of each non-zero row maps to +-127 exactly.
    assert (q.values[torch.arange(40) != 3].abs().amax(dim=1) == 127).all()
    step = q.scales.double()  # [N, 1]
    error = (w.double() - brute_dequantize(q)).abs()
    assert (error <= step / 2 + 1e-5 * step).all()  # slack: w / scale is rounded to float32 before round()
    assert (brute_dequantize(q)[3] == 0).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_within_half_a_step(group_size):
    gen = torch.Generator().manual_seed(group_size)
    N, K = 32, 256
    w = torch.randn(N, K, generator=gen) * 0.7 + 0.2
    w[1, :group_size] = 3.5  # a constant group: no division by zero, reproduced exactly
    q = quantize_int4(w, group_size)
    G = K // group_size
    assert q.values.dtype == torch.int8 and q.values.shape == (N, K) and q.scales.shape == (N, G) and q.zeros.shape == (N, G)
    assert q.values.min() >= -8 and q.values.max() <= 7
    assert torch.isfinite(q.scales).all() and torch.isfinite(q.zeros).all()
    # Asymmetric: every (non-constant) group uses both ends of the range.
    grouped = q.values.view(N, G, group_size)
    assert (grouped.amin(dim=-1) == -8).sum() >= N * G - 1 and (grouped.amax(dim=-1) == 7).sum() >= N * G - 1
    step = q.scales.double().repeat_interleave(group_size, dim=1)
    deq = brute_dequantize(q)
    error = (w.double() - deq).abs()
    # slack: the float32 roundings of (w - min) / step and of the stored zero
    assert (error <= step / 2 + 1e-5 * step + 1e-6 * (1 + w.double().abs())).all(), (error - step / 2).max().item()
    assert torch.allclose(deq[1, :group_size], torch.full((group_size,), 3.5, dtype=torch.float64), atol=1e-6)


def test_int8_hand_checked():
    w = torch.tensor(
        [
            [127.0, -3.0, 2.4, -0.6, 0.0, 126.6],  # scale 1: values are w rounded (half away impossible here)
            [254.0, -6.0, 4.8, -1.2, 0.0, 253.2],  # twice the first row: scale 2, the same values
            [-0.5, 0.2, 0.0, 0.0, 0.0, 0.0],  # the largest magnitude is negative: it maps to -127; 0.2 -> 50.8
            [0.0] * 6,
        ]
    )
    q = quantize_int8(w)
    assert q.values.tolist() == [[127, -3, 2, -1, 0, 127], [127, -3, 2, -1, 0, 127], [-127, 51, 0, 0, 0, 0], [0] * 6]
    assert torch.allclose(q.scales[:3, 0], torch.tensor([1.0, 2.0, 0.5 / 127]), rtol=1e-7)
    assert q.scales[3, 0] > 0 and (brute_dequantize(q)[3] == 0).all()
    assert torch.allclose(brute_dequantize(q)[0], torch.tensor([127.0, -3, 2, -1, 0, 127], dtype=torch.float64))


def test_int4_hand_checked():
    K = 32
    ramp = torch.cat([torch.arange(16.0), torch.arange(15.0, -1.0, -1.0)])  # 0..15..0: min 0, max 15, step 1
    off_grid = torch.zeros(K)
    off_grid[:5] = torch.tensor([15.0, 7.4, 7.6, 3.2, 0.49])  # min 0, max 15, step 1: rounds to 7, 8, 3, 0
    shifted = ramp * 0.5 - 3.0  # min -3, max 4.5: step 0.5
    q = quantize_int4(torch.stack([ramp, off_grid, shifted]), 32)
    assert q.values[0].tolist() == [v - 8 for v in range(16)] + [v - 8 for v in range(15, -1, -1)]
    assert q.values[1, :5].tolist() == [7, -1, 0, -5, -8] and (q.values[1, 5:] == -8).all()
    assert q.values[2].tolist() == q.values[0].tolist()
    assert torch.allclose(q.scales[:, 0], torch.tensor([1.0, 1.0, 0.5]))
    # zero = min + 8 * step, so that (v - 8 + 8) * step + min lands on the grid
    assert torch.allclose(q.zeros[:, 0], torch.tensor([8.0, 8.0, 1.0]))
    deq = brute_dequantize(q)
    assert torch.allclose(deq[0], ramp.double()) and torch.allclose(deq[2], shifted.double())
    assert torch.allclose(deq[1, :5], torch.tensor([15.0, 7, 8, 3, 0], dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# 3. GGUF's 4-bit blocks against gguf's own dequantizer


def q4_k_blocks(N: int, K: int, gen: np.random.Generator) -> np.ndarray:
    """Valid Q4_K rows [N, K/256 * 144]: float16 d and dmin, then 12 random bytes of 6-bit scales
    and mins and 128 random bytes of values (gguf-py cannot quantize Q4_K)."""
    n = N * (K // 256)
    d = (gen.uniform(1e-3, 1e-2, n) * gen.choice([-1, 1], n)).astype("<f2")
    dmin = gen.uniform(1e-3, 1e-2, n).astype("<f2")
    rest = gen.integers(0, 256, (n, 12 + 128), dtype=np.uint8)
    blocks = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), rest], axis=1)
    return blocks.reshape(N, -1)


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda k: k.name)
def test_gguf_blocks_dequantize_as_gguf_does(kind):
    """Q4_0 exactly (d * (q - 8) either way); Q4_1 and Q4_K to float32 rounding (float32_rounding_bound):
    the engine's (q - 8) * s + (m + 8 s) and gguf's q * s + m round differently."""
    gen = np.random.default_rng(int(kind))
    N, K = 16, 512
    if kind == Q.Q4_K:
        blocks = q4_k_blocks(N, K, gen)
    else:
        w = (gen.standard_normal((N, K)) * 0.05 + gen.uniform(-0.1, 0.1, (N, 1))).astype(np.float32)
        blocks = gguf.quants.quantize(w, kind)
    expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, kind), dtype=np.float32).reshape(N, K))
    q = int4_weight(blocks, kind, (N, K))
    assert q.values.dtype == torch.int8 and q.values.shape == (N, K) and q.scales.shape == (N, K // 32) and q.zeros.shape == (N, K // 32)
    assert q.values.min() >= -8 and q.values.max() <= 7
    got = brute_dequantize(q)
    if kind == Q.Q4_0:
        assert torch.equal(q.dequantize(), expected)
        assert torch.equal(got, expected.double())
    else:
        bound = float32_rounding_bound(q)
        assert ((got - expected.double()).abs() <= bound).all(), ((got - expected.double()).abs() / bound).max().item()
        assert ((q.dequantize().double() - expected.double()).abs() <= bound).all()
    if kind == Q.Q4_K:  # random scale bytes: all 64 values of the 6-bit fields, so every bit of the packing is used
        assert len(torch.unique(q.scales)) > N * K // 32 // 2


# ---------------------------------------------------------------------------------------------
# 4. Whole models against a float model carrying the dequantized weights


def reference_model(folder, mode: str, group_size: int = 32):
    """The float32 model of the checkpoint with every linear and the embedding replaced by the
    brute-force dequantization of its quantization: `mode` for the layers' linears, int8 for the
    LM head and the embedding (quantizing is row-local, so the fused matrices quantize as the
    loader's do)."""
    model = load_model(folder, torch.float32, CPU)

    def replaced(weight: torch.Tensor, how: str) -> nn.Parameter:
        q = quantize_int8(weight) if how == "int8" else quantize_int4(weight, group_size)
        return nn.Parameter(brute_dequantize(q).float(), requires_grad=False)

    for layer in model.layers:
        for name in LINEAR_NAMES:
            linear = layer.get_submodule(name)
            linear.weight = replaced(linear.weight, mode)
    model.embed.weight = replaced(model.embed.weight, "int8")  # a tied model: both are one table
    model.lm_head.weight = replaced(model.lm_head.weight, "int8")
    return model


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_bias"])
def test_quantized_model_equals_float_model_with_dequantized_weights(kind, mode, tiny_checkpoint):
    """Logits within 2e-5 of the largest |logit| (measured 2e-6 int8, 2e-7 int4): the same arithmetic up to
    float32 summation order."""
    folder, _ = tiny_checkpoint(kind)
    model = load_model(folder, torch.float32, CPU, quant=mode)
    expected_linear = Int8Linear if mode == "int8" else Int4Linear
    for layer in model.layers:
        for name in LINEAR_NAMES:
            assert type(layer.get_submodule(name)) is expected_linear, name
    assert type(model.lm_head) is Int8Linear and type(model.embed) is Int8Embedding
    if kind != "llama":  # the biases survive quantization
        assert model.layers[0].attn.wqkv.bias is not None
    tokens = random_tokens(2, 33, seed=3)
    got = all_logits(model, tokens)
    expected = all_logits(reference_model(folder, mode), tokens)
    assert got.shape == expected.shape == (2, 33, 400)
    err = (got - expected).abs().max().item()
    assert err <= 2e-5 * expected.abs().max().item(), err


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_int8_greedy_tokens_mostly_match_the_float_model(kind, tiny_checkpoint):
    """On 128 teacher-forced positions, int8's argmax is the float model's on at least 85% of them
    (measured 91% for llama, 94% for qwen2: these random models, initialised at 0.25, amplify
    any change of a weight) and the logits differ by at most 10% in relative L2 norm (measured 5%)."""
    folder, _ = tiny_checkpoint(kind)
    tokens = random_tokens(2, 64, seed=4)
    exact = all_logits(load_model(folder, torch.float32, CPU), tokens)
    quantized = all_logits(load_model(folder, torch.float32, CPU, quant="int8"), tokens)
    agree = (exact.argmax(-1) == quantized.argmax(-1)).float().mean().item()
    assert agree >= 0.85, agree
    assert (exact - quantized).norm() <= 0.1 * exact.norm()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_tied_embedding_and_lm_head_share_storage(mode, tiny_checkpoint):
    tied = load_model(tiny_checkpoint("qwen2")[0], torch.float32, CPU, quant=mode)
    assert tied.embed.weight.data_ptr() == tied.lm_head.weight.data_ptr()
    assert tied.embed.scales.data_ptr() == tied.lm_head.scales.data_ptr()
    assert tied.embed.weight.dtype == torch.int8
    untied = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU, quant=mode)
    assert untied.embed.weight.data_ptr() != untied.lm_head.weight.data_ptr()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_bfloat16_quantized_model_adds_no_error_beyond_bfloat16_activations(mode, tiny_checkpoint):
    """bfloat16 against float32 activations, both quantized: the relative L2 difference of the logits
    is at most 1.5 times that of the unquantized model's bfloat16 against float32 (measured 1.0-1.2
    times, about 3%): the layers' bfloat16 scales, zeros and bias cost no more than the activations'
    rounding does. The greedy argmax agrees on at least 85% of positions (measured 92-97%)."""
    folder, _ = tiny_checkpoint("qwen2")
    tokens = random_tokens(1, 40, seed=5)

    def difference(quant: str) -> tuple[float, float]:
        f32 = all_logits(load_model(folder, torch.float32, CPU, quant=quant), tokens)
        bf16 = all_logits(load_model(folder, torch.bfloat16, CPU, quant=quant), tokens)
        assert bf16.dtype == torch.bfloat16
        agree = (bf16.float().argmax(-1) == f32.argmax(-1)).float().mean().item()
        return ((bf16.float() - f32).norm() / f32.norm()).item(), agree

    baseline, _ = difference("none")
    relative, agree = difference(mode)
    assert relative <= 1.5 * baseline, (relative, baseline)
    assert agree >= 0.85, agree


# ---------------------------------------------------------------------------------------------
# 5. The compiled decode step


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_compiled_decode_step_with_quantized_layers_equals_eager(mode, tiny_checkpoint):
    """Greedy tokens of the compiled step (fullgraph, the int8/int4 kernels inside) equal eager's."""
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU, quant=mode)
    prompts = random_tokens(1, 9, seed=6).tolist() + random_tokens(1, 4, seed=7).tolist()
    eager = generate_tokens(model, prompts, 8, eos_ids=frozenset()).tokens
    compiled = generate_with(model, prompts, 8, eos_ids=frozenset(), options=RunOptions(compile=True)).tokens
    assert [len(t) for t in eager] == [8, 8]
    assert compiled == eager


# ---------------------------------------------------------------------------------------------
# 6. A quantized checkpoint imported from GGUF 4-bit blocks

# GGUF leaf -> block type: the attention in Q4_0, the MLP in Q4_1; layer 1's V in Q8_0 (no int4 form).
GGUF_TYPES = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_0, "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_1}


@pytest.fixture(scope="module")
def gguf_imports(tiny_checkpoint, tmp_path_factory):
    """(float import, quantized import) of one tiny Llama GGUF whose layer matrices are 4-bit blocks."""
    _, hf = tiny_checkpoint("llama")
    folder = tmp_path_factory.mktemp("q4_gguf")
    path = folder / "llama_q4.gguf"
    add_tensor = gguf.GGUFWriter.add_tensor

    def quantizing_add_tensor(self, name, tensor, raw_shape=None, raw_dtype=None, **kwargs):
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in GGUF_TYPES:
            kind = Q.Q8_0 if (parts[1], parts[2]) == ("1", "attn_v") else GGUF_TYPES[parts[2]]
            return add_tensor(self, name, gguf.quants.quantize(tensor, kind), raw_dtype=kind)
        return add_tensor(self, name, tensor, raw_shape, raw_dtype, **kwargs)

    with pytest.MonkeyPatch.context() as mp:  # test_gguf's writer, with 4-bit blocks for the layers' matrices
        mp.setattr(gguf.GGUFWriter, "add_tensor", quantizing_add_tensor)
        write_gguf(path, hf, "llama")
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == Q.Q4_0 and types["blk.0.ffn_down.weight"] == Q.Q4_1 and types["blk.1.attn_v.weight"] == Q.Q8_0
    assert types["token_embd.weight"] == Q.F32
    return import_gguf(path, folder / "float", progress=False), import_gguf(path, folder / "quantized", quantized=True, progress=False)


def test_gguf_quantized_checkpoint_stores_the_files_own_values(gguf_imports):
    """The int4 tensors of the quantized import dequantize to the float import's weights (which are
    gguf's dequantization): Q4_0 exactly, Q4_1 to float32 rounding (float32_rounding_bound)."""
    float_dir, quant_dir = gguf_imports
    assert QUANTIZED_KEY in json.loads((quant_dir / "config.json").read_text())
    with safe_open(float_dir / "model.safetensors", "pt") as f_float, safe_open(quant_dir / "model.safetensors", "pt") as f_quant:
        names = set(f_quant.keys())
        checked = 0
        for name in sorted(names):
            if not name.endswith(".zeros"):
                continue
            stem = name.removesuffix(".zeros")
            q = QuantizedWeight(f_quant.get_tensor(stem + ".weight"), f_quant.get_tensor(stem + ".scales"), f_quant.get_tensor(name))
            assert q.group_size == 32
            exact = f_float.get_tensor(stem + ".weight").double()
            got = brute_dequantize(q)
            if ".self_attn." in stem:  # Q4_0
                assert torch.equal(got, exact), stem
            else:  # Q4_1
                assert ((got - exact).abs() <= float32_rounding_bound(q)).all(), stem
            checked += 1
        assert checked == 13  # 7 matrices x 2 layers, less layer 1's V (Q8_0)
        assert "model.layers.1.self_attn.v_proj.zeros" not in names and f_quant.get_slice("model.layers.1.self_attn.v_proj.scales").get_shape() == [32, 1]
        assert "model.embed_tokens.zeros" not in names and f_quant.get_tensor("model.embed_tokens.weight").dtype == torch.int8


def test_gguf_quantized_checkpoint_logits_equal_float_import_with_the_same_weights(gguf_imports):
    """The quantized import runs the GGUF's own 4-bit values: its logits equal those of the float
    import in which only what the quantized import re-quantizes is replaced (the embedding and LM
    head, int8; layer 1's q|k|v, int8 because its V was Q8_0). Within 2e-5 of the largest |logit|
    (measured 3e-7); each int4 layer's weight, read back through its kernel as layer(I).T, within
    1e-6 of the float import's (measured: equal)."""
    float_dir, quant_dir = gguf_imports
    model = load_model(quant_dir, torch.float32, CPU)
    assert type(model.layers[0].attn.wqkv) is Int4Linear and type(model.layers[1].mlp.w_down) is Int4Linear
    assert type(model.layers[1].attn.wqkv) is Int8Linear  # Q4_0 q, k beside Q8_0 v: int8 per channel
    assert type(model.lm_head) is Int8Linear and type(model.embed) is Int8Embedding

    reference = load_model(float_dir, torch.float32, CPU)
    for module in (reference.embed, reference.lm_head, reference.layers[1].attn.wqkv):
        module.weight = nn.Parameter(brute_dequantize(quantize_int8(module.weight)).float(), requires_grad=False)
    # The layers kept in 4 bits compute with the float import's weights: check each through the kernel.
    for i, layer in enumerate(model.layers):
        for name in LINEAR_NAMES:
            linear = layer.get_submodule(name)
            if isinstance(linear, Int4Linear):
                eye = torch.eye(linear.in_features)
                w = reference.layers[i].get_submodule(name).weight
                assert (linear(eye).t() - w).abs().max() <= 1e-6 * w.abs().max(), (i, name)
    tokens = random_tokens(2, 21, seed=8)
    got, expected = all_logits(model, tokens), all_logits(reference, tokens)
    assert (got - expected).abs().max() <= 2e-5 * expected.abs().max()


# ---------------------------------------------------------------------------------------------
# 7. Errors


def test_int4_group_size_that_does_not_divide_the_mlp_is_a_user_error(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")  # intermediate size 160: groups of 32 only
    with pytest.raises(UserError) as error:
        load_model(folder, torch.float32, CPU, quant="int4", group_size=64)
    message = str(error.value)
    assert "--group-size 64" in message and "w_down" in message and "160 inputs, not a multiple of 64" in message
    assert "use --group-size 32" in message


def test_int4_group_size_hint_names_a_size_that_fits_the_whole_model(tiny_checkpoint):
    """--group-size 128 fails first on q|k|v (64 inputs), whose largest fit is 64; but 64 would then fail
    on w_down (160 inputs): the hint must be 32, the one size every matrix takes."""
    folder, _ = tiny_checkpoint("llama")
    with pytest.raises(UserError) as error:
        load_model(folder, torch.float32, CPU, quant="int4", group_size=128)
    assert "use --group-size 32" in str(error.value)


def test_quantizing_an_already_quantized_checkpoint_is_a_user_error(gguf_imports):
    _, quant_dir = gguf_imports
    for mode in ("int8", "int4"):
        with pytest.raises(UserError, match="already quantized") as error:
            load_model(quant_dir, torch.float32, CPU, quant=mode)
        assert "leave out --quant" in str(error.value)


def test_generate_rejects_a_group_size_outside_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--checkpoint", "/nonexistent", "--quant", "int4", "--group-size", "48", "--prompt", "x"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--group-size" in err and "invalid choice: 48" in err


def test_generate_reports_an_unfit_group_size_in_one_line(chat_checkpoint, capsys):
    code = generate.main(["--checkpoint", str(chat_checkpoint), "--quant", "int4", "--group-size", "64", "--prompt", "x", "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and "not a multiple of 64" in err


def test_a_saved_quantized_checkpoint_loads_as_the_model_quantized_at_load_time(tiny_checkpoint, tmp_path):
    """python -m weights.quantize writes what the loader reads back: the very layers --quant builds, whose
    logits are checked against brute force above; and its bad inputs are one clear error each."""
    from weights.quantize import save_quantized

    folder, _ = tiny_checkpoint("qwen2")
    saved = save_quantized(folder, tmp_path / "q4", "int4", 32)
    tokens = random_tokens(2, 9, seed=3)
    at_load = all_logits(load_model(folder, torch.float32, CPU, quant="int4"), tokens)
    assert torch.equal(all_logits(load_model(saved, torch.float32, CPU), tokens), at_load)
    with pytest.raises(UserError, match="already exists"):
        save_quantized(folder, saved, "int8")
    with pytest.raises(UserError, match="already quantized"):
        save_quantized(saved, tmp_path / "again", "int8")
    with pytest.raises(UserError, match="not a multiple of 64"):
        save_quantized(folder, tmp_path / "g64", "int4", 64)


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads the process's memory map (Linux)")
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_saved_quantized_untied_embedding_stays_in_the_file(mode, tiny_checkpoint, tmp_path):
    """Loaded from a checkpoint saved quantized, an untied int8 embedding table is a view of the
    memory-mapped file (only the rows looked up become resident: Qwen2.5-Coder-0.5B's is 136 MiB),
    every other weight a copy of its own, and the rows it looks up are those of a copy."""
    from weights.quantize import save_quantized

    saved = save_quantized(tiny_checkpoint("llama")[0], tmp_path / mode, mode, 32)
    model = load_model(saved, torch.float32, CPU)
    in_file, every_map_used = tensors_in_file(model, saved)
    assert in_file == {"embed.weight", "embed.scales"} and every_map_used  # the scales too: float32 is the file's dtype
    tokens = torch.randint(3, 384, (1, 12), generator=torch.Generator().manual_seed(3))
    embedded = model.embed(tokens)
    copied = Int8Embedding(model.embed.weight.clone(), model.embed.scales)
    assert torch.equal(embedded, copied(tokens))
