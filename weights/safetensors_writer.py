"""Write a safetensors file one tensor at a time, so memory holds one tensor, not the model."""

import json
from collections.abc import Iterable
from typing import Any, BinaryIO

import torch

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
