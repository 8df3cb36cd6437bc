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
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

import generate
from cli_features import ranks_running
from compression.config import POLICIES
from conftest import ALL_KINDS
from errors import UserError
from models.parallel import TensorParallel, shard_config, start
from parallel_ranks import Case, run_case
from weights.forms import load_model
from weights.sharding import load_rank
from weights.loader import read_config

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
    out = json.loads((tmp_path / "out.json").read_text())
    # gloo's threads end with the process group: one still running as the interpreter exits aborted
    # a rank (SIGABRT). A compiled step's traced graphs keep the group alive until exit (not fixed).
    if not any(case.compile for case in cases):
        assert not [name for name in out["threads_after_stop"] if "gloo" in name], out["threads_after_stop"]
    return out["cases"]


def assert_equal_to_one_process(cases: list[Case], tmp_path: Path) -> None:
    for case, result in zip(cases, run_ranks(cases, tmp_path), strict=True):
        assert result["ranks_agree"], case
        assert result["tokens"] == run_case(case, None), case


def test_every_architecture_gives_the_single_process_tokens(tiny_checkpoint, tmp_path):
    """Llama (tied, with biases, every RoPE scaling, 3 KV heads split 1 and 2), Mistral, Qwen2, Qwen3: greedy, float32."""
    cases = [Case(str(tiny_checkpoint(kind)[0])) for kind in ALL_KINDS]
    assert_equal_to_one_process(cases, tmp_path)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_with_nccl_and_cuda_graphs_give_the_single_gpu_tokens(tiny_checkpoint, tmp_path):
    llama, qwen3 = str(tiny_checkpoint("llama")[0]), str(tiny_checkpoint("qwen3")[0])
    cases = [
        Case(llama, device="cuda"),
        Case(llama, device="cuda", cuda_graph=True),
        Case(qwen3, new_tokens=40, dtype="float64", device="cuda", cuda_graph=True, policy="beacon"),
        Case(qwen3, new_tokens=40, dtype="float64", device="cuda", cuda_graph=True, continuous=True, policy="beacon"),
    ]
    assert_equal_to_one_process(cases, tmp_path)


def test_every_kv_policy_compresses_each_ranks_heads_as_one_process_does(tiny_checkpoint, tmp_path):
    """Each rank scores and compacts only its own KV heads; the kept slots are the single process's,
    the random policy's draws included. In float64: in float32 the ranks' sums round differently
    from one process's, and one near-tie in a selection (BeaconKV, llama_bias, the third prompt,
    token 24) then sends a run elsewhere; float64 shows that the logic itself is exact."""
    kinds = ("llama_bias", "qwen3", "llama_3kv")
    cases = [Case(str(tiny_checkpoint(kind)[0]), new_tokens=40, dtype="float64", policy=policy) for kind in kinds for policy in POLICIES if policy != "none"]
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


@pytest.mark.parametrize("kind", ["llama_bias", "qwen2", "qwen3", "llama_3kv"])
def test_each_rank_loads_only_its_block_of_each_tensor(tiny_checkpoint, kind):
    """Put back together, the ranks' shards are the whole model's tensors: q/k/v and gate/up by
    output rows, o_proj and down_proj by input columns, the vocabulary by rows; the row-split
    layers' biases on rank 0 only. 3 KV heads go 1 and 2. The ranks' shares add up to the weights."""
    folder = tiny_checkpoint(kind)[0]
    whole = load_model(folder, torch.float32, CPU)
    ranks = [load_rank(folder, torch.float32, CPU, TensorParallel(r, 2, None)) for r in range(2)]

    def qkv_blocks(model) -> list[list[torch.Tensor]]:
        c = model.config
        sizes = [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim]
        return [list(t.split(sizes)) for t in (model.state_dict()[n] for n in names if n.endswith(("wqkv.weight", "wqkv.bias")))]

    names = list(whole.state_dict())
    joined = [[torch.cat(pieces) for pieces in zip(*blocks)] for blocks in zip(*(qkv_blocks(r) for r in ranks))]
    assert all(torch.equal(a, b) for got, want in zip(joined, qkv_blocks(whole)) for a, b in zip(got, want))
    for name, tensor in whole.state_dict().items():
        parts = [r.state_dict()[name] for r in ranks]
        if name.endswith(("w_gate_up.weight", "w_gate_up.bias")):
            gates, ups = zip(*(p.chunk(2) for p in parts))
            assert torch.equal(torch.cat(gates + ups), tensor)
        elif name.endswith(("wo.weight", "w_down.weight")):
            assert torch.equal(torch.cat(parts, dim=1), tensor)
        elif name.endswith(("wo.bias", "w_down.bias")):
            assert torch.equal(parts[0], tensor) and not parts[1].any()
        elif name in ("embed.weight", "lm_head.weight"):
            assert torch.equal(torch.cat(parts), tensor)
        elif not name.endswith(("wqkv.weight", "wqkv.bias")):
            assert all(torch.equal(p, tensor) for p in parts), name
    replicated = sum(p.numel() for name, p in whole.named_parameters() if "norm" in name or name.endswith(("wo.bias", "w_down.bias")))
    held = [sum(p.numel() for p in model.parameters()) - replicated for model in (whole, *ranks)]  # a tied table counts once
    assert held[1] + held[2] == held[0]
    if kind != "llama_3kv":
        assert held[1] == held[2]


