"""The decode loop: ragged batches, per-row EOS, the compiled step, the static cache."""

import pytest
import torch

from engine.generation import Session, run
from engine.options import RunOptions, generate
from kv.cache import KVCache
from engine.sampling import SamplingConfig
from errors import UserError
from weights.forms import load_model

CPU = torch.device("cpu")


def prompts_of(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_ragged_batch_equals_separate_runs(kind, tiny_checkpoint):
    model = load_model(tiny_checkpoint(kind)[0], torch.float32, CPU)
    prompts = prompts_of([5, 23, 12])
    batch = generate(model, prompts, 24, eos_ids=frozenset()).tokens
    alone = [generate(model, [p], 24, eos_ids=frozenset()).tokens[0] for p in prompts]
    assert batch == alone


def test_a_row_that_hits_eos_stops_while_the_others_continue(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    prompts = prompts_of([8, 15], seed=1)
    free = generate(model, prompts, 20, eos_ids=frozenset()).tokens
    # Declare as EOS a token that row 0 produces at step k (first time) and row 1 never does.
    k, eos = next((i, t) for i, t in enumerate(free[0]) if i >= 2 and t not in free[0][:i] and t not in free[1])
    seen: list[dict[int, int | None]] = []
    result = generate(model, prompts, 20, eos_ids=frozenset({eos}), on_tokens=seen.append)
    assert result.tokens[0] == free[0][:k]
    assert result.tokens[1] == free[1]
    assert [step.get(0) for step in seen[:k]] == free[0][:k] and seen[k][0] is None  # its end, told once
    assert all(0 not in step for step in seen[k + 1 :]) and [step[1] for step in seen[:20]] == free[1]
    assert seen[-1] == {1: None}  # the other row's end, at the token limit


def test_compiled_step_with_fullgraph_equals_eager(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3")[0], torch.float32, CPU)
    prompts = prompts_of([7, 19, 3], seed=2)
    eager = generate(model, prompts, 16, eos_ids=frozenset()).tokens
    compiled = generate(model, prompts, 16, eos_ids=frozenset(), options=RunOptions(compile=True)).tokens
    assert compiled == eager


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_one_compiled_graph_serves_every_group_of_blocks(kind, tiny_checkpoint, monkeypatch):
    """Regional compilation (torch.compile's runner, which every cache kind but the plain one takes):
    with one block per group, both layers run the code compiled for the first (their weights and
    cache layers are the graph's inputs), and give the eager tokens."""
    import engine.block_groups
    import engine.compile
    from torch._dynamo.utils import counters

    monkeypatch.setattr(engine.block_groups, "BLOCKS_PER_GROUP", 1)
    model = load_model(tiny_checkpoint(kind)[0], torch.float32, CPU)
    groups, one_graph = engine.compile.compile_blocks(model)
    assert len(model.layers) == 2 and groups.size == 1 and one_graph
    prompts = prompts_of([9, 4], seed=6)
    eager = generate(model, prompts, 12, eos_ids=frozenset()).tokens
    torch._dynamo.reset()
    counters.clear()
    cache = KVCache.allocate(model.config, len(prompts), 9 + 12, torch.float32, CPU)
    assert run(Session(model, cache, eos_ids=frozenset(), runner=engine.compile.Compiled()), prompts, 12).tokens == eager
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize(
    ("layers", "size"),
    [
        ("a" * 30, 6), ("a" * 24, 6), ("a" * 28, 4), ("aa", 2), ("a" * 7, 1),
        ("ab" * 12, 6),  # alternating: still one graph, of six blocks
        ("aab" * 7, 3),
        ("aab" * 7 + "abb", 6),  # two graphs, as with one block per call, in 4 calls instead of 24
        ("aababbaaaaabbabbabbababb", 1),  # Qwen2.5-Coder's Q4_K_M layers (b: int8 down projection)
    ],
)
def test_the_groups_split_the_layers_evenly_into_the_fewest_graphs(layers, size):
    from engine.block_groups import group_size

    assert group_size(list(layers)) == size


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_layers_of_two_structures_compile_to_a_graph_each_and_give_the_eager_tokens(kind, tiny_checkpoint, monkeypatch):
    """A GGUF file with mixed block types (Q4_K_M) imports some layers' matrices as int8 and the
    others' as int4. Every step must run each layer's own graph: the steps after the first once
    skipped the guards that choose between them, and failed."""
    import engine.block_groups
    import engine.compile
    from models.quantized import quantize_int8, quantized_linear

    monkeypatch.setattr(engine.block_groups, "BLOCKS_PER_GROUP", 1)  # one block per group: a group of each structure
    model = load_model(tiny_checkpoint(kind)[0], torch.float32, CPU, "int4", 32)  # float32: the same tokens, not only close ones
    mlp = model.layers[1].mlp
    weight = torch.randn(mlp.w_down.out_features, mlp.w_down.in_features, generator=torch.Generator().manual_seed(3)) * 0.05
    mlp.w_down = quantized_linear(quantize_int8(weight), None, torch.float32, CPU)
    groups, one_graph = engine.compile.compile_blocks(model)
    assert groups.size == 1 and not one_graph
    prompts = prompts_of([9, 4], seed=6)
    eager = generate(model, prompts, 12, eos_ids=frozenset()).tokens
    torch._dynamo.reset()
    assert generate(model, prompts, 12, eos_ids=frozenset(), options=RunOptions(compile=True)).tokens == eager


def test_runs_of_different_lengths_share_one_compiled_step(tiny_checkpoint):
    """torch.compile's runner (engine/saved_step.py's package has its own test)."""
    from torch._dynamo.utils import counters
    from engine.compile import Compiled

    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    torch._dynamo.reset()
    counters.clear()
    for prompts, new_tokens in ((prompts_of([7], seed=7), 10), (prompts_of([30], seed=8), 25)):
        cache = KVCache.allocate(model.config, 1, len(prompts[0]) + new_tokens, torch.float32, CPU)
        result = run(Session(model, cache, eos_ids=frozenset(), runner=Compiled()), prompts, new_tokens)
        assert result.tokens == generate(model, prompts, new_tokens, eos_ids=frozenset()).tokens
    assert counters["stats"]["unique_graphs"] == 1


def test_compiled_step_stays_right_across_workloads_in_one_process(tiny_checkpoint):
    """After its first call the loop skips the compiled step's guards: each of several compiled
    versions (other batch sizes, other cache sizes) must still be the one that runs."""
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    workloads = [(prompts_of([7, 19, 3], seed=4), 12), (prompts_of([11], seed=5), 30), (prompts_of([7, 19, 3], seed=4), 12)]
    for prompts, new_tokens in workloads:
        eager = generate(model, prompts, new_tokens, eos_ids=frozenset()).tokens
        assert generate(model, prompts, new_tokens, eos_ids=frozenset(), options=RunOptions(compile=True)).tokens == eager


def test_seeded_sampling_reproduces_and_differs_across_seeds(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    prompts = prompts_of([10, 4], seed=3)
    sampling = SamplingConfig(temperature=1.5, top_k=40, top_p=0.95)

    def run(seed):
        torch.manual_seed(seed)
        return generate(model, prompts, 24, eos_ids=frozenset(), sampling=sampling).tokens

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_cache_is_allocated_once_for_prompt_plus_new_tokens(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    result = generate(model, prompts_of([9, 30]), 12, eos_ids=frozenset())
    c = model.config
    assert result.kv_cache_bytes == 2 * c.n_layers * 2 * c.n_kv_heads * (30 + 12) * c.head_dim * 4
    assert result.decode_steps == 11 and [len(t) for t in result.tokens] == [12, 12]


def test_prompt_plus_new_tokens_beyond_the_model_maximum_is_refused(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    with pytest.raises(UserError, match="exceeds the model's maximum of 512 positions"):
        generate(model, prompts_of([500]), 13, eos_ids=frozenset())


def test_cuda_graph_on_a_cpu_model_is_refused(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    with pytest.raises(UserError, match="CUDA graphs need the model on a CUDA device"):
        generate(model, [[3, 4]], 4, eos_ids=frozenset(), options=RunOptions(cuda_graph=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reading_only_the_slots_in_use_gives_the_logits_of_the_whole_buffer(dtype, tiny_checkpoint):
    """The eager loop attends over a bounded view of the cache; the compiled step over the whole
    buffer. Both runs are fed the same tokens (teacher forcing): in bfloat16 the two reads round
    differently on some CPUs, and runs that each decode greedily part at the first near-tie."""
    from engine.decode import StepState, decode_step, prefill
    from kv.cache import KVCache

    model = load_model(tiny_checkpoint("qwen2")[0], dtype, CPU)
    prompts = prompts_of([9, 4, 14], seed=2)
    forced = torch.tensor(prompts_of([20, 20, 20], seed=3)).T  # [steps, B] the tokens fed at each step
    runs = {}
    for n_read in ("bounded", "whole"):
        cache = KVCache.allocate(model.config, 3, 64, dtype, CPU)
        prefill(model, cache, prompts)
        finished, eos = torch.zeros(3, dtype=torch.bool), torch.tensor([-1])
        logits = []
        for step, fed in enumerate(forced):
            bound = 14 + step + 1 if n_read == "bounded" else None
            logits.append(decode_step(model, cache, StepState(fed.clone(), finished, eos, SamplingConfig()), n_read=bound))
        runs[n_read] = torch.stack(logits).float()
    # float32: the same sums in another blocking; bfloat16: a few units in the last place of logits ~8.
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (runs["bounded"] - runs["whole"]).abs().max().item() <= tolerance * runs["whole"].abs().max().item()


AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
STALE_STEP_SCRIPT = """
import sys, torch
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from tests.test_engine import prompts_of
from engine.generation import Session, run
from engine.options import RunOptions, generate
from kv.cache import KVCache
from weights.forms import load_model
model = load_model(Path(sys.argv[3]), torch.float32, torch.device("cpu"))
prompts = prompts_of([7, 19, 3], seed=2)
with torch.inference_mode():
    eager = generate(model, prompts, 12, eos_ids=frozenset()).tokens
    compiled = generate(model, prompts, 12, eos_ids=frozenset(), options=RunOptions(compile=True)).tokens
print(compiled == eager)
"""


@pytest.mark.skipif(not AVX512, reason="needs a CPU on which torch picks its AVX-512 kernels")
def test_a_step_compiled_under_avx512_is_not_reused_under_avx2(tiny_checkpoint, tmp_path):
    """Inductor's on-disk cache does not key on ATEN_CPU_CAPABILITY: without the engine's vector
    width option, the AVX2 run below reused the AVX-512 step and emitted wrong tokens."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("ATEN_CPU_CAPABILITY", None)
    args = [sys.executable, "-c", STALE_STEP_SCRIPT, str(repo), str(repo / "tests"), str(tiny_checkpoint("qwen3")[0])]
    for capability in ("avx512", "avx2"):
        done = subprocess.run(args, env={**env, "ATEN_CPU_CAPABILITY": capability}, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "True", capability


def test_compiled_step_with_a_repetition_penalty_equals_eager(tiny_checkpoint):
    """The penalty's [B, V] mask of seen tokens is updated inside the step: it must compile with
    fullgraph (the CPU-side proof that a CUDA graph can capture it) and give eager's tokens."""
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    prompts = prompts_of([7, 12], seed=6)
    penalty = SamplingConfig(repetition_penalty=1.8)
    eager = generate(model, prompts, 16, eos_ids=frozenset(), sampling=penalty).tokens
    assert generate(model, prompts, 16, eos_ids=frozenset(), sampling=penalty, options=RunOptions(compile=True)).tokens == eager
    assert eager != generate(model, prompts, 16, eos_ids=frozenset()).tokens
