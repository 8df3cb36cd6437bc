"""The CUDA path, checked on a machine without CUDA.

What a CUDA run hands torch's int4/int8 kernels and flash-attn is recorded on a fake device (the
engine's non-CPU branches run on FakeTensors of the meta device) and held against those kernels'
own checks (tests/cuda_kernel_rules.py). flash-attn's decode call runs on CPU through the same
custom op with a stand-in kernel that computes what flash-attn documents, eager and compiled.
"""

import contextlib
import math
import time
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import cli
import cli_features
import engine.generation
import kv.flash as flash_attention
from cuda_kernel_rules import RULES, failed_checks
from engine.decode import StepState, decode_step, prefill
from kv.paged import PageConfig, PagedKVCache
from engine.sampling import RowSampling, SamplingConfig, sample
from errors import UserError
from models.config import ModelConfig
from kv.cache import KVCache
from kv.quantized import kv_storage
from models.quantized import Int4Linear, QuantizedWeight, cuda_int4_inner_k_tiles, quantized_linear
from models.transformer import Transformer
from weights.forms import load_model
from weights.sharding import load_rank
from weights.loader import read_config

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # named only, never touched: the checks below run before any tensor goes there
META = torch.device("meta")  # not the CPU: the layers take their CUDA branch


class KernelCalls(TorchDispatchMode):
    """Records every call of a kernel tests/cuda_kernel_rules.py knows, with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in RULES:
            self.calls.append((str(func), tuple(args) + tuple((kwargs or {}).values())))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fake_device():
    with FakeTensorMode(allow_non_fake_inputs=True), KernelCalls() as recorded:
        yield recorded


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every linear weight [N, K] of the model, by name."""
    with torch.device("meta"):
        model = Transformer(config)
    return {name: (m.out_features, m.in_features) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def layer_calls(layers: list[tuple[int, int, str, int]], dtype: torch.dtype, rows: tuple[int, ...] = (1, 3, 16, 40)) -> KernelCalls:
    """Builds each quantized layer (N, K, mode, group size) for a non-CPU device and runs it on
    `rows` rows of activations in `dtype`, on the fake device: the kernel calls a CUDA run makes."""
    with fake_device() as recorded:
        for n, k, mode, group in layers:
            groups = 1 if mode == "int8" else k // group
            weight = QuantizedWeight(torch.zeros(n, k, dtype=torch.int8), torch.ones(n, groups), None if mode == "int8" else torch.zeros(n, groups))
            layer = quantized_linear(weight, None, dtype, META)
            for m in rows:
                layer(torch.zeros(m, k, dtype=dtype, device=META))
    return recorded


def int4_layers(config: ModelConfig, group: int) -> list[tuple[int, int, str, int]]:
    return [(n, k, "int4", group) for name, (n, k) in linear_shapes(config).items() if name != "lm_head" and k % group == 0]


@pytest.mark.parametrize("in_features, tiles", [(576, 4), (1536, 8), (896, 8), (4864, 8), (64, 4), (160, 2), (96, 2)])
def test_inner_k_tiles_are_the_most_that_divide_the_inputs(in_features, tiles):
    assert cuda_int4_inner_k_tiles(in_features) == tiles


def test_inputs_no_packing_divides_are_one_clear_error():
    with pytest.raises(UserError, match="48 inputs cannot be packed for CUDA"):
        cuda_int4_inner_k_tiles(48)


@pytest.mark.parametrize(("kind", "group"), [("llama", 32), ("llama", 64), ("qwen3", 32), ("llama_3kv", 32), ("llama_bias", 32)])
def test_int4_and_int8_layers_pass_torchs_cuda_checks(kind, group, tiny_checkpoint):
    """Every matrix of the tiny checkpoints (K = 64, 96, 160), packed and multiplied as on CUDA.
    Packed 8 inner k-tiles at a time, as before, K = 64 failed torch's check."""
    config = read_config(tiny_checkpoint(kind)[0])
    layers = int4_layers(config, group) + [(n, k, "int8", 0) for n, k in linear_shapes(config).values()]
    recorded = layer_calls(layers, torch.bfloat16)
    assert {name for name, _ in recorded.calls} >= {"aten._convert_weight_to_int4pack.default", "aten._weight_int4pack_mm.default", "aten._weight_int8pack_mm.default"}
    assert failed_checks(recorded.calls) == []


def test_int8_never_copies_its_weight_for_a_decode_step():
    """A decode step's few rows go to torch's int8 kernel; a prefill's many rows to a float copy."""
    recorded = layer_calls([(64, 128, "int8", 0)], torch.bfloat16, rows=(1, 8, 16))
    assert [name for name, _ in recorded.calls] == ["aten._weight_int8pack_mm.default"] * 3
    assert layer_calls([(64, 128, "int8", 0)], torch.bfloat16, rows=(17,)).calls == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_int4_weights_under_other_activations_are_refused_on_cuda_before_any_kernel(dtype, tiny_checkpoint):
    weight = QuantizedWeight(torch.zeros(64, 64, dtype=torch.int8), torch.ones(64, 2), torch.zeros(64, 2))
    with pytest.raises(UserError, match="bfloat16 activations only.*use --dtype bfloat16"):
        Int4Linear(weight, None, dtype, CUDA)
    with pytest.raises(UserError, match="bfloat16 activations only"):
        load_model(tiny_checkpoint("llama")[0], dtype, CUDA, quant="int4")
    recorded = layer_calls([(64, 64, "int4", 32)], dtype)  # what the kernel would have been handed
    assert "A.dtype() == at::kBFloat16" in " ".join(failed_checks(recorded.calls))


# --- flash-attn ---------------------------------------------------------------------------------


def flash_attn_reference(q, k_cache, v_cache, cache_seqlens, block_table=None):
    """What flash_attn_with_kvcache computes, from its documentation: q [B, 1, H, D]; the cache
    [B, S, H_kv, D], or pages [n_blocks, block, H_kv, D] read through block_table [B, max_blocks];
    each row attends over its first cache_seqlens slots; query head h reads KV head h // (H / H_kv)."""
    assert RULES["engine.flash_decode.default"](q, k_cache, v_cache, cache_seqlens, block_table) == []
    if block_table is not None:
        k_cache, v_cache = (pages[block_table.long()].flatten(1, 2) for pages in (k_cache, v_cache))  # [B, max_blocks * block, H_kv, D]
    groups = q.shape[2] // k_cache.shape[2]
    k, v = (c.repeat_interleave(groups, dim=2).float() for c in (k_cache, v_cache))  # [B, S, H, D]
    scores = torch.einsum("bqhd,bshd->bhqs", q.float(), k) / math.sqrt(q.shape[-1])
    readable = torch.arange(k.shape[1]) < cache_seqlens[:, None].long()  # [B, S]
    scores = scores.masked_fill(~readable[:, None, None, :], float("-inf"))
    return torch.einsum("bhqs,bshd->bqhd", scores.softmax(-1), v).to(q.dtype)


@pytest.fixture
def flash_on_cpu(monkeypatch):
    """flash-attn 2.8.3 'installed' with the reference as its kernel, which torch.compile cannot
    trace (as it cannot trace the real one's C++ call), and the CPU taken for a CUDA device."""
    monkeypatch.setattr(flash_attention, "kernel", torch.compiler.disable(flash_attn_reference))
    monkeypatch.setattr(flash_attention, "flash_attn", types.SimpleNamespace(__version__="2.8.3"))
    why_not = flash_attention.why_not_flash
    monkeypatch.setattr(flash_attention, "why_not_flash", lambda device, *rest: why_not(CUDA, *rest))


def teacher_forced_logits(model, cache, prompts, steps: torch.Tensor, groups=None) -> torch.Tensor:
    prefill(model, cache, prompts)
    batch = len(prompts)
    finished, eos = torch.zeros(batch, dtype=torch.bool), torch.tensor([-1])
    return torch.stack([decode_step(model, cache, StepState(fed.clone(), finished, eos, SamplingConfig(), blocks=groups)) for fed in steps]).float()


def prompts_of(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


def bf16_prefill_attention_runs() -> bool:
    """torch 2.13 on an AMX CPU run with ATEN_CPU_CAPABILITY=avx2 (CI's second pass) packs bf16
    SDPA operands for AMX from kernels built without AVX-512, and fails from 64 query rows on."""
    q = torch.zeros(1, 1, 64, 16, dtype=torch.bfloat16)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    except RuntimeError as error:
        if "pack_vnni2" in str(error):
            return False
        raise
    return True


@pytest.mark.skipif(not bf16_prefill_attention_runs(), reason="torch's bf16 SDPA fails on an AMX CPU forced to its AVX2 kernels")
@pytest.mark.parametrize("paged", [False, True])
def test_the_flash_decode_call_computes_the_sdpa_attention(paged, tiny_checkpoint, monkeypatch):
    """The engine's flash-attn call (layout, cache_seqlens, block table, GQA) against the reference
    kernel, fed the same tokens as the SDPA path."""
    model = load_model(tiny_checkpoint("qwen3")[0], torch.bfloat16, CPU)
    prompts, steps = prompts_of([9, 300, 17], seed=4), torch.tensor(prompts_of([12, 12, 12], seed=5)).T

    def cache():
        if not paged:
            return flash_attention.FlashKVCache.allocate(model.config, 3, 512, torch.bfloat16, CPU)
        pool = PagedKVCache.allocate(model.config, 3, 512, torch.bfloat16, CPU, PageConfig(block_size=256))
        for row, prompt in enumerate(prompts):
            pool.fit(row, len(prompt) + len(steps))
        return pool

    with_sdpa = teacher_forced_logits(model, cache(), prompts, steps)
    taken = []
    monkeypatch.setattr(flash_attention, "kernel", lambda *a, **k: taken.append(1) or flash_attn_reference(*a, **k))
    monkeypatch.setattr(flash_attention, "flash_attn", types.SimpleNamespace(__version__="2.8.3"))
    why_not = flash_attention.why_not_flash
    monkeypatch.setattr(flash_attention, "why_not_flash", lambda device, *rest: why_not(CUDA, *rest))
    with_flash = teacher_forced_logits(model, cache(), prompts, steps)
    assert len(taken) == len(steps) * model.config.n_layers
    assert (with_flash - with_sdpa).abs().max().item() <= 2e-2 * with_sdpa.abs().max().item()


def test_a_compiled_step_traces_the_flash_decode_call(tiny_checkpoint, flash_on_cpu):
    """fullgraph compilation holds the flash-attn call as the custom op; called directly, the
    kernel (which dynamo cannot trace) failed the compile."""
    from engine.compile import compile_blocks

    model = load_model(tiny_checkpoint("qwen3")[0], torch.bfloat16, CPU)
    prompts, steps = prompts_of([9, 30, 17], seed=2), torch.tensor(prompts_of([6, 6, 6], seed=3)).T
    eager = teacher_forced_logits(model, flash_attention.FlashKVCache.allocate(model.config, 3, 64, torch.bfloat16, CPU), prompts, steps)
    groups, _ = compile_blocks(model)
    compiled = teacher_forced_logits(model, flash_attention.FlashKVCache.allocate(model.config, 3, 64, torch.bfloat16, CPU), prompts, steps, groups)
    assert (compiled - eager).abs().max().item() <= 2e-2 * eager.abs().max().item()


def test_the_flash_decode_op_passes_torchs_custom_op_checks():
    q = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 32, 16, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))  # [B, S, H_kv, D] views
    lengths = torch.tensor([5, 32], dtype=torch.int32)
    original = flash_attention.kernel
    try:
        flash_attention.kernel = flash_attn_reference
        torch.library.opcheck(flash_attention.flash_decode_op, (q, k, v, lengths, None), test_utils=("test_schema", "test_faketensor"))
    finally:
        flash_attention.kernel = original


