"""generate.py end to end on a tiny checkpoint with a real tokenizer and chat template."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import generate
from compression.config import POLICIES
from tiny_tokenizer import write_tiny_tokenizer

REPO = Path(__file__).resolve().parent.parent
IM_END = 386  # the tiny tokenizer's <|im_end|>


@pytest.fixture(scope="session")
def chat_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny Qwen2 checkpoint with a ChatML tokenizer and <|im_end|> as its EOS."""
    folder = tmp_path_factory.mktemp("chat")
    shutil.copytree(tiny_checkpoint("qwen2")[0], folder, dirs_exist_ok=True)
    write_tiny_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END]}))
    return folder


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


def test_chat_answer_equals_transformers_and_summary_goes_to_stderr(chat_checkpoint, capsys):
    code, out, err = run_main(capsys, "--checkpoint", str(chat_checkpoint), "--prompt", "Tell me about the fox 🦊", "--system", "Be brief.", "--max-new-tokens", "24", "--dtype", "float32")
    assert code == 0
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the fox 🦊"}]
    assert out == transformers_answer(chat_checkpoint, messages, None, 24) + "\n"
    assert err.startswith("prompt tokens: ") and "decode:" in err and "KV cache:" in err


def test_no_chat_encodes_the_plain_prompt(chat_checkpoint, capsys):
    code, out, _ = run_main(capsys, "--checkpoint", str(chat_checkpoint), "--no-chat", "--max-new-tokens", "16", "--dtype", "float32", "Once upon a time")
    assert code == 0
    assert out == transformers_answer(chat_checkpoint, None, "Once upon a time", 16) + "\n"


def test_prompt_file_runs_a_batch_in_prompt_order(chat_checkpoint, capsys, tmp_path):
    prompts = ["first question", "a second, longer question about foxes", "third"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    code, out, err = run_main(capsys, "--checkpoint", str(chat_checkpoint), "--prompt-file", str(tmp_path / "prompts.txt"), "--max-new-tokens", "12", "--dtype", "float32")
    assert code == 0
    singles = [run_main(capsys, "--checkpoint", str(chat_checkpoint), "--prompt", p, "--max-new-tokens", "12", "--dtype", "float32")[1] for p in prompts]
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
    assert done.stdout.endswith("\n") and done.stderr.count("\n") == 1


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
