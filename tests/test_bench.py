"""bench.py end to end on a tiny random checkpoint: every figure present, positive and consistent.

Nothing here asserts a speed: the figures are checked against each other and against the model's size.
"""

import contextlib
import io
import json
import math
import multiprocessing
import os
import pickle
import time
from pathlib import Path

import pytest
import torch

import bench
from benchmark.machine import CpuClock
from benchmark.systems import load_engine, load_transformers
from benchmark.workers import Loaded, serve, timed_in_turn
from benchmark.workload import Trial, Workload
from compression.config import CompressionConfig
from errors import UserError

SYSTEMS = ("engine", "transformers", "transformers_static")
FIELDS = ("decode_tok_s", "ttft_s", "prefill_tok_s", "gb_per_s", "peak_mem_mib", "kv_cache_mib")
BATCH, PROMPT, NEW = 2, 12, 6


@pytest.fixture(scope="module")
def report(tiny_checkpoint, tmp_path_factory):
    folder, hf_model = tiny_checkpoint("llama")
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    argv = ["--checkpoint", str(folder), "--dtype", "float32", "--device", "cpu", "--batch", str(BATCH), "--prompt-len", str(PROMPT)]
    argv += ["--new-tokens", str(NEW), "--trials", "1", "--compare", "transformers", "--ceiling", "--json", str(out)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert bench.main(argv) == 0
    return json.loads(out.read_text()), hf_model, stdout.getvalue()


def test_every_field_is_present_and_positive(report):
    data, _, _ = report
    for system in SYSTEMS:
        for field in FIELDS:
            value = data[system][field]
            assert math.isfinite(value) and value > 0, (system, field, value)
    for field in ("read_gb_per_s", "ceiling_tok_s", "matmul_ceiling_tok_s"):
        assert data["machine"][field] > 0
    assert data["config"] | {"batch": BATCH, "prompt_len": PROMPT, "new_tokens": NEW, "dtype": "float32"} == data["config"]


def test_figures_agree_with_each_other(report):
    data, _, _ = report
    bytes_per_token = data["traffic"]["bytes_per_token"]
    machine = data["machine"]
    assert machine["ceiling_tok_s"] == pytest.approx(machine["read_gb_per_s"] * 1e9 / bytes_per_token)
    for system in SYSTEMS:
        f = data[system]
        assert f["gb_per_s"] == pytest.approx(bytes_per_token * f["decode_tok_s"] / 1e9)
        assert f["prefill_tok_s"] * f["ttft_s"] == pytest.approx(BATCH * PROMPT)
        assert f["ms_per_token"] == pytest.approx(1000 * BATCH / f["decode_tok_s"])
        assert f["roofline_share"] == pytest.approx(f["decode_tok_s"] / machine["ceiling_tok_s"])
        assert f["matmul_ceiling_share"] == pytest.approx(f["decode_tok_s"] / machine["matmul_ceiling_tok_s"])
        assert f["decode_tok_s_trials"] == [f["decode_tok_s"]]  # one trial: the median is that trial
        assert 0 < f["base_mem_mib"] <= f["peak_mem_mib"] and 0 < f["final_mem_mib"] <= f["peak_mem_mib"]
        assert 0 <= f["others_busy_cores"] <= machine["cores"]
    for other in SYSTEMS[1:]:
        ratios = data["ratios"][f"engine/{other}"]
        for field in ("decode_tok_s", "ttft_s", "prefill_tok_s", "peak_mem_mib"):
            assert ratios[field] == pytest.approx(data["engine"][field] / data[other][field])


def test_bytes_and_cache_sizes_follow_from_the_model(report):
    data, hf_model, _ = report
    config = hf_model.config
    # Every weight but the embedding table (this checkpoint's LM head is untied), B embedding rows, float32.
    weights = sum(p.numel() for name, p in hf_model.named_parameters() if "embed_tokens" not in name) * 4 + BATCH * config.hidden_size * 4
    kv_per_slot = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4
    traffic = data["traffic"]
    assert traffic["weight_bytes_per_step"] == weights
    assert traffic["kv_bytes_per_slot"] == kv_per_slot
    # Decode steps read PROMPT + 1 ... PROMPT + NEW - 1 slots.
    assert traffic["mean_kv_slots"] == pytest.approx(sum(range(PROMPT + 1, PROMPT + NEW)) / (NEW - 1))
    assert traffic["bytes_per_token"] == pytest.approx((weights + BATCH * kv_per_slot * traffic["mean_kv_slots"]) / BATCH)
    # The engine's static cache holds prompt + new tokens slots per row.
    assert data["engine"]["kv_cache_mib"] * 2**20 == BATCH * (PROMPT + NEW) * kv_per_slot


def test_the_table_names_every_system_and_unit(report):
    _, _, out = report
    header = next(line for line in out.splitlines() if "engine" in line and "transformers_static" in line)
    assert header.split() == list(SYSTEMS)
    for label in ("decode (tok/s)", "decode (ms/token)", "TTFT (s)", "prefill (tok/s)", "achieved (GB/s)", "peak memory (MiB)", "KV cache (MiB)"):
        assert label in out
    assert "read bandwidth" in out and "engine/transformers_static: decode" in out


def test_a_sweep_draws_its_plot(tiny_checkpoint, tmp_path):
    pytest.importorskip("matplotlib")
    folder, _ = tiny_checkpoint("llama")
    argv = ["--checkpoint", str(folder), "--dtype", "float32", "--new-tokens", "4", "--trials", "1", "--compare", "none", "--no-compile"]
    # One length keeps the test short; the sweep runs each length exactly as it runs this one.
    argv += ["--sweep", "8", "--plot", str(tmp_path / "sweep.png"), "--json", str(tmp_path / "sweep.json")]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert bench.main(argv) == 0
    assert "decode speed by prompt length" in stdout.getvalue()
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert [point["config"]["prompt_len"] for point in data["sweep"]] == [8]
    assert all(set(point) >= {"machine", "engine"} and "transformers" not in point for point in data["sweep"])
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")


def test_the_step_profile_puts_the_products_and_the_compiled_kernels_in_their_kinds(tiny_checkpoint):
    """bench.py --profile on a float model: eager, its products are aten::mm/addmm and no compiled
    kernel runs; compiled, the fused kernels show up, with no call through dynamo (the plain step is saved); the host's own time is
    counted in both."""
    from benchmark.step_profile import profile_steps
    from weights.loader import load_model

    model = load_model(tiny_checkpoint("llama")[0], torch.float32, torch.device("cpu"))
    eager = profile_steps(model, list(range(3, 20)), warm_steps=2, steps=3, compile_step=False)
    assert eager.kinds_ms["16/32-bit products"] > 0 and eager.kinds_ms["compiled kernels"] == 0
    compiled = profile_steps(model, list(range(3, 20)), warm_steps=2, steps=3, compile_step=True)
    assert compiled.kinds_ms["compiled kernels"] > 0 and compiled.kinds_ms["compile's calls (dynamo)"] == 0  # the saved step: no dynamo
    for profile in (eager, compiled):
        assert all(ms >= 0 for ms in profile.kinds_ms.values()) and profile.kinds_ms["host (Python, the token loop)"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch", "0"], "--batch must be >= 1"),
        (["--new-tokens", "1"], "--new-tokens must be >= 2"),
        (["--sweep", "128,lots"], "--sweep takes comma-separated prompt lengths"),
        (["--sweep", "128", "--prompt-len", "64"], "drop --prompt-len"),
        (["--plot", "x.png"], "add --sweep"),
        (["--prompt-len", "500", "--new-tokens", "100"], "exceeds the model's 512 positions"),
    ],
)
def test_bad_values_are_one_clear_error(tiny_checkpoint, capsys, argv, message):
    folder, _ = tiny_checkpoint("llama")
    assert bench.main(["--checkpoint", str(folder), *argv]) == 2
    err = capsys.readouterr().err  # may start with the progress bar of the fixture writing the checkpoint
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last and "Traceback" not in err