@pytest.mark.parametrize(
    ("q_dtype", "cache_dtype", "block", "version", "reason"),
    [
        (torch.bfloat16, torch.bfloat16, None, "2.8.3", None),
        (torch.float16, torch.float16, 256, "2.8.3.post1", None),
        (torch.float32, torch.bfloat16, None, "2.8.3", "the model computes in float32 and the cache holds bfloat16"),
        (torch.bfloat16, torch.float16, None, "2.8.3", "one dtype for both"),
        (torch.float32, torch.float32, None, "2.8.3", "float16 and bfloat16 only"),
        (torch.bfloat16, None, None, "2.8.3", "quantized codes"),
        (torch.bfloat16, torch.bfloat16, 16, "2.8.3", "--block-size 256"),
        (torch.bfloat16, torch.bfloat16, 256, "2.8.4", "syncs with the host"),
        (torch.bfloat16, torch.bfloat16, None, "2.8.4", None),  # the contiguous path has no such read
    ],
)
def test_flash_is_taken_only_where_its_checks_pass(monkeypatch, q_dtype, cache_dtype, block, version, reason):
    monkeypatch.setattr(flash_attention, "kernel", flash_attn_reference)
    monkeypatch.setattr(flash_attention, "flash_attn", types.SimpleNamespace(__version__=version))
    why = flash_attention.why_not_flash(CUDA, q_dtype, cache_dtype, 64, block, store=False)
    assert why is None if reason is None else reason in why


