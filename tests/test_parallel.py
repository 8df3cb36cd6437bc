"""Tensor parallelism: 2 gloo processes on CPU against the single-process engine.

The processes are started by torchrun in a subprocess, with a timeout, so that a hang fails the
test instead of stalling the suite. The reference for every token is the engine in one process
(itself checked against transformers elsewhere); the reference for every shard is the whole
checkpoint tensor it was cut from.
"""

import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import generate
from compression.config import POLICIES
from conftest import ALL_KINDS
from errors import UserError
from models.parallel import TensorParallel, shard_config, start
from parallel_ranks import Case, run_case
from weights.loader import load_model, read_config

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}
CPU = torch.device("cpu")


def torchrun(*argv: str, ranks: int = 2, stdin: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=ENV, cwd=REPO, input=stdin)


def run_ranks(cases: list[Case], tmp_path: Path) -> list[dict]:
    (tmp_path / "cases.json").write_text(json.dumps([asdict(c) for c in cases]))
    done = torchrun(str(REPO / "tests" / "parallel_ranks.py"), str(tmp_path / "cases.json"), str(tmp_path / "out.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "out.json").read_text())


def assert_equal_to_one_process(cases: list[Case], tmp_path: Path) -> None:
    for case, result in zip(cases, run_ranks(cases, tmp_path), strict=True):
        assert result["ranks_agree"], case
        assert result["tokens"] == run_case(case, None), case


def test_every_architecture_gives_the_single_process_tokens(tiny_checkpoint, tmp_path):
    """Llama (tied, with biases, every RoPE scaling), Mistral, Qwen2, Qwen3: greedy, float32."""
    cases = [Case(str(tiny_checkpoint(kind)[0])) for kind in ALL_KINDS]
    assert_equal_to_one_process(cases, tmp_path)


def test_every_kv_policy_compresses_each_ranks_heads_as_one_process_does(tiny_checkpoint, tmp_path):
    """Each rank scores and compacts only its own KV heads; the kept slots are the single process's,
    the random policy's draws included. In float64: in float32 the ranks' sums round differently
    from one process's, and one near-tie in a selection (BeaconKV, llama_bias, the third prompt,
    token 24) then sends a run elsewhere; float64 shows that the logic itself is exact."""
    cases = [Case(str(tiny_checkpoint(kind)[0]), new_tokens=40, dtype="float64", policy=policy) for kind in ("llama_bias", "qwen3") for policy in POLICIES if policy != "none"]
    assert_equal_to_one_process(cases, tmp_path)


def test_compiled_step_paged_cache_continuous_batching_and_sampling(tiny_checkpoint, tmp_path):
    llama, qwen2 = str(tiny_checkpoint("llama")[0]), str(tiny_checkpoint("qwen2")[0])
    cases = [
        Case(llama, compile=True),
        # With a KV policy in float64, as above.
        Case(qwen2, new_tokens=40, dtype="float64", compile=True, policy="beacon"),
        Case(llama, new_tokens=40, dtype="float64", paged=True, policy="beacon"),
        Case(qwen2, new_tokens=40, dtype="float64", continuous=True, policy="beacon"),
        Case(llama, temperature=0.8),  # sampled: every rank draws the same token from the same logits
        # bfloat16: each rank's partial sum is rounded before the sum, so the tokens drift from one
        # process's on this random model within a few; what must hold is that the ranks agree.
        Case(qwen2, dtype="bfloat16"),
    ]
    results = run_ranks(cases, tmp_path)
    assert all(r["ranks_agree"] for r in results)
    for case, result in zip(cases[:-1], results[:-1]):
        assert result["tokens"] == run_case(case, None), case


@pytest.mark.parametrize("kind", ["llama_bias", "qwen2", "qwen3"])
def test_each_rank_loads_only_its_block_of_each_tensor(tiny_checkpoint, kind):
    """Put back together, the ranks' shards are the whole model's tensors: q/k/v and gate/up by
    output rows, o_proj and down_proj by input columns, the vocabulary by rows; the row-split
    layers' biases on rank 0 only. Each rank holds about half the weights."""
    folder = tiny_checkpoint(kind)[0]
    whole = load_model(folder, torch.float32, CPU).state_dict()
    ranks = [load_model(folder, torch.float32, CPU, parallel=TensorParallel(r, 2, None)).state_dict() for r in range(2)]
    config = read_config(folder)
    D, H, H_kv = config.head_dim, config.n_heads, config.n_kv_heads

    def qkv_blocks(t: torch.Tensor, ranks: int = 1) -> list[torch.Tensor]:
        return list(t.split([H * D // ranks, H_kv * D // ranks, H_kv * D // ranks]))

    for name, tensor in whole.items():
        parts = [r[name] for r in ranks]
        if name.endswith(("wqkv.weight", "wqkv.bias")):
            halves = [qkv_blocks(p, 2) for p in parts]
            assert all(torch.equal(torch.cat([halves[0][i], halves[1][i]]), block) for i, block in enumerate(qkv_blocks(tensor)))
        elif name.endswith(("w_gate_up.weight", "w_gate_up.bias")):
            gates, ups = zip(*(p.chunk(2) for p in parts))
            assert torch.equal(torch.cat(gates + ups), tensor)
        elif name.endswith(("wo.weight", "w_down.weight")):
            assert torch.equal(torch.cat(parts, dim=1), tensor)
        elif name.endswith(("wo.bias", "w_down.bias")):
            assert torch.equal(parts[0], tensor) and not parts[1].any()
        elif name in ("embed.weight", "lm_head.weight"):
            assert torch.equal(torch.cat(parts), tensor)
        else:
            assert all(torch.equal(p, tensor) for p in parts), name
    norms = sum(t.numel() for name, t in whole.items() if "norm" in name or name.endswith(("wo.bias", "w_down.bias")))
    total = sum(t.numel() for name, t in whole.items() if name != "embed.weight" or not config.tie_word_embeddings)
    held = sum(t.numel() for name, t in ranks[1].items() if name != "embed.weight" or not config.tie_word_embeddings)
    assert held == (total - norms) // 2 + norms


def test_generate_py_under_torchrun_prints_one_answer_the_single_process_one(chat_checkpoint, capsys):
    argv = ["--checkpoint", str(chat_checkpoint), "--max-new-tokens", "16", "--dtype", "float32", "--temperature", "0"]
    assert generate.main(argv + ["--prompt", "Tell me about the fox"]) == 0
    single = capsys.readouterr().out
    done = torchrun("generate.py", *argv, stdin="Tell me about the fox")  # stdin: read by rank 0 only
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == single
    assert done.stderr.count("prompt tokens:") == 1  # rank 0's summary alone


def test_ranks_that_do_not_divide_the_kv_heads_get_one_clear_error_each(chat_checkpoint):
    done = torchrun("generate.py", "--checkpoint", str(chat_checkpoint), "--prompt", "hi", ranks=3)
    assert done.returncode != 0
    assert done.stderr.count("error: 3 ranks cannot split this model's 2 key-value heads evenly; start a number of ranks that divides it: 1, 2") == 3


def test_shard_config_splits_heads_and_mlp_and_refuses_an_uneven_split(tiny_checkpoint):
    config = read_config(tiny_checkpoint("qwen3")[0])
    half = shard_config(config, 2)
    assert (half.n_heads, half.n_kv_heads, half.intermediate_size, half.vocab_size) == (2, 1, 80, 400)
    with pytest.raises(UserError, match="4 ranks cannot split this model's 2 key-value heads"):
        shard_config(config, 4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_processes(chat_checkpoint: Path, other_rank: str, *argv: str) -> subprocess.CompletedProcess:
    """generate.py as rank 0 of 2, started by hand as a second machine's launcher would; rank 1 runs `other_rank`."""
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    joined = "import torch.distributed as dist; dist.init_process_group('gloo'); "
    other = subprocess.Popen([sys.executable, "-c", joined + other_rank], env={**env, "RANK": "1", "LOCAL_RANK": "1"}, cwd=REPO)
    try:
        command = [sys.executable, "generate.py", "--checkpoint", str(chat_checkpoint), "--prompt", "hi", "--dtype", "float32", *argv]
        return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env={**env, "RANK": "0", "LOCAL_RANK": "0"}, cwd=REPO)
    finally:
        other.kill()
        other.wait()


def test_a_rank_that_dies_ends_the_others_with_a_clear_error(chat_checkpoint):
    done = rank_processes(chat_checkpoint, "import os; os._exit(1)")
    assert done.returncode == 2
    assert done.stderr.startswith("error: rank 0 of 2: a collective with the other ranks failed (")
    assert "another rank died, hung past --rank-timeout" in done.stderr


def test_a_rank_that_hangs_ends_the_others_after_the_rank_timeout(chat_checkpoint):
    done = rank_processes(chat_checkpoint, "import time; time.sleep(600)", "--rank-timeout", "3")
    assert done.returncode == 2
    assert done.stderr.startswith("error: rank 0 of 2: a collective with the other ranks failed (")
    assert "Timed out" in done.stderr


def test_a_device_without_a_backend_is_refused():
    with pytest.raises(UserError, match="no backend for meta devices"):
        start(torch.device("meta"))


@pytest.mark.skipif(torch.distributed.is_nccl_available(), reason="this torch has NCCL")
def test_cuda_without_nccl_is_refused():
    with pytest.raises(UserError, match="no NCCL"):
        start(torch.device("cuda"))


def test_quantized_weights_and_the_chat_are_refused_under_tensor_parallelism(chat_checkpoint, capsys, monkeypatch):
    with pytest.raises(UserError, match="tensor parallelism runs 16/32-bit weights only"):
        load_model(chat_checkpoint, torch.float32, CPU, quant="int8", parallel=TensorParallel(0, 2, None))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert generate.main(["--checkpoint", str(chat_checkpoint), "-i"]) == 2
    assert "--interactive reads stdin on one process; under torchrun give --prompt or --prompt-file" in capsys.readouterr().err
