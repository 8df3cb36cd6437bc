"""The evaluation harness (evaluate.py and evaluation/) on tiny random checkpoints."""

import itertools
import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import evaluate
from compression.config import POLICIES, CompressionConfig
from errors import UserError
from evaluation import full_pass
from evaluation.config import QUICK, QUICK_COMPRESSION, TASKS, EvalConfig
from evaluation.bytes_report import bytes_tables, equal_bytes_table, points
from evaluation.future_attention import FullAttention, RecallShares, full_cache_compactions, future_attention_recall
from evaluation.metrics import CostResult, Results, RetrievalResult
from evaluation.runs import Batch, Compaction, full_cache_pass, recorder, run_all, run_from_start
from evaluation.saving import sole_writer
from evaluation.tasks import DISTANCE_BUCKETS, Row, reasoning_trace
from engine.decode import prefill
from engine.options import RunOptions, generate
from kv.cache import KVCache
from tiny_tokenizer import write_tiny_tokenizer
from weights.forms import load_model
from weights.tokenizer import Tokenizer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_folder(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny Llama checkpoint with the tiny tokenizer: what --model PATH expects."""
    folder = tmp_path_factory.mktemp("eval_model")
    shutil.copytree(tiny_checkpoint("llama")[0], folder, dirs_exist_ok=True)
    write_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_model(tiny_folder):
    return load_model(tiny_folder, torch.float32, CPU)


def random_batch(lengths=(7, 12, 9), length=60, free=(False, False, True), seed=0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n, is_free in zip(lengths, free):
        prompt = torch.randint(3, 380, (n,), generator=g).tolist()
        forced = [] if is_free else torch.randint(3, 380, (length,), generator=g).tolist()
        rows.append(Row("continuation" if is_free else "text", prompt, forced))
    return Batch(rows, length)


def small_config(folder: Path, budget: int = 10, **overrides) -> EvalConfig:
    fields = dict(
        checkpoint=folder, policies=tuple(p for p in POLICIES if p != "none"), budgets=(budget,), hysteresis=4, window=4,
        n_beacon=4, n_recent=4, aggregation="max", tasks=TASKS, dtype="float32", out=Path("unused"), sizes=QUICK,
    )  # fmt: skip
    return EvalConfig(**(fields | overrides))


def test_quick_run_writes_tables_json_and_plot(tiny_folder, tmp_path, capsys):
    # The tiny tokenizer spends ~3x the tokens of a real one on a line: longer streams than --quick's.
    combination, quantized = "streaming:kv_dtype=int4:store_slots=32:recall_pages=1", "none:kv_dtype=int8"
    code = evaluate.main(["--model", str(tiny_folder), "--quick", "--policies", ",".join([*POLICIES, combination, quantized]), "--length", "330", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, captured.err
    for title in ("Retrieval", "Future-attention recall", "Streaming loss", "Continuation fidelity", "Cost", "Quality against KV bytes"):
        assert title in out
    assert "| streaming + int4 cache + int4 store 32 + recall_pages=1 | 33 |" in out
    assert "| full cache in int8 |  | 62.5% |" in out  # (16 bytes of codes + 4 of scales) / 32, head_dim 16
    assert (tmp_path / "results.md").read_text() + "\n" == out
    for plot in ("quality_vs_budget.png", "quality_vs_bytes.png"):
        assert (tmp_path / plot).stat().st_size > 10_000
    data = json.loads((tmp_path / "results.json").read_text())
    budget = str(round(QUICK_COMPRESSION[0][0] * 330))
    for policy in POLICIES[1:]:
        assert 0 <= data["retrieval"][policy][budget]["success"] <= 1
        assert 0 <= data["attention"][policy][budget]["evictable"] <= 1
        assert data["loss"][policy][budget]["n_tokens"] > 0
        assert data["cost"][policy][budget]["tokens_per_s"] > 0
    assert data["attention"]["none"][budget]["evictable"] == 1.0
    # Every recalled value lies far beyond streaming's reach, and in the full cache.
    assert set(data["retrieval"]["none"]["full"]["kept"]) == {1.0}
    assert set(data["retrieval"]["streaming"][budget]["kept"]) == {0.0}
    assert data["loss"]["none"][budget]["nll"] == data["loss"]["none"][budget]["nll_full"]


def test_a_missing_packaged_model_names_the_command_that_makes_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(evaluate, "CHECKPOINTS", tmp_path)
    assert evaluate.main(["--model", "qwen-coder", "--quick"]) == 2
    assert "python -m weights.packaged qwen-coder" in capsys.readouterr().err


def test_teacher_forcing_gives_the_log_probs_of_one_prefill_over_the_stream(tiny_folder, tiny_model):
    model = tiny_model
    batch = random_batch(free=(False, False, False))
    state, _ = run_from_start(model, batch, recorder(small_config(tiny_folder), batch))
    for b, row in enumerate(batch.rows):
        sequence = row.prompt + row.forced
        cache = KVCache.allocate(model.config, 1, len(sequence), torch.float32, CPU)
        logits = prefill(model, cache, [sequence], all_logits=True)[0].log_softmax(-1)
        P = len(row.prompt)
        expected = logits[torch.arange(P - 1, len(sequence) - 1), torch.tensor(row.forced)]
        torch.testing.assert_close(state.logprob[b], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("policy", ["none", "beacon", "snapkv"])
def test_a_free_row_decodes_as_generate_does(tiny_folder, tiny_model, policy):
    model = tiny_model
    batch = random_batch()
    config = small_config(tiny_folder)
    compression = recorder(config, batch) if policy == "none" else config.compression(policy, 10)
    state, compactions = run_from_start(model, batch, compression)
    alone = generate(model, [batch.prompts[2]], batch.length, eos_ids=frozenset(), options=RunOptions(compression=compression if policy != "none" else CompressionConfig()))
    assert state.predicted[2].tolist() == alone.tokens[0]
    assert len(compactions) == (0 if policy == "none" else alone.compression.compactions)


def test_resuming_from_the_full_cache_snapshot_equals_running_from_the_start(tiny_folder, tiny_model):
    model = tiny_model
    batch = random_batch()
    variants = ("beacon:heads_agree=1", "beacon:fps_per_group=true", "beacon:lazy_refresh=false", "beacon:prefix_budget=2:prefix_tail=2")
    by_attention = ("h2o", "maxattn", "streaming:store_slots=16:recall_pages=1:store_drops=least_attended")  # each resumes from its record
    config = small_config(tiny_folder, policies=("beacon", "rpc", "tova", *by_attention, *variants))
    runs = {}
    run_all(model, batch, config, lambda run: runs.setdefault((run.policy, run.budget), run))
    for policy in config.policies:
        state, compactions = run_from_start(model, batch, config.compression(policy, 10))
        resumed = runs[(policy, 10)]
        assert resumed.predicted.tolist() == state.predicted.tolist()
        torch.testing.assert_close(resumed.logprob, state.logprob, atol=1e-5, rtol=0)
        assert [c.step for c in resumed.compactions] == [c.step for c in compactions]
        assert all(torch.equal(a.kept, b.kept) for a, b in zip(resumed.compactions, compactions))
        assert all(torch.equal(a.watched, b.watched) for a, b in zip(resumed.compactions, compactions))


def test_a_saved_full_pass_gives_every_cell_what_the_computed_one_gives(tiny_folder, tiny_model, tmp_path):
    """A resumed run loads the full cache's pass instead of decoding it again: predictions,
    log-probabilities and compactions of every policy (H2O's sums included) stay the same."""
    model, batch = tiny_model, random_batch()
    config = small_config(tiny_folder, policies=("beacon", "snapkv", "h2o"))
    settings = {"batch": "the same", "policies": list(config.policies)}
    computed = full_cache_pass(model, batch, config)
    full_pass.save(tmp_path / "full_pass.pt", settings, *computed)
    assert full_pass.load(tmp_path / "full_pass.pt", {"batch": "another"}, model, recorder(config, batch), batch.n_positions) is None
    # The recorder is pinned to v1's beacons, so a pass saved before BeaconKV's defaults changed still fits.
    loaded = full_pass.load(tmp_path / "full_pass.pt", settings | {"out": "moved", "beacon_defaults": {"heads_agree": 2}}, model, recorder(config, batch), batch.n_positions)
    assert loaded is not None
    older = torch.load(tmp_path / "full_pass.pt", weights_only=True)
    for saved in older["snapshots"].values():
        saved["received"] = saved["received"]["sum"]  # how a pass was saved before the records had names
    torch.save(older, tmp_path / "older.pt")
    with pytest.raises(UserError, match="format .saved before the attention received was recorded by name"):
        full_pass.load(tmp_path / "older.pt", settings, model, recorder(config, batch), batch.n_positions, required=True)
    runs = {}
    for name, passed in (("computed", computed), ("loaded", loaded)):
        run_all(model, batch, config, lambda run: runs.setdefault((name, run.policy), run), full_pass=passed)
    for policy in ("none", *config.policies):
        a, b = runs[("computed", policy)], runs[("loaded", policy)]
        assert torch.equal(a.predicted, b.predicted) and torch.equal(a.logprob, b.logprob)
        assert [c.step for c in a.compactions] == [c.step for c in b.compactions]
        assert all(torch.equal(x.kept, y.kept) for x, y in zip(a.compactions, b.compactions))


def brute_force_share(q_pre, keys, cos, sin, position, kept, region, G) -> float:
    """One query (pre-RoPE, at `position`) of one head against one KV head's keys, with scalars."""
    D = q_pre.shape[0]
    half = D // 2
    q = [q_pre[i] * cos[position, i] + (-q_pre[i + half] if i < half else q_pre[i - half]) * sin[position, i] for i in range(D)]
    weights = [math.exp(sum(q[i] * keys[j, i] for i in range(D)) / math.sqrt(D)) if j <= position else 0.0 for j in range(keys.shape[0])]
    total = sum(w for j, w in enumerate(weights) if region[j])
    return sum(w for j, w in enumerate(weights) if region[j] and kept[j]) / total


def test_future_attention_recall_matches_brute_force_and_is_one_for_the_full_cache():
    torch.manual_seed(3)
    L, B, H, H_kv, P, D, K = 2, 2, 4, 2, 14, 4, 2
    G = H // H_kv
    angles = torch.arange(P)[:, None] * torch.rand(D // 2)[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    full = FullAttention(torch.randn(L, B, H, P, D), torch.randn(L, B, H_kv, P, D), cos, sin, torch.tensor([P, P - 1]))
    prompt_lengths, window = torch.tensor([2, 3]), 2
    next_position = torch.tensor([9, 10])
    kept = torch.rand(L, B, H_kv, P) < 0.5
    got = future_attention_recall(full, [Compaction(5, next_position, torch.ones(0), kept)], [0, 1], prompt_lengths, window, K)

    context, evictable = [], []
    for l in range(L):
        for b in range(B):
            p = int(next_position[b])
            old = [j < p for j in range(P)]
            middle = [int(prompt_lengths[b]) <= j < p - window for j in range(P)]
            for h in range(H):
                for k in range(K):
                    args = (full.queries[l, b, h, :, :][p + k].tolist(), full.keys[l, b, h // G], cos, sin, p + k, kept[l, b, h // G].tolist())
                    context.append(brute_force_share(torch.tensor(args[0]), *args[1:], old, G))
                    evictable.append(brute_force_share(torch.tensor(args[0]), *args[1:], middle, G))
    assert got.context == pytest.approx(sum(context) / len(context), abs=1e-5)
    assert got.evictable == pytest.approx(sum(evictable) / len(evictable), abs=1e-5)
    assert got.n_compactions == 1

    everything = full_cache_compactions([Compaction(5, next_position, torch.ones(0), kept)])
    assert future_attention_recall(full, everything, [0, 1], prompt_lengths, window, K) == RecallShares(1.0, 1.0, 1)
    # A compaction too close to the end of a stream (fewer than K queries follow) is left out,
    # and so is one whose kept map was not sampled.
    late = Compaction(5, torch.tensor([9, P - 2]), torch.ones(0), kept)
    assert future_attention_recall(full, [late], [0, 1], prompt_lengths, window, K).n_compactions == 0
    unsampled = Compaction(5, next_position, torch.ones(0), None)
    assert future_attention_recall(full, [unsampled], [0, 1], prompt_lengths, window, K).n_compactions == 0


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_each_compaction_keeps_the_prompt_the_window_and_budget_more_positions(tiny_folder, tiny_model, policy):
    model = tiny_model
    batch = random_batch(free=(False, True, False))
    config = small_config(tiny_folder)
    _, compactions = run_from_start(model, batch, config.compression(policy, 10))
    assert [c.step for c in compactions] == list(range(config.first_compaction(10), batch.length, config.hysteresis + 1))
    for c in compactions:
        for b, prompt in enumerate(batch.prompts):
            now = int(c.next_position[b])
            kept = c.kept[:, b]  # [L, H_kv, P]
            assert kept[..., : len(prompt)].all() and kept[..., now - config.window : now].all()
            assert not kept[..., now:].any()
            assert (kept.sum(-1) == len(prompt) + 10 + config.window).all()
            if policy == "streaming":  # the newest tokens, nothing else
                assert kept[..., : now - config.window - 10].sum(-1).eq(len(prompt)).all()


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_folder):
    return Tokenizer.from_dir(tiny_folder)


@pytest.mark.parametrize("hints", [True, False])
def test_a_trace_states_each_fact_once_and_recalls_it_where_it_says(tiny_tokenizer, hints):
    tokenizer, length = tiny_tokenizer, 3000
    row = reasoning_trace(tokenizer, length, seed=5, hints=hints)
    assert len(row.forced) == length and row.hints == hints
    text = tokenizer.decode(row.forced)
    assert ("I will need" in text) == hints
    assert len(row.recalls) >= 5
    for r in row.recalls:
        assert tokenizer.decode(row.forced[: r.stated]).endswith(f"Let {r.variable} =")
        assert tokenizer.decode(row.forced[: r.start]).endswith(f"Recall: {r.variable} =")
        assert tokenizer.decode(row.forced[r.stated : r.stated + r.n_tokens]).strip() == str(r.value)
        assert tokenizer.decode(row.forced[r.start : r.start + r.n_tokens]).strip() == str(r.value)
        assert r.distance == r.start - r.stated >= DISTANCE_BUCKETS[0][0]
        assert text.count(f"Let {r.variable} =") == 1 and text.count(f"Recall: {r.variable} =") == 1
    # Two facts that wait for their recall at the same time never share a letter.
    for a, b in itertools.combinations(row.recalls, 2):
        if a.variable[0] == b.variable[0]:
            assert a.start < b.stated or b.start < a.stated


def test_the_traces_spread_their_distances_over_every_bucket(tiny_tokenizer):
    distances = [r.distance for seed in range(3) for r in reasoning_trace(tiny_tokenizer, 4000, seed, hints=False).recalls]
    for low, high in DISTANCE_BUCKETS:
        assert any(low <= d < high for d in distances), (low, high)


def quick_args(folder: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", str(folder), "--quick", "--policies", "streaming,snapkv", "--length", "330", "--out", str(out), *extra]


def test_a_stopped_run_resumes_without_redoing_its_finished_cells(tiny_folder, tmp_path, capsys):
    assert evaluate.main(quick_args(tiny_folder, tmp_path)) == 0
    saved = tmp_path / "results.json"
    data = json.loads(saved.read_text())
    budget = str(round(QUICK_COMPRESSION[0][0] * 330))
    assert data["config"]["cells_done"] == [["streaming", int(budget)], ["snapkv", int(budget)]]
    # As a run stopped after its first cell leaves it, with a mark on the finished cell.
    data["config"]["cells_done"] = data["config"]["cells_done"][:1]
    for task in ("retrieval", "attention", "loss", "continuation", "cost"):
        del data[task]["snapkv"]
    data["cost"]["streaming"][budget]["tokens_per_s"] = 12345.0
    saved.write_text(json.dumps(data))
    capsys.readouterr()
    assert evaluate.main(quick_args(tiny_folder, tmp_path)) == 0
    err = capsys.readouterr().err
    assert "resuming: 1 of 2 cells already done" in err and "full cache: loaded from" in err
    again = json.loads(saved.read_text())
    assert again["cost"]["streaming"][budget]["tokens_per_s"] == 12345.0  # kept, not redone
    assert again["cost"]["snapkv"][budget]["tokens_per_s"] > 0  # done now
    assert len(again["config"]["cells_done"]) == 2
    # Cells of another BeaconKV (v1's defaults) do not mix with this one's.
    data = json.loads(saved.read_text())
    data["config"]["beacon_defaults"]["heads_agree"] = 1
    saved.write_text(json.dumps(data))
    assert evaluate.main(quick_args(tiny_folder, tmp_path)) == 2
    assert "other settings (beacon_defaults)" in capsys.readouterr().err
    # Other settings do not mix with the saved ones, unless told to start over.
    assert evaluate.main(quick_args(tiny_folder, tmp_path, "--window", "6")) == 2
    assert "--restart" in capsys.readouterr().err
    assert evaluate.main(quick_args(tiny_folder, tmp_path, "--window", "6", "--restart")) == 0
    assert json.loads(saved.read_text())["config"]["window"] == 6


@pytest.mark.parametrize("task", ["retrieval", "humaneval"])
def test_a_second_run_into_the_same_folder_is_refused_while_the_first_runs(tiny_folder, tmp_path, capsys, task):
    """Two runs writing one results.json would overwrite each other's cells."""
    with sole_writer(tmp_path):  # as a run in progress holds it
        assert evaluate.main(quick_args(tiny_folder, tmp_path, "--task", task)) == 2
    assert "another evaluate.py is writing to" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
    with sole_writer(tmp_path):  # released when the refused run ended
        pass


def test_beacon_variants_run_beside_the_policies_and_are_tested_against_plain_beacon(tiny_folder, tiny_model, tmp_path):
    """An ablation in one run: each variant is BeaconKV with its options, resumed from the same
    snapshot as every policy, and paired against plain BeaconKV in the report."""
    variant = "beacon:aggregation=topm:top_m=2"
    others = ["beacon:heads_agree=1", "beacon:fps_per_group=true", "beacon:lazy_refresh=false"]
    assert evaluate.main(["--model", str(tiny_folder), "--quick", "--policies", ",".join([variant, "beacon", *others]), "--length", "330", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["config"]["policies"] == ["beacon", variant, *others]
    assert variant in (tmp_path / "results.md").read_text()
    config = small_config(tiny_folder, policies=(variant,))
    batch = random_batch()
    runs = {}
    run_all(tiny_model, batch, config, lambda run: runs.setdefault(run.policy, run))
    alone, _ = run_from_start(tiny_model, batch, replace(config.compression("beacon", 10), aggregation="topm", top_m=2))
    assert runs[variant].predicted.tolist() == alone.predicted.tolist()


def test_other_policies_start_from_another_runs_full_pass(tiny_folder, tmp_path, capsys):
    """An ablation of other policies loads the pass a run on the same traces saved; the full
    cache's numbers are the same; a pass of other settings is one clear error."""
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"
    assert evaluate.main(quick_args(tiny_folder, first)) == 0
    capsys.readouterr()
    ablation = ["--model", str(tiny_folder), "--quick", "--policies", "beacon", "--aggregation", "mean", "--length", "330"]
    assert evaluate.main([*ablation, "--out", str(second), "--full-pass", str(first / "full_pass.pt")]) == 0
    assert "full cache: loaded from" in capsys.readouterr().err
    a, b = (json.loads((folder / "results.json").read_text()) for folder in (first, second))
    assert a["retrieval"]["none"] == b["retrieval"]["none"] and a["loss"]["none"] == b["loss"]["none"]
    assert list(b["retrieval"]) == ["none", "beacon"]
    assert evaluate.main([*ablation, "--window", "6", "--out", str(third), "--full-pass", str(first / "full_pass.pt")]) == 2
    assert "saved with other settings (window)" in capsys.readouterr().err
    assert evaluate.main([*ablation, "--budgets", "0.2", "--out", str(third), "--full-pass", str(first / "full_pass.pt")]) == 2
    assert "budgets (the pass holds snapshots for its own budgets only)" in capsys.readouterr().err
    quantized = [*ablation, "--policies", "streaming:kv_dtype=int8", "--budgets", "0.2"]
    assert evaluate.main([*quantized, "--out", str(tmp_path / "quantized"), "--full-pass", str(first / "full_pass.pt")]) == 0  # starts from the first token: no snapshot needed
    assert "full cache: loaded from" in capsys.readouterr().err
    assert evaluate.main([*ablation, "--policies", "h2o", "--out", str(third), "--full-pass", str(first / "full_pass.pt")]) == 2
    assert "this run scores by the attention received as a sum, which the pass does not record" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--budgets", "nan"], "--budgets takes"),
        (["--budgets", "inf"], "--budgets takes"),
        (["--budgets", "2040"], "never compacts"),
        (["--length", "0"], "--length must be >= 300"),
        (["--traces", "0"], "--traces >= 1"),
        (["--task", "humaneval", "--budgets", "16.5"], "whole numbers"),
        (["--task", "humaneval", "--problems", "90-120"], "held out"),
        (["--task", "humaneval", "--timeout", "nan"], "--timeout"),
        (["--task", "humaneval", "--full-pass", "x.pt"], "--full-pass is for --task retrieval"),
        (["--policies", "snapkv:aggregation=lse"], "a variant is POLICY:OPTION=VALUE"),
        (["--policies", "beacon:n_beacon=3"], "a variant is POLICY:OPTION=VALUE"),
        (["--policies", "beacon:top_m=many"], "top_m=many is not a valid int"),
        (["--policies", "beacon:lazy_refresh=maybe"], "lazy_refresh=maybe is not a valid bool"),
        (["--policies", "beacon:store=256"], "a variant is POLICY:OPTION=VALUE"),
        (["--policies", "beacon:heads_agree=0"], "--kv-heads-agree must be >= 1"),
        (["--policies", "beacon:aggregation=median"], "unknown --kv-aggregation"),
    ],
)
def test_bad_options_get_one_clear_error(tiny_folder, tmp_path, capsys, extra, message):
    assert evaluate.main(["--model", str(tiny_folder), "--out", str(tmp_path), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing started


def test_a_results_file_of_another_version_or_task_is_one_clear_error(tmp_path, capsys):
    old = tmp_path / "results.json"
    old.write_text(json.dumps({"model": "m", "config": {"sizes": {}}, "retrieval": {}, "attention": {}, "loss": {}, "continuation": {}, "cost": {}, "seconds": {}, "notes": []}))
    assert evaluate.main(["--report", str(old)]) == 2
    assert "not the results of a retrieval run of this version" in capsys.readouterr().err


def test_humaneval_budgets_given_twice_run_once(tiny_folder, tmp_path):
    config = evaluate.parse_args(["--task", "humaneval", "--model", str(tiny_folder), "--budgets", "32,16,32", "--out", str(tmp_path)])
    assert config.budgets == (16, 32)


def test_a_policy_with_a_store_runs_beside_the_policy_alone_resumed_from_the_same_snapshot(tiny_folder, tiny_model):
    """snapkv:store_slots=...: the same policy demoting into a store; resumed from the full cache's
    snapshot, it gives the tokens of a run from the start, and its cells count the store's bytes."""
    variant = "snapkv:store_slots=32:recall_pages=1"
    config = small_config(tiny_folder, policies=("snapkv", variant))
    batch = random_batch()
    runs = {}
    run_all(tiny_model, batch, config, lambda run: runs.setdefault(run.policy, run))
    alone, _ = run_from_start(tiny_model, batch, config.compression(variant, 10))
    assert runs[variant].predicted.tolist() == alone.predicted.tolist()
    assert runs[variant].kv_cache_bytes > runs["snapkv"].kv_cache_bytes


def test_a_cell_on_a_quantized_cache_is_the_engine_run_with_that_cache_and_counts_its_bytes(tiny_folder, tiny_model):
    """streaming:kv_dtype=int4 runs the policy on an int4 cache from the first token; none:kv_dtype=int8
    is the full cache in int8, run once for every budget; each cell's share of the bytes of a full
    bf16 cache is hand-checked: head_dim 16 is one group, so a slot of K or V is 16 or 8 bytes of
    codes plus a float16 step and minimum (4 bytes), against 32 bytes in bf16."""
    config = small_config(tiny_folder, policies=("streaming", "streaming:kv_dtype=int4", "none:kv_dtype=int8"), budgets=(10, 12))
    batch = random_batch()
    runs = {}
    run_all(tiny_model, batch, config, lambda run: runs.setdefault((run.policy, run.budget), run))
    assert tiny_model.config.head_dim == 16
    alone, _ = run_from_start(tiny_model, batch, config.compression("streaming", 10), kv_dtype="int4")
    assert runs[("streaming:kv_dtype=int4", 10)].predicted.tolist() == alone.predicted.tolist()
    assert runs[("streaming:kv_dtype=int4", 10)].predicted.tolist() != runs[("streaming", 10)].predicted.tolist()
    full_int8, _ = run_from_start(tiny_model, batch, recorder(config, batch), kv_dtype="int8")
    for budget in (10, 12):
        assert runs[("none:kv_dtype=int8", budget)].predicted.tolist() == full_int8.predicted.tolist()
        assert runs[("none:kv_dtype=int8", budget)].compactions == []
    full = runs[("none", None)]
    bf16_bytes = full.kv_cache_bytes // 2  # the run is float32
    assert runs[("none:kv_dtype=int8", 10)].kv_cache_bytes / bf16_bytes == (16 + 4) / 32
    slots = config.compression("streaming", 10).slots_needed(max(map(len, batch.prompts)), batch.length)
    assert runs[("streaming:kv_dtype=int4", 10)].kv_cache_bytes / bf16_bytes == slots * (8 + 4) / (batch.n_positions * 32)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("streaming:kv_dtype=int5", "kv_dtype=int5 is not a KV storage"),
        ("none:store_slots=32", "the full cache runs anyway"),
        ("none:kv_dtype=auto", "kv_dtype=auto is not a KV storage"),
    ],
)
def test_a_bad_storage_in_a_cell_is_one_clear_error(tiny_folder, tmp_path, capsys, spec, message):
    assert evaluate.main(["--model", str(tiny_folder), "--out", str(tmp_path), "--policies", f"streaming,{spec}"]) == 2
    assert message in capsys.readouterr().err


def test_the_equal_bytes_table_tests_each_budgets_cells_against_the_best_single_technique_within_it():
    """Hand-made cells on twelve items, the table hand-checked: each cell sits at the smallest
    budget that holds it (25.04% shows as 25.0%, so at 25%), and is paired with the single
    technique that recalls most within that budget; at 35% that is the int4 full cache (9), not
    streaming at 30% (6). Hand-counted: the int4 streaming cell recalls 10 items streaming at 10
    misses and misses 1 it recalls, p = 2 * 12 / 2**11; streaming at 20 misses 3 the int4 full
    cache recalls, p = 2 / 2**3. Holm over the two: 0.023 and 0.25."""

    def cell(hits: list[bool]) -> RetrievalResult:
        return RetrievalResult(sum(hits) / len(hits), hits, [100] * len(hits), [], [False] * len(hits))

    def cost(share: float) -> CostResult:
        return CostResult(1.0, float("nan"), float("nan"), 1.0, 0.0, 1, share)

    def right(items: range) -> list[bool]:
        return [i in items for i in range(12)]

    results = Results("tiny", {})
    shares_and_hits = {
        ("none", "full"): (1.0, right(range(12))),
        ("streaming", "10"): (0.08, right(range(2))),
        ("streaming", "20"): (0.30, right(range(6))),
        ("none:kv_dtype=int4", "10"): (0.3125, right(range(9))),
        ("none:kv_dtype=int4", "20"): (0.3125, right(range(9))),
        ("streaming:kv_dtype=int4", "20"): (0.2504, right(range(1, 12))),
    }
    for (spec, budget), (share, hits) in shares_and_hits.items():
        results.cost.setdefault(spec, {})[budget] = cost(share)
        results.retrieval.setdefault(spec, {})[budget] = cell(hits)
    found = points(results)
    assert [(p.spec, p.budget) for p in found] == [
        ("streaming", "10"), ("streaming:kv_dtype=int4", "20"), ("streaming", "20"), ("none:kv_dtype=int4", "10"), ("none", "full"),
    ]  # fmt: skip
    assert [p.technique for p in found] == ["single", "combination", "single", "single", "full"]
    table = equal_bytes_table(found, "recalls", 12).splitlines()[6:]
    assert table == [
        "| 5% | not run | | | | none run | | | | |",
        "| 10% | streaming | 10 | 8.0% | 2 (17%) | streaming at 10 | 8.0% | 2 | | |",
        "| 15% | not run | | | | streaming at 10 | 8.0% | 2 | | |",
        "| 25% | streaming + int4 cache | 20 | 25.0% | 11 (92%) | streaming at 10 | 8.0% | 2 | 10/1 | 0.012 * |",
        "| 35% | streaming | 20 | 30.0% | 6 (50%) | full cache in int4 | 31.2% | 9 | 0/3 | 0.25 |",
        "| 35% | full cache in int4 |  | 31.2% | 9 (75%) | full cache in int4 | 31.2% | 9 | | |",
        "| 50% | not run | | | | full cache in int4 | 31.2% | 9 | | |",
    ]
    assert "- At 25% of the bytes or less, the most recalls: streaming + int4 cache at budget 20 (25.0%), 11 against the full cache's 12 (92%)." in bytes_tables(found, "recalls")


def test_runs_on_the_same_batch_merge_into_one_table_and_runs_of_other_settings_do_not(tiny_folder, tmp_path, capsys):
    first, second, third, merged = (tmp_path / name for name in ("first", "second", "third", "merged"))
    assert evaluate.main(quick_args(tiny_folder, first)) == 0
    assert evaluate.main([*quick_args(tiny_folder, second), "--policies", "random", "--full-pass", str(first / "full_pass.pt")]) == 0
    assert evaluate.main([*quick_args(tiny_folder, third), "--policies", "random", "--window", "6"]) == 0
    capsys.readouterr()
    runs = [first / "results.json", second / "results.json"]
    assert evaluate.main(["--report", *map(str, runs), "--out", str(merged)]) == 0
    assert "| random |" in capsys.readouterr().out
    a, b, both = (json.loads(path.read_text()) for path in (*runs, merged / "results.json"))
    assert both["config"]["policies"] == a["config"]["policies"] + ["random"]
    assert both["retrieval"]["random"] == b["retrieval"]["random"] and both["retrieval"]["streaming"] == a["retrieval"]["streaming"]
    text = (merged / "results.md").read_text()
    assert "made by `python evaluate.py --report` from 2 runs:" in text and "partial results" not in text
    assert evaluate.main(["--report", str(runs[0]), str(third / "results.json"), "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert "do not merge into one table" in err and "window" in err
    assert evaluate.main(["--report", *map(str, runs)]) == 2
    assert "--out DIR" in capsys.readouterr().err
    # Some cells only: the full cache and random's, from the first run alone too.
    picked = tmp_path / "picked"
    assert evaluate.main(["--report", *map(str, runs), "--out", str(picked), "--policies", "random"]) == 0
    chosen = json.loads((picked / "results.json").read_text())
    assert set(chosen["retrieval"]) == {"none", "random"} and chosen["config"]["policies"] == ["random"]
    assert chosen["retrieval"]["random"] == b["retrieval"]["random"] and chosen["retrieval"]["none"] == a["retrieval"]["none"]
    assert evaluate.main(["--report", str(runs[0]), "--out", str(tmp_path / "one"), "--policies", "snapkv"]) == 0
    assert set(json.loads((tmp_path / "one" / "results.json").read_text())["retrieval"]) == {"none", "snapkv"}
    capsys.readouterr()
    assert evaluate.main(["--report", str(runs[0]), "--out", str(tmp_path / "none"), "--policies", "random"]) == 2
    assert "--policies random: no run merged here ran it; these ran: streaming,snapkv" in capsys.readouterr().err
    # A run that scored fewer tasks merges: the table shows the tasks both scored.
    fewer = json.loads(runs[1].read_text())
    fewer["config"]["tasks"] = [t for t in fewer["config"]["tasks"] if t != "cost"]
    (tmp_path / "fewer.json").write_text(json.dumps(fewer))
    assert evaluate.main(["--report", str(runs[0]), str(tmp_path / "fewer.json"), "--out", str(tmp_path / "fewer")]) == 0
    tasks = json.loads((tmp_path / "fewer" / "results.json").read_text())["config"]["tasks"]
    assert tasks == [t for t in a["config"]["tasks"] if t != "cost"] and "### Cost" not in (tmp_path / "fewer" / "results.md").read_text()


def test_runs_on_other_cpu_kernels_do_not_merge_or_share_a_full_pass(tiny_folder, tmp_path, capsys):
    """bfloat16 products round otherwise on AVX2 than on AVX-512: the same settings on another CPU
    give a full cache that recalls other facts, so its cells must not pair with this one's."""
    first, second = tmp_path / "first", tmp_path / "second"
    assert evaluate.main(quick_args(tiny_folder, first)) == 0
    saved = json.loads((first / "results.json").read_text())
    assert saved["config"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    other = "AVX2" if saved["config"]["cpu_capability"] != "AVX2" else "AVX512"
    assert evaluate.main([*quick_args(tiny_folder, second), "--policies", "random", "--full-pass", str(first / "full_pass.pt")]) == 0
    elsewhere = json.loads((second / "results.json").read_text())
    elsewhere["config"]["cpu_capability"] = other
    (second / "results.json").write_text(json.dumps(elsewhere))
    capsys.readouterr()
    assert evaluate.main(["--report", str(first / "results.json"), str(second / "results.json"), "--out", str(tmp_path / "merged")]) == 2
    assert "(cpu_capability) do not merge" in capsys.readouterr().err
    pass_data = torch.load(first / "full_pass.pt", weights_only=True)
    pass_data["settings"]["cpu_capability"] = other
    torch.save(pass_data, first / "full_pass.pt")
    assert evaluate.main([*quick_args(tiny_folder, tmp_path / "third"), "--policies", "random", "--full-pass", str(first / "full_pass.pt")]) == 2
    assert "other settings (cpu_capability)" in capsys.readouterr().err
