"""Loading a checkpoint's linear weights quantized: int8 or int4 as they are read from 16/32-bit
files (--quant), or as stored in a checkpoint saved quantized (weights/quantize.py, a GGUF import
with --quantized). The embedding and LM head are int8; norms and biases stay in the model's dtype."""

import ctypes
from pathlib import Path

import torch

from errors import UserError
from models.config import ModelConfig
from models.quantized import Int8Embedding, QuantizedWeight, check_int4_activations, check_int4_fits, concatenate, quantize, quantize_int8, quantized_linear
from models.transformer import Transformer
from weights.loader import (
    LINEARS, engine_sources, expected_shapes, locate_tensors, place_state, read_config, read_copy, stored_quantized, whole,
)
from weights.safetensors_files import FETCH_AGAIN, open_safetensors, read_weight_map, safetensors_files

QUANT_SUFFIXES = (".scales", ".zeros")  # beside each int8 `.weight` (weights/safetensors_writer.py: stored_entries)
# The LM head and the embedding are int8 in both modes: against bfloat16 little perplexity for a
# faster step, where int4 would cost several times as much (docs/performance.md).
LM_HEAD_MODE = "int8"


def load_quantized(checkpoint: Path, dtype: torch.dtype, device: torch.device, quant: str = "none", group_size: int = 32) -> Transformer:
    """The model of a checkpoint folder with its linear weights quantized: by `quant` (int8, int4
    in groups of group_size) as they are read, or as stored (quant "none")."""
    config = read_config(checkpoint)
    stored = stored_quantized(checkpoint)
    if quant != "none" and stored:
        raise UserError(f"{checkpoint} is already quantized and runs as stored; leave out --quant (it is for 16/32-bit checkpoints)")
    if quant == "int4":
        check_int4_activations(device, dtype)  # before anything is read
        check_int4_fits(linear_shapes(config), group_size)
    with torch.device("meta"):
        model = Transformer(config)
    expected = expected_shapes(config)
    if stored:
        expected |= _quantization_shapes(checkpoint, expected)
    state = read_quantized_state(locate_tensors(checkpoint, config, expected), config, dtype, device, quant, group_size)
    quantized = {name: state.pop(name) for name in list(state) if isinstance(state[name], QuantizedWeight)}
    _place_quantized(model, quantized, state, dtype, device)
    del quantized  # the portable copies too, before the memory goes back
    _return_freed_memory()
    return place_state(model, state, device)