def test_flash_is_never_taken_on_cpu(monkeypatch):
    monkeypatch.setattr(flash_attention, "kernel", flash_attn_reference)
    assert flash_attention.why_not_flash(CPU, torch.bfloat16, torch.bfloat16, 64, None, store=False) == "flash-attn runs on CUDA only"


@pytest.mark.parametrize(
    ("package", "reason"),
    [
        (None, "flash-attn is not installed (the `cuda` extra)"),
        ("raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c10')", "flash-attn failed to import (flash_attn_2_cuda.so: undefined symbol: _ZN3c10)"),
    ],
)
def test_a_missing_or_broken_flash_attn_is_named_as_such(package, reason, tmp_path):
    """Without the package, and with one built for another torch (its extension fails to load)."""
    import subprocess
    import sys
    from pathlib import Path

    setup = "import sys; sys.modules['flash_attn'] = None"
    if package is not None:
        (tmp_path / "flash_attn").mkdir()
        (tmp_path / "flash_attn" / "__init__.py").write_text(package + "\n")
        setup = f"import sys; sys.path.insert(0, {str(tmp_path)!r})"
    code = f"{setup}; sys.path.insert(0, {str(Path(__file__).parent.parent)!r}); import kv.flash as f; print(f.MISSING)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == reason


