"""Write a checkpoint: a safetensors file one tensor at a time, so memory holds one tensor, not the
model, inside a folder that appears whole or not at all."""

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from errors import UserError
from models.quantized import QuantizedWeight

SAFETENSORS_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8"}

# One tensor of a file: its name, dtype and shape, known before any of the data is made.
Entry = tuple[str, torch.dtype, tuple[int, ...]]


def write_safetensors(f: BinaryIO, entries: list[Entry], tensors: Iterable[torch.Tensor]) -> None:
    """The header of `entries`, then `tensors` in the same order, each checked against its entry."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for (name, dtype, shape), tensor in zip(entries, tensors, strict=True):
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise AssertionError(f"{name}: made {tensor.dtype} {list(tensor.shape)}, the header says {dtype} {list(shape)}")
        f.write(tensor.contiguous().view(torch.uint8).numpy().data)


def write_folder(out_dir: Path, fill: Callable[[Path], None]) -> Path:
    """`fill` writes the checkpoint's files into a temporary sibling folder, which is then renamed to
    `out_dir` (which must not exist, or be empty): an interrupted write leaves no half-written checkpoint."""
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    except OSError as e:
        raise UserError(f"cannot create the checkpoint folder {out_dir} ({e}); choose a writable place") from e
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the checkpoint is an ordinary folder
        fill(tmp)
        os.replace(tmp, out_dir)  # atomic; replaces an empty out_dir
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # disk full, or another process put out_dir in place first
            raise UserError(f"cannot write the checkpoint {out_dir} ({e}); check free space and that nothing else writes there") from e
        raise
    return out_dir


def stored_entries(name: str, shape: tuple[int, int], groups: int, with_zeros: bool) -> list[Entry]:
    """How a quantized checkpoint stores the weight `name` [N, K]: int8 values, float32 `.scales`
    [N, groups] and, for int4, `.zeros` [N, groups] (what _read_stored reads back)."""
    stem = name.removesuffix(".weight")
    entries = [(name, torch.int8, shape), (stem + ".scales", torch.float32, (shape[0], groups))]
    return entries + [(stem + ".zeros", torch.float32, (shape[0], groups))] if with_zeros else entries


def stored_tensors(weight: QuantizedWeight) -> list[torch.Tensor]:
    """The tensors of stored_entries, in its order."""
    return [weight.values, weight.scales] + ([] if weight.zeros is None else [weight.zeros])
