"""What the commands run when no option says otherwise: the checkpoint, its weights' form, the dtype."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cli
import generate
from models.quantized import Int4Linear
from weights.forms import load_model

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("quant", "group_size", "own_blocks", "load_quant"),
    [("auto", 32, True, "none"), ("int4", 32, True, "none"), ("int4", 64, False, "int4"), ("int8", 32, False, "int8"), ("none", 32, False, "none")],
)
def test_the_bundled_model_runs_its_own_4_bit_blocks_unless_asked_otherwise(monkeypatch, tmp_path, quant, group_size, own_blocks, load_quant):
    import weights.packaged

    asked = []
    monkeypatch.setattr(weights.packaged, "smollm2_checkpoint", lambda quantized: asked.append(quantized) or tmp_path)
    assert cli.checkpoint_and_quant(None, quant, group_size) == (tmp_path, load_quant)
    assert asked == [own_blocks]


def test_a_checkpoint_folder_runs_as_stored_by_default(tiny_checkpoint):
    folder = tiny_checkpoint("llama")[0]
    assert cli.checkpoint_and_quant(str(folder), "auto", 32) == (folder, "none")
    assert cli.checkpoint_and_quant(str(folder), "int8", 32) == (folder, "int8")


def _with_dtype(folder, tmp_path, dtype: str):
    copy = tmp_path / dtype
    copy.mkdir()
    for item in folder.iterdir():
        (copy / item.name).write_bytes(item.read_bytes())
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "torch_dtype"} | {"dtype": dtype}))
    return copy


@pytest.mark.parametrize(
    ("stored", "quant", "device", "expected"),
    [
        ("float32", "none", "cpu", torch.float32),
        ("bfloat16", "none", "cpu", torch.bfloat16),
        ("float16", "none", "cpu", torch.bfloat16),  # float16 products are emulated on CPU
        ("float16", "none", "cuda", torch.float16),
        ("float32", "int4", "cpu", torch.bfloat16),  # never float32 activations with int4 weights
        ("float32", "int8", "cpu", torch.bfloat16),
    ],
)
def test_dtype_auto(tiny_checkpoint, tmp_path, stored, quant, device, expected):
    """The same choice on every CPU kernel family (the CI runs this file under ATEN_CPU_CAPABILITY=avx2 too)."""
    folder = _with_dtype(tiny_checkpoint("llama")[0], tmp_path, stored)
    assert cli.pick_dtype("auto", folder, torch.device(device), quant) == expected
    assert cli.pick_dtype("float32", folder, torch.device(device), quant) == torch.float32


@pytest.mark.parametrize(("kernels", "rows", "expected"), [("avx2", 1, "bfloat16"), ("avx2", 2, "float32"), ("avx2", 8, "float32"), ("avx512", 8, "bfloat16")])
def test_a_batch_runs_in_float32_on_a_cpu_without_native_bfloat16_products(tiny_checkpoint, tmp_path, kernels, rows, expected):
    """Under the AVX2 kernels a bfloat16 product of several rows runs row by row; float32 is 2.7x
    faster for a batch of 8 there. Each case in a process of its own: torch picks its kernels once."""
    if kernels == "avx512" and not torch.cpu._is_avx512_supported():
        pytest.skip("this CPU has no AVX-512")
    folder = _with_dtype(tiny_checkpoint("llama")[0], tmp_path, "bfloat16")
    env = os.environ | {"ATEN_CPU_CAPABILITY": kernels}
    code = f"import torch, cli; from pathlib import Path; print(cli.pick_dtype('auto', Path({str(folder)!r}), torch.device('cpu'), 'none', rows={rows}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"torch.{expected}"
    for quant in ("int4", "int8"):  # the quantized products take a batch in bfloat16 on every CPU kind
        assert cli.pick_dtype("auto", folder, CPU, quant, rows=8) == torch.bfloat16


def test_a_checkpoint_saved_quantized_runs_with_bfloat16_activations(tiny_checkpoint, tmp_path):
    from weights.quantize import save_quantized

    saved = save_quantized(tiny_checkpoint("llama")[0], tmp_path / "int4", "int4", 32)
    assert cli.pick_dtype("auto", saved, CPU, "none") == torch.bfloat16


@pytest.mark.parametrize(
    ("device", "tokens", "saved", "compiled"),
    [
        ("cpu", 2, True, False), ("cpu", 31, True, False), ("cpu", 32, True, True), ("cpu", 256, True, True),
        ("cpu", 256, False, False), ("cpu", 511, False, False), ("cpu", 512, False, True), ("cpu", 8 * 256, False, True),
        ("cpu", None, True, True), ("cpu", None, False, True), ("cuda", 4096, False, False),
    ],
)
def test_generate_compiles_by_default_where_it_pays(device, tokens, saved, compiled):
    """On CPU a chat (tokens None), or a run of 32 tokens or more where the saved step serves it
    (it loads in a fraction of a second), 512 where torch.compile's groups do; on CUDA the graph
    does the job."""
    assert cli.compile_pays(torch.device(device), tokens, saved) is compiled


def test_compile_flags_override_the_default():
    assert generate.parse_args(["x"]).compile is None  # decided once the device and the prompts are known
    assert generate.parse_args(["x", "--no-compile"]).compile is False
    assert generate.parse_args(["x", "--compile"]).compile is True


def test_a_plain_run_compiles_by_default_says_so_once_and_later_runs_load_it(chat_checkpoint, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a new machine's empty cache
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\nand goodbye\n")  # 2 prompts x 20 tokens: 40 >= 32
    argv = ["--checkpoint", str(chat_checkpoint), "--prompt-file", str(prompts), "--max-new-tokens", "20", "--ignore-eos", "--temperature", "0"]
    code = generate.main(argv)
    first = capsys.readouterr()
    notice, summary = first.err.splitlines()
    assert code == 0 and notice == cli.COMPILE_NOTICE and "| new tokens: 40 |" in summary and "| compile: " in summary
    assert list((tmp_path / "inductor" / "saved_steps").glob("*.pt2"))

    code = generate.main(argv)
    later = capsys.readouterr()
    assert code == 0 and later.out == first.out and len(later.err.splitlines()) == 1  # loaded: nothing said about compiling
    assert later.out == generate_eager(argv, capsys)


def generate_eager(argv: list[str], capsys) -> str:
    assert generate.main([*argv, "--no-compile"]) == 0
    return capsys.readouterr().out


@pytest.mark.real
def test_the_default_command_loads_the_bundled_model_quantized():
    checkpoint, quant = cli.checkpoint_and_quant(None, "auto", 32)
    dtype = cli.pick_dtype("auto", checkpoint, CPU, quant)
    model = load_model(checkpoint, dtype, CPU, quant)
    assert dtype == torch.bfloat16 and model.dtype == torch.bfloat16
    assert isinstance(model.layers[0].mlp.w_gate_up, Int4Linear)
    assert checkpoint.name == "SmolLM2-135M-Instruct-quantized"


def test_an_eager_run_never_imports_the_compiler(tiny_checkpoint):
    """Importing torch._dynamo costs a second of a process's start; an eager run has no use for it
    (the embedding's random init, on the meta device, imported it before the model had its weights)."""
    folder = tiny_checkpoint("llama")[0]
    script = (
        "import sys, torch; from pathlib import Path; from weights.forms import load_model; from engine.generation import generate\n"
        f"model = load_model(Path({str(folder)!r}), torch.float32, torch.device('cpu'))\n"
        "with torch.inference_mode(): generate(model, [[5, 6, 7]], 4, eos_ids=frozenset())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize(("argv", "prompts", "rows"), [([], None, 1), ([], 5, 5), (["--prompt-file", "p", "--max-batch", "3"], 5, 3), (["--prompt-file", "p", "--max-batch", "8"], 5, 5)])
def test_the_dtype_is_chosen_for_the_rows_one_step_carries(argv, prompts, rows):
    """A chat decodes one row; a prompt file all of its prompts, or --max-batch of them."""
    args = generate.parse_args(argv or ["x"])
    assert generate.rows_at_once(args, None if prompts is None else [[1]] * prompts) == rows