def test_the_scripts_name_the_attention_path_on_cuda_and_why(tiny_checkpoint, monkeypatch):
    config = read_config(tiny_checkpoint("llama")[0])
    assert cli_features.attention_line(CPU, torch.bfloat16, config, "auto", None, 0) is None
    monkeypatch.setattr(flash_attention, "kernel", None)
    assert "SDPA, not flash-attn: flash-attn" in cli_features.attention_line(CUDA, torch.bfloat16, config, "auto", None, 0)
    monkeypatch.setattr(flash_attention, "kernel", flash_attn_reference)
    monkeypatch.setattr(flash_attention, "flash_attn", types.SimpleNamespace(__version__="2.8.3"))
    assert cli_features.attention_line(CUDA, torch.bfloat16, config, "auto", PageConfig(256), 0) == "attention: flash-attn in decode steps through the block table, SDPA in prefill"
    assert "quantized codes" in cli_features.attention_line(CUDA, torch.bfloat16, config, "k8v4", None, 0)
    assert "--kv-store" in cli_features.attention_line(CUDA, torch.bfloat16, config, "auto", None, 64)


def flash_calls(config: ModelConfig, model_dtype: torch.dtype, kv_dtype: str, block: int | None) -> KernelCalls:
    """The flash-attn call a decode step makes over the engine's own cache buffers, on the fake device."""
    cache_dtype, bits, _ = kv_storage(kv_dtype, model_dtype)
    with fake_device() as recorded:
        if block is None:
            layer = KVCache.allocate(config, 2, 512, cache_dtype, META).layers(None)[0]  # flash-attn reads floats only
            table = None
        else:
            cache = PagedKVCache.allocate(config, 2, 512, cache_dtype, META, PageConfig(block), bits=bits)
            layer, table = cache.layers(None)[0], cache.block_table
        q = torch.empty(2, config.n_heads, 1, config.head_dim, dtype=model_dtype, device=META)
        flash_attention.flash_decode(q, layer.k, layer.v, torch.ones(2, dtype=torch.int64, device=META), table)
    return recorded