def read_quantized_state(
    located: dict[str, Path], config: ModelConfig, dtype: torch.dtype, device: torch.device, quant: str, group_size: int
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every engine tensor: the linear weights and the embedding as QuantizedWeight (an embedding
    stored whole stays a view of the memory-mapped file on CPU), the rest copies in `dtype`."""
    expected = expected_shapes(config)
    state = {}
    for name, sources in engine_sources(config).items():
        if name == "embed.weight" and config.tie_word_embeddings:
            continue  # built from the LM head's table
        shape = (sum(expected[s][0] for s in sources), *expected[sources[0]][1:])
        if name == "embed.weight":
            state[name] = _read_quantized(located, name, sources, shape, "int8", group_size, as_view=device.type == "cpu")
        elif name.endswith(LINEARS):
            state[name] = _read_quantized(located, name, sources, shape, LM_HEAD_MODE if name == "lm_head.weight" else quant, group_size)
        else:
            state[name] = read_copy(located, whole(sources), shape, dtype, device, column_major=False)
    return state


def _quantization_shapes(checkpoint: Path, expected: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The `.scales` and `.zeros` tensors of a quantized checkpoint with their shapes [N, groups], as
    its files hold them (the number of groups is each tensor's own: a GGUF file mixes block types)."""
    shapes = {}
    for path in safetensors_files(checkpoint, read_weight_map(checkpoint)):
        with open_safetensors(path) as f:
            for name in f.keys():
                weight = name.rpartition(".")[0] + ".weight"
                if name.endswith(QUANT_SUFFIXES) and len(expected.get(weight, ())) == 2:
                    rows, inputs = expected[weight]
                    groups = f.get_slice(name).get_shape()[-1]
                    if not groups or inputs % groups:
                        raise UserError(f"{name} in {path.name} has {groups} groups, which do not divide the {inputs} inputs of {weight}; {FETCH_AGAIN}")
                    shapes[name] = (rows, groups)
    for weight, shape in expected.items():
        if len(shape) == 2:
            shapes.setdefault(weight.removesuffix(".weight") + ".scales", (shape[0], 1))
    return shapes


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """The [N, K] of the first layer's linear weights (every layer's are the same), by engine name."""
    expected = expected_shapes(config)
    return {
        name: (sum(expected[s][0] for s in sources), expected[sources[0]][1])
        for name, sources in engine_sources(config).items()
        if name.startswith("layers.0.") and name.endswith(LINEARS)
    }


def _read_quantized(
    located: dict[str, Path], name: str, sources: list[str], shape: tuple[int, ...], mode: str, group_size: int, as_view: bool = False
) -> QuantizedWeight:
    """The weight `name` quantized: as stored in a quantized checkpoint, or quantized now from its float values.
    as_view: a weight stored whole stays a view of the memory-mapped file (an embedding table: only
    the rows looked up become resident); otherwise every weight is a copy of its own."""
    stored = [s.removesuffix(".weight") for s in sources if s.removesuffix(".weight") + ".scales" in located]
    if as_view and len(stored) == 1:
        return _read_stored(located, stored[0])
    if stored:
        return concatenate([_read_stored(located, prefix) for prefix in stored])
    return quantize(read_copy(located, whole(sources), shape, torch.float32, torch.device("cpu"), column_major=False), mode, group_size)


def _read_stored(located: dict[str, Path], prefix: str) -> QuantizedWeight:
    """One linear weight of a quantized checkpoint: int8 `.weight`, float32 `.scales` and, for int4, `.zeros`."""
    tensors = {}
    for suffix in (".weight", *QUANT_SUFFIXES):
        if prefix + suffix in located:
            with open_safetensors(located[prefix + suffix]) as f:
                tensors[suffix] = f.get_tensor(prefix + suffix)
    if tensors[".weight"].dtype != torch.int8:
        raise UserError(f"{prefix}.weight is stored as {tensors['.weight'].dtype}, not int8, beside its .scales; {FETCH_AGAIN}")
    return QuantizedWeight(tensors[".weight"], tensors[".scales"].float(), None if ".zeros" not in tensors else tensors[".zeros"].float())


def _return_freed_memory() -> None:
    """Hand the float copies quantizing freed back to the system. glibc keeps freed heap memory for
    reuse, so without this the resident set stays at the loading peak, about twice what the
    quantized model holds (docs/performance.md)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator does as it does
        pass


def _place_quantized(model: Transformer, quantized: dict[str, QuantizedWeight], state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
    """Put quantized layers in place of the model's linears and embedding; their buffers join `state`.
    Each portable copy leaves `quantized` once its layer is built, so the loading peak holds one
    weight in both forms, not all of them."""
    layers = {}
    table, head_mode = quantized.pop("embed.weight", None), quantized["lm_head.weight"].mode
    head_copy = quantized["lm_head.weight"] if table is None and head_mode != "int8" else None  # the embedding's source
    for name in list(quantized):
        weight = quantized.pop(name)
        path = name.removesuffix(".weight")
        layers[path] = quantized_linear(weight, state.pop(path + ".bias", None), dtype, device)
    head = layers["lm_head"]
    if table is None and head_mode == "int8":
        layers["embed"] = Int8Embedding(head.weight, head.scales)  # tied: the LM head's own table
    else:
        table = head_copy if table is None else table
        table = table if table.mode == "int8" else quantize_int8(table.dequantize())
        layers["embed"] = Int8Embedding(table.values.to(device), table.scales[:, 0].to(device, dtype))
    for path, layer in layers.items():
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        state |= {f"{path}.{key}": value for key, value in layer.state_dict().items()}
