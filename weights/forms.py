"""Which loader a checkpoint and --quant call for: its weights as stored (16/32-bit,
weights/loader.py; or saved quantized), or quantized as they are read. A tensor-parallel rank's
part is weights/sharding.py's load_rank."""

from pathlib import Path

import torch

from models.transformer import Transformer
from weights import loader
from weights.loader import stored_quantized
from weights.quantized_loading import load_quantized


def load_model(checkpoint: Path, dtype: torch.dtype, device: torch.device, quant: str = "none", group_size: int = 32) -> Transformer:
    """The model of a checkpoint folder; `quant` int8 or int4 quantizes its linear weights as they are read.
    A checkpoint saved quantized runs as stored."""
    if quant != "none" or stored_quantized(checkpoint):
        return load_quantized(checkpoint, dtype, device, quant, group_size)
    return loader.load_model(checkpoint, dtype, device)