@pytest.mark.parametrize("block", [None, 256])
def test_the_flash_call_over_the_engines_buffers_passes_its_checks(block, tiny_checkpoint):
    config = read_config(tiny_checkpoint("llama_3kv")[0])
    recorded = flash_calls(config, torch.bfloat16, "auto", block)
    assert [name for name, _ in recorded.calls] == ["engine.flash_decode.default"]
    assert failed_checks(recorded.calls) == []


# --- sampling under a CUDA graph -----------------------------------------------------------------

SETTINGS = [
    SamplingConfig(temperature=0.8, top_k=5),
    SamplingConfig(temperature=1.2, top_p=0.6, repetition_penalty=1.3),
    SamplingConfig(temperature=0.7, min_p=0.2),
    SamplingConfig(repetition_penalty=1.5),
    SamplingConfig(),
    SamplingConfig(temperature=1.0, top_k=3, top_p=0.9, min_p=0.05, repetition_penalty=1.1),
]


def test_static_sampling_follows_the_rows_settings_whatever_the_host_copy_says():
    """A CUDA graph captured while every row was greedy replays that step's work. With static
    settings the work does not depend on the host copy: a row's new settings, written to the
    tensors alone, are what it samples by, as the eager step does."""
    g = torch.Generator().manual_seed(0)
    batch, vocab = len(SETTINGS), 50
    logits = torch.randn(batch, vocab, generator=g) * 3
    seen = torch.rand(batch, vocab, generator=g) < 0.2
    positions = torch.arange(batch) + 7
    eager = RowSampling(SETTINGS, CPU, seeded=True)
    captured = RowSampling([SamplingConfig()] * batch, CPU, seeded=True)
    captured.static = True
    frozen_host_copy = list(captured.configs)
    for row, config in enumerate(SETTINGS):
        eager.seeds[row] = row
        captured.set_row(row, config, seed=row)
    captured.configs = frozen_host_copy  # what the capture saw
    for step in range(5):
        expected = sample(logits, eager, seen, positions + step)
        assert torch.equal(sample(logits, captured, seen, positions + step), expected)
    assert not torch.equal(expected, logits.argmax(-1))  # the sampled rows did not decode greedily


# --- the timing of a CUDA graph's capture --------------------------------------------------------