def test_generate_py_under_torchrun_prints_one_answer_the_single_process_one(chat_checkpoint, capsys):
    argv = ["--checkpoint", str(chat_checkpoint), "--max-new-tokens", "16", "--dtype", "float32", "--temperature", "0"]
    assert generate.main(argv + ["--prompt", "Tell me about the fox"]) == 0
    single = capsys.readouterr().out
    done = torchrun("generate.py", *argv, stdin="Tell me about the fox")  # stdin: read by rank 0 only
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == single
    assert done.stderr.count("prompt tokens:") == 1  # rank 0's summary alone


def test_shard_config_gives_each_rank_whole_kv_heads_and_refuses_more_ranks_than_kv_heads(tiny_checkpoint):
    config = read_config(tiny_checkpoint("qwen3")[0])
    half = shard_config(config, TensorParallel(1, 2, None))
    assert (half.n_heads, half.n_kv_heads, half.intermediate_size, half.vocab_size) == (2, 1, 80, 400)
    three = read_config(tiny_checkpoint("llama_3kv")[0])
    assert [(shard_config(three, TensorParallel(r, 2, None)).n_heads, shard_config(three, TensorParallel(r, 2, None)).n_kv_heads) for r in range(2)] == [(2, 1), (4, 2)]
    with pytest.raises(UserError, match="4 ranks cannot split this model's 2 key-value heads: each rank holds whole KV heads; start at most 2 ranks"):
        shard_config(config, TensorParallel(0, 4, None))
    with pytest.raises(UserError, match="2 ranks cannot split this model's vocabulary of 401 into equal blocks; start a number of ranks that divides it: 1"):
        shard_config(replace(config, vocab_size=401), TensorParallel(0, 2, None))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def by_hand(commands: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """One process per rank, each started by hand as a launcher on another machine would start
    it (no torchrun here to end the others when one fails); their outcomes, by rank. A rank still
    running 30 s after rank 0 has ended is killed."""
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(len(commands))}
    ranks = [
        subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r, command in enumerate(commands)
    ]
    outputs = []
    try:
        for rank, timeout in zip(ranks, [TIMEOUT_S] + [30] * len(ranks)):
            try:
                outputs.append(rank.communicate(timeout=timeout))
            except subprocess.TimeoutExpired:
                rank.kill()
                outputs.append(rank.communicate())
    finally:
        for rank in ranks:
            rank.kill()
    return [subprocess.CompletedProcess(rank.args, rank.wait(), out, err) for rank, (out, err) in zip(ranks, outputs)]


def generate_py(chat_checkpoint: Path, *argv: str) -> list[str]:
    return [sys.executable, "generate.py", "--checkpoint", str(chat_checkpoint), "--prompt", "hi", "--dtype", "float32", *argv]


def joins_then(then: str) -> list[str]:
    """A rank that joins the others and then does `then` instead of its part."""
    return [sys.executable, "-c", "import torch.distributed as dist; dist.init_process_group('gloo'); " + then]


def test_more_ranks_than_kv_heads_get_one_clear_error_each(chat_checkpoint):
    done = by_hand([generate_py(chat_checkpoint)] * 3)
    assert [d.returncode for d in done] == [2] * 3
    assert [d.stderr for d in done] == ["error: 3 ranks cannot split this model's 2 key-value heads: each rank holds whole KV heads; start at most 2 ranks\n"] * 3


def test_a_rank_that_dies_ends_the_others_with_a_clear_error(chat_checkpoint):
    done = by_hand([generate_py(chat_checkpoint), joins_then("import os; os._exit(1)")])[0]
    assert done.returncode == 2
    assert done.stderr.startswith("error: rank 0 of 2: a collective with the other ranks failed (")
    assert "another rank died, hung past --rank-timeout" in done.stderr


def test_a_rank_that_finished_leaves_cleanly_when_another_has_died():
    """The barrier before teardown fails without the dead rank; the rank whose run is done still exits 0."""
    finished = "import torch; from models import parallel; tp, _ = parallel.start(torch.device('cpu'), 10); parallel.stop(tp, finished=True); print('left')"
    done = by_hand([[sys.executable, "-c", finished], joins_then("import os; os._exit(1)")])[0]
    assert (done.returncode, done.stdout) == (0, "left\n")