def test_a_sweep_without_matplotlib_says_how_to_get_it(tiny_checkpoint, capsys, monkeypatch):
    folder, _ = tiny_checkpoint("llama")
    find_spec = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None if name == "matplotlib" else find_spec(name))
    assert bench.main(["--checkpoint", str(folder), "--sweep", "8,16"]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_an_unknown_choice_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit:
        bench.main(["--compare", "vllm"])
    assert exit.value.code == 2
    assert "invalid choice: 'vllm'" in capsys.readouterr().err


def test_help_lists_every_option(capsys):
    """argparse formats help texts with %: a stray percent sign breaks --help with a traceback."""
    with pytest.raises(SystemExit) as exit:
        bench.main(["--help"])
    assert exit.value.code == 0
    shown = capsys.readouterr().out
    assert all(option in shown for option in ("--compile", "--ceiling", "--kv-policy", "--sweep", "(%)"))


def test_a_kv_policy_bounds_the_engines_cache(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("llama")
    out = tmp_path / "bench.json"
    argv = ["--checkpoint", str(folder), "--dtype", "float32", "--prompt-len", "16", "--new-tokens", "64", "--trials", "1", "--compare", "none", "--no-compile"]
    argv += ["--kv-policy", "beacon", "--kv-budget", "8", "--kv-hysteresis", "4", "--kv-window", "4", "--json", str(out)]
    with contextlib.redirect_stdout(io.StringIO()):
        assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    c = json.loads((folder / "config.json").read_text())
    slots = 16 + 8 + 4 + 4 + 1  # prompt + budget + hysteresis + window + the step that triggers a compaction
    kv_bytes = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * slots * (c["hidden_size"] // c["num_attention_heads"]) * 4
    assert data["config"]["kv_policy"]["policy"] == "beacon"
    assert data["engine"]["kv_cache_mib"] * 2**20 == pytest.approx(kv_bytes)
    # 17 steps fill the 33 slots from the prompt's 16; each compaction frees 5 slots (33 -> 28).
    cost = data["compression"]
    assert cost["compactions"] == 1 + (63 - 17) // 5 and cost["compaction_ms"] > 0
    assert cost["refreshes"] > 0 and cost["refresh_ms"] > 0
    # at least half of the compactions (and of the refreshes) took their median time or longer
    spent_s = (cost["compactions"] // 2 * cost["compaction_ms"] + cost["refreshes"] // 2 * cost["refresh_ms"]) / 1000
    decode_s = 63 / data["engine"]["decode_tok_s"]
    assert spent_s / decode_s <= cost["share_of_decode"] < 1


def load_wall_clock(w: Workload, fail: str | None = None) -> Loaded:
    """A stand-in system whose every trial reports the wall-clock time it ran at, as its TTFT;
    or one that fails as asked: a bad input, a bug, or a process that dies in its first trial."""
    if fail == "user":
        raise UserError("no such checkpoint")
    if fail == "bug":
        raise ValueError("a bug in the loader")

    def measure() -> Trial:
        if fail == "crash":
            os._exit(1)
        return Trial(time.time(), 1.0, 1)

    return Loaded(measure, lambda: "extras")


def workload(trials: int) -> Workload:
    return Workload(Path("."), torch.float32, torch.device("cpu"), [[1]], 2, trials, False, False, CompressionConfig())


def test_the_systems_take_their_trials_in_turn():
    """Round i runs one trial of each system, the i-th first: drift over minutes falls on every system alike."""
    systems = {name: (load_wall_clock, ()) for name in ("a", "b", "c")}
    runs = timed_in_turn(workload(4), systems)
    ran_at = sorted((trial.ttft_s, name) for name, (run, _) in runs.items() for trial in run.trials)
    assert [name for _, name in ran_at] == list("abc" "bca" "cab" "abc")
    assert all(extras == "extras" and len(run.trials) == 4 for run, extras in runs.values())


@pytest.mark.parametrize(
    "fail, error, message",
    [
        ("user", UserError, "no such checkpoint"),
        ("bug", RuntimeError, "ValueError: a bug in the loader"),
        ("crash", UserError, "the broken benchmark process died"),
    ],
)
def test_a_failing_system_stops_the_benchmark_with_its_error(fail, error, message):
    systems = {"fine": (load_wall_clock, ()), "broken": (load_wall_clock, (fail,))}
    with pytest.raises(error, match=message):
        timed_in_turn(workload(2), systems)
    assert not multiprocessing.active_children()  # the other system's process is gone too


def test_what_a_worker_runs_pickles_by_its_module_path():
    """Spawn sends a worker's target and loader by module path: each must be found where it is defined."""
    for function in (serve, load_engine, load_transformers):
        assert function.__module__.startswith("benchmark.") and pickle.loads(pickle.dumps(function)) is function


def test_others_cpu_never_exceeds_the_cores_there_are():
    """/proc/stat ticks at 1/100 s, the process's own clock finer: under full load their difference
    came out at 2.0001 cores on this 2-core machine, failing the report's own sanity check."""
    cores = os.cpu_count() or 1
    before = CpuClock(busy_s=100.0, elapsed_s=50.0, own_s=1.0)
    after = CpuClock(busy_s=100.0 + cores * 1.0 + 0.02, elapsed_s=51.0, own_s=1.0)
    assert CpuClock.others_between(before, after) == cores
    idle = CpuClock(busy_s=100.0, elapsed_s=51.0, own_s=1.5)
    assert CpuClock.others_between(before, idle) == 0.0


def test_int4_traffic_counts_the_bytes_the_quantized_layers_keep(tiny_checkpoint, tmp_path):
    """--quant int4: the weight bytes per step are the packed 4-bit values (K/2 bytes a row), a scale and
    a zero per group in the activation dtype, and the int8 LM head with its scales, counted by hand."""
    folder, hf_model = tiny_checkpoint("llama")
    c = hf_model.config
    out = tmp_path / "int4.json"
    argv = ["--checkpoint", str(folder), "--dtype", "float32", "--batch", "1", "--prompt-len", "8", "--new-tokens", "3", "--trials", "1"]
    argv += ["--compare", "none", "--no-compile", "--quant", "int4", "--group-size", "32", "--json", str(out)]
    with contextlib.redirect_stdout(io.StringIO()):
        assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    C, I, D = c.hidden_size, c.intermediate_size, c.hidden_size // c.num_attention_heads
    matrices = [((c.num_attention_heads + 2 * c.num_key_value_heads) * D, C), (C, c.num_attention_heads * D), (2 * I, C), (C, I)]  # [N, K]
    per_layer = sum(N * K // 2 + (K // 32) * N * 2 * 4 for N, K in matrices) + 2 * C * 4  # int4, float32 scales and zeros, two norms
    lm_head = c.vocab_size * C + c.vocab_size * 4  # int8 values, one float32 scale a row
    assert data["traffic"]["weight_bytes_per_step"] == c.num_hidden_layers * per_layer + C * 4 + lm_head + C * 4  # + final norm, one embedding row
    assert data["config"]["quant"] == "int4" and data["config"]["group_size"] == 32


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gguf", "model.gguf"], "add --compare llama.cpp or drop --gguf"),
        (["--compare", "llama.cpp"], "pass it with --gguf"),
        (["--compare", "llama.cpp", "--gguf", "nowhere.gguf"], "nowhere.gguf: no such file"),
        (["--compare", "llama.cpp", "--batch", "2"], "batch 1 only"),
    ],
)
def test_a_llama_cpp_comparison_needs_its_file(tiny_checkpoint, capsys, monkeypatch, argv, message):
    folder, _ = tiny_checkpoint("llama")
    find_spec = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: object() if name == "llama_cpp" else find_spec(name))
    assert bench.main(["--checkpoint", str(folder), *argv]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last


def test_a_llama_cpp_comparison_without_llama_cpp_says_how_to_get_it(tiny_checkpoint, capsys, monkeypatch):
    folder, _ = tiny_checkpoint("llama")
    find_spec = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None if name == "llama_cpp" else find_spec(name))
    assert bench.main(["--checkpoint", str(folder), "--compare", "llama.cpp", "--gguf", str(folder / "config.json")]) == 2
    assert "pip install llama-cpp-python" in capsys.readouterr().err


def test_llama_cpp_traffic_is_its_files_tensors(tiny_checkpoint, tmp_path):
    """Every tensor of the GGUF file once per step, the embedding table left out when the file has an
    LM head of its own; the KV part is the engine's."""
    from gguf import GGUFReader

    from benchmark.memory import DecodeTraffic, gguf_traffic
    from test_gguf import write_gguf

    path = tmp_path / "llama.gguf"
    write_gguf(path, tiny_checkpoint("llama")[1], "llama")  # untied: output.weight beside token_embd.weight
    sizes = {t.name: t.data.nbytes for t in GGUFReader(path).tensors}
    assert "output.weight" in sizes
    engine = DecodeTraffic(batch=1, weight_bytes=1, kv_bytes_per_slot=10, mean_slots=3.5)
    traffic = gguf_traffic(path, engine)
    assert traffic.weight_bytes == sum(sizes.values()) - sizes["token_embd.weight"]
    assert (traffic.batch, traffic.kv_bytes_per_slot, traffic.mean_slots) == (1, 10, 3.5)


def test_the_serving_workload_reports_each_system_on_the_same_prompts(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("llama")
    out = tmp_path / "serving.json"
    argv = ["--checkpoint", str(folder), "--dtype", "float32", "--workload", "5", "--workload-prompt-len", "4-20", "--workload-new-tokens", "3-9"]
    argv += ["--max-batch", "2", "--block-size", "4", "--trials", "1", "--compare", "transformers", "--no-compile", "--json", str(out)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    config = data["config"]
    lengths, new_tokens = config["prompt_lengths"], config["new_tokens"]
    assert len(lengths) == 5 and all(4 <= n <= 20 for n in lengths) and all(3 <= n <= 9 for n in new_tokens)
    c = json.loads((folder / "config.json").read_text())
    kv_per_slot = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * (c["hidden_size"] // c["num_attention_heads"]) * 4
    row_slots = max(lengths) + max(new_tokens)
    # Static batching holds max_batch rows of the longest case; continuous batching's pool is as large.
    assert data["engine_static"]["kv_peak_mib"] * 2**20 == 2 * row_slots * kv_per_slot
    assert config["pool_blocks"] == 2 * row_slots // 4
    assert data["engine_continuous"]["kv_peak_mib"] * 2**20 <= config["pool_blocks"] * 4 * kv_per_slot
    for name in ("engine_continuous", "engine_static", "transformers"):
        figures = data[name]
        assert figures["tok_s"] == pytest.approx(sum(new_tokens) / figures["seconds"])
        assert 1 <= figures["most_rows"] <= 2
    assert "engine_continuous/engine_static: throughput" in stdout.getvalue()


def test_the_paged_engine_runs_beside_the_contiguous_one(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("llama")
    out = tmp_path / "bench.json"
    argv = ["--checkpoint", str(folder), "--dtype", "float32", "--prompt-len", "9", "--new-tokens", "4", "--trials", "1", "--compare", "none"]
    argv += ["--no-compile", "--paged", "--block-size", "4", "--json", str(out)]
    with contextlib.redirect_stdout(io.StringIO()):
        assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    assert "engine/engine_paged" in data["ratios"]
    # The pool: the row's 13 slots in 4 blocks of 4, and the scratch block.
    assert data["engine_paged"]["kv_cache_mib"] / data["engine"]["kv_cache_mib"] == pytest.approx(5 * 4 / 13)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workload", "0"], "--workload must be >= 1"),
        (["--workload", "4", "--workload-prompt-len", "32"], "takes MIN-MAX"),
        (["--workload", "4", "--workload-new-tokens", "9-3"], "1 <= MIN <= MAX"),
        (["--workload", "4", "--max-batch", "0"], "--max-batch must be >= 1"),
        (["--workload", "4", "--prompt-len", "8"], "drop --sweep, --prompt-len"),
        (["--workload", "4", "--workload-prompt-len", "500-510"], "exceed the model's 512 positions"),
        (["--block-size", "4"], "add --paged"),
    ],
)
def test_bad_workload_and_paging_values_are_one_clear_error(tiny_checkpoint, capsys, argv, message):
    folder, _ = tiny_checkpoint("llama")
    assert bench.main(["--checkpoint", str(folder), *argv]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last


@pytest.mark.real
def test_as_user_times_the_default_command_in_fresh_processes(capsys, monkeypatch):
    """bench.py --as-user: every row is a fresh generate.py process (cold and warm cache, eager),
    beside llama.cpp when it is installed; each row's wall time covers at least its decode."""
    import importlib.util

    assert bench.main(["--as-user", "--trials", "1", "--new-tokens", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in lines if line.startswith("| engine") or line.startswith("| llama.cpp")}
    expected = {"engine --compile, cold cache", "engine --compile, warm cache", "engine --no-compile"}
    if importlib.util.find_spec("llama_cpp") is not None:
        expected.add("llama.cpp")
    assert set(rows) == expected
    for wall, first_token, rate, *_ in rows.values():
        assert float(wall) > 7 / float(rate)  # 7 decode steps at the reported rate fit inside the wall time
        assert 0 < float(first_token) < float(wall)


def test_the_server_under_the_serving_workload(chat_checkpoint, tmp_path):
    """bench.py --workload --serve: the same prompts through serve.py all at once and one at a
    time, equal answers, time to first token, and the run with faults fully accounted for."""
    out = tmp_path / "serving.json"
    argv = ["--checkpoint", str(chat_checkpoint), "--dtype", "float32", "--workload", "5", "--workload-prompt-len", "4-20", "--workload-new-tokens", "3-9"]
    argv += ["--max-batch", "2", "--block-size", "4", "--trials", "1", "--no-compile", "--serve", "--json", str(out)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    new_tokens = data["config"]["new_tokens"]
    for name in ("engine_continuous", "server_concurrent", "server_one_by_one"):
        assert data[name]["tok_s"] == pytest.approx(sum(new_tokens) / data[name]["seconds"])
    together, alone = data["server_concurrent"], data["server_one_by_one"]
    assert together["extras"]["tokens"] == alone["extras"]["tokens"] == new_tokens
    assert together["extras"]["texts"] == alone["extras"]["texts"]
    assert 0 < together["ttft_p50_s"] <= together["ttft_p95_s"] and alone["most_rows"] == 1
    faults = together["extras"]["faults"]
    assert faults["bad_with_4xx_error_body"] == faults["bad_requests"] == 100 and faults["answers_equal_clean_run"] == faults["answers"] == 5
    assert faults["free_blocks"] == faults["pool_blocks"] == data["config"]["pool_blocks"]
    assert "server_concurrent/server_one_by_one: throughput" in stdout.getvalue()


def test_prefix_reuse_compares_serve_py_with_and_without_its_prefix_cache(chat_checkpoint, tmp_path):
    """bench.py --prefix-reuse: a conversation's turns and chats at once over one system prompt,
    through serve.py with and without the prefix cache; the same answers, the shared blocks found."""
    out = tmp_path / "reuse.json"
    argv = ["--checkpoint", str(chat_checkpoint), "--dtype", "float32", "--prefix-reuse", "--turns", "3", "--conversations", "4", "--system-tokens", "80", "--new-tokens", "4", "--json", str(out)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    on, off = data["with_cache"], data["without_cache"]
    assert data["system_tokens"] >= 80 and len(on["turn_ttft_s"]) == len(off["turn_ttft_s"]) == 3
    assert on["answers"] == off["answers"] and on["blocks_back"] and off["blocks_back"]
    assert all(hit == 0 for hit in off["cached_tokens"])
    # Every later turn finds the history before it; every chat at once finds the system prompt (blocks of 16).
    assert all(hit >= data["system_tokens"] // 16 * 16 - 16 for hit in on["cached_tokens"][1:])
    assert "answers equal with and without the cache: 7 of 7" in stdout.getvalue()