def test_the_first_step_which_captures_the_graph_is_timed_apart(tiny_checkpoint, monkeypatch):
    """A stand-in capture (CUDA's needs a GPU) that takes 0.2 s: the session times it as the
    first step's, which the decode rate leaves out."""
    def capture(step, state):
        time.sleep(0.2)
        return step

    import engine.cuda_graph
    from kv.cache import KVCache

    monkeypatch.setattr(engine.cuda_graph, "capture_decode_step", capture)
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    cache = KVCache.allocate(model.config, 1, 32, torch.float32, CPU)
    session = engine.generation.Session(model, cache, eos_ids=frozenset(), runner=engine.cuda_graph.Graph())
    session.prefill([[5, 6, 7]])
    assert session.setup_s == 0.0
    session.step()
    first = session.setup_s
    session.step()
    assert first >= 0.2 and session.setup_s == first
    result = engine.generation.GenerationResult([[1] * 11], 3, 0.1, first + 1.0, 10, 0, 0, setup_s=first)
    assert result.decode_tok_s == pytest.approx(9 / 1.0)


# --- tensor parallelism with the bundled model ---------------------------------------------------


def test_the_bundled_model_under_torchrun_runs_its_float_import(monkeypatch, tmp_path):
    import weights.packaged

    asked = []
    monkeypatch.setattr(weights.packaged, "smollm2_checkpoint", lambda quantized: asked.append(quantized) or tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.checkpoint_and_quant(None, "auto", 32) == (tmp_path, "none")
    assert cli.checkpoint_and_quant(None, "int4", 32) == (tmp_path, "int4")  # asked for: refused by the loader, by its flag
    assert asked == [False, False]


def test_a_quantized_checkpoint_under_torchrun_is_refused_without_naming_a_flag_not_given(tiny_checkpoint, tmp_path):
    from models.parallel import TensorParallel
    from weights.quantize import save_quantized

    saved = save_quantized(tiny_checkpoint("llama")[0], tmp_path / "q8", "int8")
    with pytest.raises(UserError) as refused:
        load_rank(saved, torch.float32, CPU, TensorParallel(0, 2, None))
    assert "stored quantized" in str(refused.value) and "--quant" not in str(refused.value)
    with pytest.raises(UserError, match="drop --quant int8"):
        load_rank(tiny_checkpoint("llama")[0], torch.float32, CPU, TensorParallel(0, 2, None), quant="int8")


# --- every CLI combination for both packaged models: the tables of docs/gpu.md -----------------

QUANTS, DTYPE_NAMES = ("auto", "none", "int8", "int4"), ("auto", "bfloat16", "float16", "float32")
CACHES = {"contiguous": None, "paged, 256-slot blocks (the CUDA default)": 256, "paged, --block-size 16": 16}
GPU_DOC = "docs/gpu.md"
TABLES_START, TABLES_END = "<!-- tables written by tests/test_cuda_rules.py -->", "<!-- end of the written tables -->"


def quantized_layers(checkpoint, quant: str) -> list[tuple[int, int, str, int]]:
    """The quantized layers load_model builds for the checkpoint (N, K, mode, group size)."""
    from models.quantized import Int8Linear

    model = load_model(checkpoint, torch.bfloat16, CPU, quant)
    layers = []
    for module in model.modules():
        if isinstance(module, Int4Linear):
            layers.append((module.out_features, module.in_features, "int4", module.group_size))
        elif isinstance(module, Int8Linear):
            layers.append((module.out_features, module.in_features, "int8", 0))
    return layers


def weights_row(model_arg: str | None, quant: str, dtype_name: str, layers_of) -> str:
    """What a CUDA run of `generate.py [--checkpoint X] --quant Q --dtype D` hands torch's kernels."""
    try:
        checkpoint, load_quant = cli.checkpoint_and_quant(model_arg, quant, 32)
        dtype = cli.pick_dtype(dtype_name, checkpoint, CUDA, load_quant)
        layers = layers_of(checkpoint, load_quant)
        modes = [mode for _, _, mode, _ in layers]
        if "int4" in modes:
            from models.quantized import check_int4_activations

            check_int4_activations(CUDA, dtype)
        fails = failed_checks(layer_calls(layers, dtype, rows=(1, 8)).calls)
        assert fails == [], fails
    except UserError as e:
        return f"refused before any kernel: {e}"
    if not layers:
        return f"{str(dtype).removeprefix('torch.')}; float weights (cuBLAS)"
    tiles = sorted({cuda_int4_inner_k_tiles(k) for _, k, mode, _ in layers if mode == "int4"})
    int4 = f"{modes.count('int4')} int4 (inner k-tiles {'/'.join(map(str, tiles))}), " if tiles else ""
    return f"{str(dtype).removeprefix('torch.')}; {int4}{modes.count('int8')} int8: every check passes"


def attention_cell(configs: list[ModelConfig], dtype: torch.dtype, kv_dtype: str, block: int | None) -> str:
    cache_dtype, bits, _ = kv_storage(kv_dtype, dtype)
    reasons = {flash_attention.why_not_flash(CUDA, dtype, None if bits else cache_dtype, c.head_dim, block, store=False) for c in configs}
    assert len(reasons) == 1
    reason = reasons.pop()
    if reason is not None:
        return f"SDPA: {reason}"
    for config in configs:
        fails = failed_checks(flash_calls(config, dtype, kv_dtype, block).calls)
        assert fails == [], fails
    return "flash-attn"


def gpu_tables(packaged_model, monkeypatch) -> str:
    monkeypatch.setattr(flash_attention, "kernel", flash_attn_reference)
    monkeypatch.setattr(flash_attention, "flash_attn", types.SimpleNamespace(__version__="2.8.3"))
    qwen = packaged_model("qwen-coder")[1]
    layers_cache = {}

    def layers_of(checkpoint, quant):
        if (checkpoint, quant) not in layers_cache:
            layers_cache[checkpoint, quant] = quantized_layers(checkpoint, quant)
        return layers_cache[checkpoint, quant]

    lines = ["| model | --quant | --dtype | on CUDA |", "|---|---|---|---|"]
    for name, arg in (("SmolLM2-135M (bundled)", None), ("Qwen2.5-Coder-0.5B (--checkpoint)", str(qwen))):
        for quant in QUANTS:
            for dtype_name in DTYPE_NAMES:
                lines.append(f"| {name} | {quant} | {dtype_name} | {weights_row(arg, quant, dtype_name, layers_of)} |")
    configs = [read_config(cli.checkpoint_and_quant(None, "none", 32)[0]), read_config(qwen)]
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    lines += ["", "| --kv-dtype | cache | " + " | ".join(f"model in {str(d).removeprefix('torch.')}" for d in dtypes) + " |", "|---|---|---|---|---|"]
    for kv_dtype in ("auto", "bf16", "f16", "f32", "int8", "int4", "k8v4"):
        for cache, block in CACHES.items():
            lines.append(f"| {kv_dtype} | {cache} | " + " | ".join(attention_cell(configs, d, kv_dtype, block) for d in dtypes) + " |")
    return "\n".join(lines) + "\n"


@pytest.mark.real
def test_every_cli_combination_hands_the_cuda_kernels_what_they_accept(packaged_model, monkeypatch):
    """Both packaged models, every --quant x --dtype and every --kv-dtype x cache: each is refused
    with one clear error before any kernel runs, or every kernel call passes its checks. The
    tables are docs/gpu.md's, between its markers (REWRITE_GPU_DOC=1 rewrites them)."""
    import os
    from pathlib import Path

    tables = gpu_tables(packaged_model, monkeypatch)
    path = Path(__file__).parent.parent / GPU_DOC
    doc = path.read_text()
    start, end = doc.index(TABLES_START) + len(TABLES_START), doc.index(TABLES_END)
    if os.environ.get("REWRITE_GPU_DOC"):
        path.write_text(doc[:start] + "\n" + tables + doc[end:])
        return
    assert doc[start:end] == "\n" + tables, f"{GPU_DOC}'s tables are out of date; rewrite them: REWRITE_GPU_DOC=1 pytest -m real -k every_cli"