def test_a_rank_that_hangs_ends_the_others_after_the_rank_timeout(chat_checkpoint):
    done = by_hand([generate_py(chat_checkpoint, "--rank-timeout", "3"), joins_then("import time; time.sleep(600)")])[0]
    assert done.returncode == 2
    assert done.stderr.startswith("error: rank 0 of 2: a collective with the other ranks failed (")
    assert "Timed out" in done.stderr


def test_only_a_collectives_failure_becomes_the_one_line_error():
    with pytest.raises(UserError, match=r"^rank 1 of 2: a collective with the other ranks failed \(\[third_party/gloo/pair.cc:5\] Connection closed by peer\); "):
        with ranks_running(TensorParallel(1, 2, None)):
            raise RuntimeError("[third_party/gloo/pair.cc:5] Connection closed by peer\nmore")
    with pytest.raises(RuntimeError, match="shape mismatch"):  # a bug keeps its traceback
        with ranks_running(TensorParallel(1, 2, None)):
            raise RuntimeError("shape mismatch")


def test_a_device_without_a_backend_is_refused():
    with pytest.raises(UserError, match="no backend for meta devices"):
        start(torch.device("meta"), 10)


@pytest.mark.skipif(torch.distributed.is_nccl_available(), reason="this torch has NCCL")
def test_cuda_without_nccl_is_refused():
    with pytest.raises(UserError, match="no NCCL"):
        start(torch.device("cuda"), 10)


def test_quantized_weights_and_the_chat_are_refused_under_tensor_parallelism(chat_checkpoint, capsys, monkeypatch):
    with pytest.raises(UserError, match="tensor parallelism runs 16/32-bit weights only"):
        load_rank(chat_checkpoint, torch.float32, CPU, TensorParallel(0, 2, None), quant="int8")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert generate.main(["--checkpoint", str(chat_checkpoint), "-i"]) == 2
    assert "--interactive reads stdin on one process; under torchrun give --prompt or --prompt-file" in capsys.readouterr().err


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2", "qwen-coder"])
def test_real_models_give_the_single_process_tokens(name, packaged_model, tmp_path):
    """SmolLM2 (3 KV heads: 1 and 2 per rank) and Qwen2.5-Coder, chat and plain prompts, with and
    without BeaconKV, float32. (In bfloat16 the ranks agree with each other but not always with one
    process: each rank's partial sum is rounded before the all-reduce adds them.)"""
    from test_real_models import CHATS, PLAIN
    from weights.tokenizer import Tokenizer

    folder = packaged_model(name)[1]
    tokenizer = Tokenizer.from_dir(folder)
    prompts = tuple(tuple(tokenizer.encode_chat([{"role": "user", "content": c}])) for c in CHATS) + tuple(tuple(tokenizer.encode(p)) for p in PLAIN)
    cases = [Case(str(folder), new_tokens=48, policy=policy, prompts=prompts, budget=24) for policy in ("none", "beacon")]
    assert_equal_to_one_process(cases, tmp_path)


def test_bench_py_under_torchrun_reports_each_ranks_share(tiny_checkpoint, tmp_path):
    """Against the same command on one rank: the two ranks' KV caches add up to the whole one, and
    their weights read per step to the whole model's plus what both read (the norms, one
    embedding row each)."""
    folder = tiny_checkpoint("llama")[0]
    argv = ["bench.py", "--checkpoint", str(folder), "--prompt-len", "16", "--new-tokens", "8", "--trials", "2", "--no-compile", "--dtype", "float32"]
    figures = {}
    for ranks in (1, 2):
        done = torchrun(*argv, "--json", str(tmp_path / f"{ranks}.json"), ranks=ranks)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.count("tensor parallel:") == 1 and done.stdout.count("decode:") == 1  # rank 0's table alone
        figures[ranks] = json.loads((tmp_path / f"{ranks}.json").read_text())["ranks"]
    (whole,), halves = figures[1], figures[2]
    assert [r["kv_heads"] for r in halves] == [1, 1] and whole["kv_heads"] == 2
    assert sum(r["kv_cache_bytes"] for r in halves) == whole["kv_cache_bytes"]
    model = load_model(folder, torch.float32, CPU)
    norms = sum(p.nbytes for name, p in model.named_parameters() if "norm" in name)
    embedding_row = model.config.hidden_size * 4
    assert sum(r["weight_bytes"] for r in halves) == whole["weight_bytes"] + norms + embedding_row
    assert all(len(r["trials"]) == 2 and r["peak_mem_bytes"] > 0 for r in halves)
