"""Save a 16/32-bit checkpoint quantized, once, so that later runs load it as it is.

    python -m weights.quantize CHECKPOINT OUT_DIR --quant int8|int4 [--group-size 32]

The output folder holds the same files, with each linear weight stored as int8 values beside
float32 `.scales` (and `.zeros` for int4), the embedding and LM head int8 (weights/loader.py says
why); norms and biases stay as they were. Quantization is row by row, so the saved model is the
very one `--quant` makes at load time. Only the engine reads the folder.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from errors import UserError, run_command
from models import GROUP_SIZES
from models.quantized import check_int4_fits, quantize
from weights.loader import QUANTIZED_KEY, SAFETENSORS_DTYPES, locate_tensors, read_config, stored_quantized
from weights.quantized_loading import LM_HEAD_MODE, linear_shapes
from weights.safetensors_writer import Entry, stored_entries, stored_tensors, write_folder, write_safetensors

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _entries_and_tensors(located: dict[str, Path], mode: str, group_size: int) -> tuple[list[Entry], list]:
    """The output's layout, and one maker per tensor (each reads and quantizes when the writer asks)."""
    entries, makers = [], []
    for name, path in located.items():
        with safe_open(path, framework="pt") as f:
            shape, dtype = tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()
        if len(shape) != 2:
            entries.append((name, SAFETENSORS_DTYPES[dtype], shape))
            makers.append(lambda name=name, path=path: [_read(path, name)])
            continue
        weight_mode = LM_HEAD_MODE if name in ("lm_head.weight", "model.embed_tokens.weight") else mode
        int4 = weight_mode == "int4"
        entries += stored_entries(name, shape, shape[1] // group_size if int4 else 1, with_zeros=int4)
        makers.append(lambda name=name, path=path, weight_mode=weight_mode: stored_tensors(quantize(_read(path, name), weight_mode, group_size)))
    return entries, makers


def _read(path: Path, name: str) -> torch.Tensor:
    with safe_open(path, framework="pt") as f:
        return f.get_tensor(name)


def save_quantized(checkpoint: Path, out_dir: Path, mode: str, group_size: int = 32) -> Path:
    config = read_config(checkpoint)
    if stored_quantized(checkpoint):
        raise UserError(f"{checkpoint} is already quantized")
    if out_dir.exists():
        raise UserError(f"{out_dir} already exists; remove it or choose another output folder")
    if mode == "int4":
        check_int4_fits(linear_shapes(config), group_size)
    entries, makers = _entries_and_tensors(locate_tensors(checkpoint, config), mode, group_size)
    def fill(folder: Path) -> None:
        for item in checkpoint.iterdir():  # the tokenizer, generation config, chat template...
            if item.is_file() and item.name not in (*WEIGHT_FILES, "config.json") and item.suffix != ".safetensors":
                shutil.copy2(item, folder / item.name)
        raw = json.loads((checkpoint / "config.json").read_text())
        raw[QUANTIZED_KEY] = {"mode": mode, "group_size": group_size if mode == "int4" else None, "embedding_and_lm_head": LM_HEAD_MODE}
        (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        with open(folder / "model.safetensors", "wb") as f:
            write_safetensors(f, entries, (t for make in makers for t in make()))

    return write_folder(out_dir, fill)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weights.quantize", description="Save a checkpoint with int8 or int4 weights.")
    p.add_argument("checkpoint", type=Path, help="a 16/32-bit checkpoint folder")
    p.add_argument("out_dir", type=Path, help="the quantized checkpoint folder to create; it must not exist yet")
    p.add_argument("--quant", choices=["int8", "int4"], required=True)
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=32, help="--quant int4: inputs that share one scale and zero")
    args = p.parse_args(argv)
    return run_command(lambda: print(save_quantized(args.checkpoint, args.out_dir, args.quant, args.group_size)))


if __name__ == "__main__":
    sys.exit(main())
