"""generate.py end to end on a tiny checkpoint with a real tokenizer and chat template."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import cli
import generate
from compression.config import POLICIES
from conftest import IM_END

REPO = Path(__file__).resolve().parent.parent


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = generate.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def transformers_answer(folder: Path, messages: list[dict] | None, text: str | None, max_new_tokens: int) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if messages is not None:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=IM_END, pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_chat_answer_equals_transformers_and_summary_goes_to_stderr(chat_checkpoint, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # an empty cache: the step compiles, and says so
    code, out, err = run_main(
        capsys, "--checkpoint", str(chat_checkpoint), "--prompt", "Tell me about the fox 🦊", "--system", "Be brief.", "--max-new-tokens", "24",
        "--dtype", "float32", "--temperature", "0", "--compile",
    )
    assert code == 0
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the fox 🦊"}]
    assert out == transformers_answer(chat_checkpoint, messages, None, 24) + "\n"
    notice, summary = err.splitlines()
    assert notice == cli.COMPILE_NOTICE  # said once
    assert summary.startswith("prompt tokens: ") and "decode:" in summary and "| compile: " in summary and "KV cache:" in summary


def test_no_chat_encodes_the_plain_prompt(chat_checkpoint, capsys):
    code, out, _ = run_main(capsys, "--checkpoint", str(chat_checkpoint), "--no-chat", "--max-new-tokens", "16", "--dtype", "float32", "--temperature", "0", "Once upon a time")
    assert code == 0
    assert out == transformers_answer(chat_checkpoint, None, "Once upon a time", 16) + "\n"


def test_prompt_file_runs_a_batch_in_prompt_order(chat_checkpoint, capsys, tmp_path):
    prompts = ["first question", "a second, longer question about foxes", "third"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    code, out, err = run_main(capsys, "--checkpoint", str(chat_checkpoint), "--prompt-file", str(tmp_path / "prompts.txt"), "--max-new-tokens", "12", "--dtype", "float32", "--temperature", "0")
    assert code == 0
    singles = [run_main(capsys, "--checkpoint", str(chat_checkpoint), "--prompt", p, "--max-new-tokens", "12", "--dtype", "float32", "--temperature", "0")[1] for p in prompts]
    assert out == "\n\n".join(s.removesuffix("\n") for s in singles) + "\n"


@pytest.mark.parametrize("policy", POLICIES)
def test_every_kv_policy_runs_end_to_end(chat_checkpoint, capsys, policy):
    code, out, err = run_main(
        capsys, "--checkpoint", str(chat_checkpoint), "--prompt", "Count the foxes.", "--max-new-tokens", "48",
        "--kv-policy", policy, "--kv-budget", "8", "--kv-hysteresis", "4", "--kv-window", "4", "--n-beacon", "4", "--n-recent", "4",
    )
    assert code == 0 and out.strip()
    if policy != "none":
        assert "compactions: " in err


def test_the_script_streams_from_stdin_as_a_real_process(chat_checkpoint):
    done = subprocess.run(
        [sys.executable, str(REPO / "generate.py"), "--checkpoint", str(chat_checkpoint), "--max-new-tokens", "8"],
        input="hello from stdin", capture_output=True, text=True, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n") and done.stderr.count("\n") == 1  # 8 tokens: eager by default, nothing to announce


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--checkpoint", "/no/such/folder", "--prompt", "x"], "no such folder"),
        (["--prompt", "x", "--device", "cuda"], "sees no CUDA device; use --device cpu"),
        (["--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt", "x", "--top-p", "1.5"], "top-p must be in (0, 1]"),
        (["--prompt", "x", "--max-new-tokens", "0"], "max-new-tokens must be >= 1"),
        (["--prompt", "x", "--max-new-tokens", "600"], "exceeds the model's maximum of 512 positions"),
        (["--prompt", "   "], "the prompt is empty"),
        (["--prompt-file", "/no/prompts.txt"], "--prompt-file /no/prompts.txt does not exist"),
        (["--prompt", "x", "--kv-policy", "beacon", "--kv-budget", "0"], "--kv-budget must be >= 1"),
    ],
)
def test_user_errors_exit_2_with_one_line(chat_checkpoint, capsys, argv, message):
    if torch.cuda.is_available() and "cuda" in argv:
        pytest.skip("this machine has CUDA")
    if "--checkpoint" not in argv:
        argv = ["--checkpoint", str(chat_checkpoint), *argv]
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_unsupported_model_type_exits_2(chat_checkpoint, capsys, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(chat_checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    code, _, err = run_main(capsys, "--checkpoint", str(folder), "--prompt", "x")
    assert code == 2 and "unsupported model_type 'gpt2'" in err


def test_bad_option_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--dtype", "int8", "--prompt", "x"])
    assert exit_info.value.code == 2 and "invalid choice: 'int8'" in capsys.readouterr().err


def with_generation_config(folder: Path, tmp_path: Path, **fields) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END], **fields}))
    return copy


@pytest.mark.parametrize(
    "fields,flags,expected",
    [
        # No sampling field: llama-cli's defaults.
        ({}, [], dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.0)),
        # Qwen2.5-Instruct's file, as transformers reads it.
        (dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05), [], dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0, repetition_penalty=1.05)),
        # Sampling fields without do_sample: transformers decodes greedily, its other defaults apply.
        (dict(temperature=0.6), [], dict(temperature=0.0, top_k=50, top_p=1.0, min_p=0.0, repetition_penalty=1.0)),
        # Each flag overrides its own value only.
        (dict(do_sample=True, temperature=0.7, top_k=20), ["--temperature", "0", "--min-p", "0.1"], dict(temperature=0.0, top_k=20, top_p=1.0, min_p=0.1, repetition_penalty=1.0)),
    ],
)
def test_sampling_defaults_come_from_generation_config(chat_checkpoint, tmp_path, fields, flags, expected):
    from weights.generation_config import sampling_defaults

    folder = with_generation_config(chat_checkpoint, tmp_path, **fields)
    args = generate.parse_args(["--checkpoint", str(folder), "x", *flags])
    assert generate.sampling_config(args, sampling_defaults(folder)) == generate.SamplingConfig(**expected)


def test_a_generation_config_of_the_wrong_type_names_the_file(chat_checkpoint, tmp_path, capsys):
    folder = with_generation_config(chat_checkpoint, tmp_path, do_sample=True, top_k="forty")
    code, _, err = run_main(capsys, "--checkpoint", str(folder), "--prompt", "x")
    assert code == 2 and "generation_config.json: top_k is 'forty', expected an integer" in err


def test_greedy_with_repetition_penalty_equals_transformers(tiny_checkpoint):
    """The penalty counts the prompt and every token generated so far, inside the decode step."""
    from engine.generation import generate as run_generate
    from weights.forms import load_model

    folder, hf = tiny_checkpoint("llama")
    prompt = torch.randint(3, 384, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)
    model = load_model(folder, torch.float32, torch.device("cpu"))
    got = run_generate(model, [prompt], 40, eos_ids=frozenset(), sampling=generate.SamplingConfig(repetition_penalty=1.8)).tokens[0]
    assert got == expected[0, len(prompt) :].tolist()
    assert got != run_generate(model, [prompt], 40, eos_ids=frozenset()).tokens[0]  # the penalty changes this answer


def test_stop_string_ends_the_answer_before_it(chat_checkpoint, capsys):
    base = ["--checkpoint", str(chat_checkpoint), "--prompt", "Tell me about the fox", "--max-new-tokens", "40", "--temperature", "0"]
    _, full, _ = run_main(capsys, *base)
    words = full.split()
    stop = " ".join(words[len(words) // 2 : len(words) // 2 + 2])  # two words: a stop that spans tokens
    code, out, err = run_main(capsys, *base, "--stop", stop, "--stop", "never appears")
    assert code == 0
    assert out == full[: full.index(stop)] + "\n"
    assert int(err.split("new tokens: ")[1].split()[0]) < 40  # generation really stopped


def test_a_folder_without_config_json_exits_2(chat_checkpoint, capsys, tmp_path):
    folder = tmp_path / "no-config"
    shutil.copytree(chat_checkpoint, folder)
    (folder / "config.json").unlink()
    code, _, err = run_main(capsys, "--checkpoint", str(folder), "--prompt", "x")
    assert code == 2 and "has no config.json" in err and "Traceback" not in err


@pytest.mark.parametrize("flags", [["--max-batch", "2"], ["--max-batch", "2", "--kv-policy", "beacon", "--kv-budget", "4", "--kv-hysteresis", "2", "--kv-window", "2"]])
def test_continuous_batching_prints_the_answers_of_one_static_batch_in_prompt_order(chat_checkpoint, capsys, tmp_path, flags):
    """More prompts than rows: each answer equals the one static batching gives it, in prompt order."""
    prompts = ["first question", "a second, longer question about foxes and dogs", "third", "the fourth one", "five"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    common = ["--checkpoint", str(chat_checkpoint), "--prompt-file", str(tmp_path / "prompts.txt"), "--max-new-tokens", "12", "--dtype", "float32", "--temperature", "0"]
    policy = flags[2:]
    _, static, _ = run_main(capsys, *common, *policy)
    code, out, err = run_main(capsys, *common, *flags)
    assert code == 0 and out == static
    assert "prompts: 5" in err and "at most 2 prompts at once" in err and "KV cache:" in err


def test_a_prompt_file_prefills_a_common_beginning_once_and_answers_as_without_sharing(chat_checkpoint, capsys, tmp_path):
    system = "You answer questions about foxes, dogs and the woods they live in, briefly and kindly. " * 3
    prompts = [system + question for question in ("What do foxes eat?", "Where do dogs sleep?", "Which is faster?")]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    common = ["--checkpoint", str(chat_checkpoint), "--prompt-file", str(tmp_path / "prompts.txt"), "--max-new-tokens", "8", "--dtype", "float32", "--temperature", "0", "--max-batch", "2"]
    _, unshared, err = run_main(capsys, *common, "--no-prefix-cache")
    assert "(0 cached)" in err
    code, shared, err = run_main(capsys, *common)
    cached = int(re.search(r"\((\d+) cached\)", err).group(1))
    assert code == 0 and shared == unshared and cached >= 2 * 16  # the two later prompts found at least a block each


def test_the_paged_cache_gives_the_answers_of_the_contiguous_one(chat_checkpoint, capsys, tmp_path):
    prompts = ["first question", "a second, longer question about foxes"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    common = ["--checkpoint", str(chat_checkpoint), "--prompt-file", str(tmp_path / "prompts.txt"), "--max-new-tokens", "12", "--dtype", "float32", "--temperature", "0"]
    _, contiguous, _ = run_main(capsys, *common)
    code, paged, err = run_main(capsys, *common, "--paged", "--block-size", "4")
    assert code == 0 and paged == contiguous and "held at most" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "hi", "--block-size", "8"], "add --paged"),
        (["--prompt", "hi", "--paged", "--block-size", "12"], "power of two"),
        (["--prompt", "hi", "--paged", "--kv-blocks", "0"], "at least one block"),
    ],
)
def test_bad_paging_options_exit_2_with_one_line(chat_checkpoint, capsys, argv, message):
    code, _, err = run_main(capsys, "--checkpoint", str(chat_checkpoint), *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_max_batch_without_a_prompt_file_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit:
        generate.parse_args(["--prompt", "hi", "--max-batch", "2"])
    assert exit.value.code == 2 and "add --prompt-file" in capsys.readouterr().err


def test_continuous_batching_with_too_small_a_pool_says_so(chat_checkpoint, capsys, tmp_path):
    (tmp_path / "prompts.txt").write_text("a question\nanother\n")
    code, _, err = run_main(capsys, "--checkpoint", str(chat_checkpoint), "--prompt-file", str(tmp_path / "prompts.txt"), "--max-batch", "2", "--kv-blocks", "1", "--block-size", "4")
    assert code == 2 and "give the pool more blocks" in err


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
def test_kv_dtype_runs_a_prompt_and_continuous_batching(chat_checkpoint, capsys, tmp_path, kv_dtype):
    (tmp_path / "prompts.txt").write_text("first question\nthird\n")
    common = ["--checkpoint", str(chat_checkpoint), "--max-new-tokens", "12", "--dtype", "float32", "--temperature", "0", "--kv-dtype", kv_dtype]
    code, out, err = run_main(capsys, *common, "--prompt", "Count the foxes.", "--kv-policy", "snapkv", "--kv-budget", "4", "--kv-hysteresis", "2", "--kv-window", "2")
    assert code == 0 and out.strip() and "compactions: " in err
    code, out, _ = run_main(capsys, *common, "--prompt-file", str(tmp_path / "prompts.txt"), "--max-batch", "2")
    assert code == 0 and len(out.strip().split("\n\n")) == 2
