"""Load a Hugging Face checkpoint folder (config.json + safetensors) into models.Transformer.

Strict by design: every tensor the architecture needs must be present with the right shape,
and every tensor in the files must be used. The q/k/v and gate/up projections are fused here,
once, so that a decode step runs one matmul where transformers runs three. Weights are copied
in blocks, each through a memory map closed at once; an untied embedding table stays mapped.
"""

import ctypes
import json
from pathlib import Path

import torch
from torch import nn

from errors import UserError
from models.config import ModelConfig
from models.linear import column_major_on_cpu
from models.parallel import TensorParallel
from models.quantized import Int8Embedding, QuantizedWeight, check_int4_activations, check_int4_fits, concatenate, quantize, quantize_int8, quantized_linear
from models.transformer import Transformer
from weights.safetensors_files import FETCH_AGAIN, INDEX, open_safetensors, read_weight_map, safetensors_files
from weights.safetensors_writer import Entry
from weights.sharding import Part, parts_shape, rank_parts, whole

# Buffers some exporters save alongside the weights; the engine computes them itself.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# config.json's mark of a checkpoint saved quantized (weights/quantize.py, python -m weights.gguf --quantized):
# each linear weight is stored as int8 values beside float32 `.scales` (and `.zeros` for int4).
QUANTIZED_KEY = "weight_quantization"
QUANT_SUFFIXES = (".scales", ".zeros")
# The LM head and the embedding are int8 in both modes: against bfloat16 little perplexity for a
# faster step, where int4 would cost several times as much (docs/performance.md).
LM_HEAD_MODE = "int8"
LINEARS = ("wqkv.weight", "wo.weight", "w_gate_up.weight", "w_down.weight", "lm_head.weight")


def read_config(checkpoint: Path) -> ModelConfig:
    if not checkpoint.is_dir():
        raise UserError(f"checkpoint folder {checkpoint} does not exist")
    path = checkpoint / "config.json"
    if not path.is_file():
        raise UserError(f"{checkpoint} has no config.json; point --checkpoint at a Hugging Face model folder")
    return ModelConfig.from_file(path)


def stored_dtype(checkpoint: Path) -> str | None:
    """The dtype config.json says the weights were saved in ("bfloat16", ...), if it says."""
    read_config(checkpoint)  # a missing or damaged config.json: its one clear error, before the read below
    raw = json.loads((checkpoint / "config.json").read_text())
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    return dtype if isinstance(dtype, str) else None


def stored_quantized(checkpoint: Path) -> bool:
    """Whether the checkpoint's linear weights were saved quantized."""
    read_config(checkpoint)
    return QUANTIZED_KEY in json.loads((checkpoint / "config.json").read_text())


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a Hugging Face checkpoint of this architecture holds, with its shape."""
    C, D, I = config.hidden_size, config.head_dim, config.intermediate_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, C), "model.norm.weight": (C,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, C)
    projections = {
        "self_attn.q_proj": (config.n_heads * D, C, config.qkv_bias),
        "self_attn.k_proj": (config.n_kv_heads * D, C, config.qkv_bias),
        "self_attn.v_proj": (config.n_kv_heads * D, C, config.qkv_bias),
        "self_attn.o_proj": (C, config.n_heads * D, config.o_bias),
        "mlp.gate_proj": (I, C, config.mlp_bias),
        "mlp.up_proj": (I, C, config.mlp_bias),
        "mlp.down_proj": (C, I, config.mlp_bias),
    }
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        for name, (out_dim, in_dim, bias) in projections.items():
            shapes[p + name + ".weight"] = (out_dim, in_dim)
            if bias:
                shapes[p + name + ".bias"] = (out_dim,)
        shapes[p + "input_layernorm.weight"] = (C,)
        shapes[p + "post_attention_layernorm.weight"] = (C,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (D,)
            shapes[p + "self_attn.k_norm.weight"] = (D,)
    return shapes


def locate_tensors(checkpoint: Path, config: ModelConfig) -> dict[str, Path]:
    """The file of every tensor the model takes, by HF name, after checking names and shapes."""
    expected = expected_shapes(config)
    if stored_quantized(checkpoint):
        expected |= _quantization_shapes(checkpoint, expected)
    weight_map = read_weight_map(checkpoint)
    located = {name: path for path in safetensors_files(checkpoint, weight_map) for name in _checked_names(path, config, expected, weight_map)}
    missing = [name for name in expected if name not in located]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(f"tensor {missing[0]}{more} missing from {checkpoint}; shape expected {list(expected[missing[0]])}")
    return located


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


def _checked_names(path: Path, config: ModelConfig, expected: dict[str, tuple[int, ...]], weight_map: dict[str, str] | None) -> list[str]:
    """The tensors of one file that the model takes, each checked against the index, the architecture and its shape."""
    wanted = []
    with open_safetensors(path) as f:
        for name in f.keys():
            # An index that places a tensor elsewhere was written for other shards: files from two downloads.
            if weight_map is not None and weight_map.get(name) != path.name:
                where = f"puts it in {weight_map[name]}" if name in weight_map else "does not list it"
                raise UserError(
                    f"{INDEX} in {path.parent} does not match its shards: {path.name} holds {name}, but the index {where}; "
                    "download or copy the checkpoint again"
                )
            if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
                continue
            if name not in expected:
                raise UserError(f"unexpected tensor {name} in {path.name}: it is not part of a {config.model_type} model with this config.json")
            shape = tuple(f.get_slice(name).get_shape())
            if shape != expected[name]:
                raise UserError(f"tensor {name} in {path.name} has shape {list(shape)}, config.json implies {list(expected[name])}")
            wanted.append(name)
    return wanted


def engine_sources(config: ModelConfig) -> dict[str, list[str]]:
    """Each engine tensor and the HF tensors it is made of, concatenated along rows: q|k|v and
    gate|up become one matrix each, so that a decode step runs one matmul where transformers runs three."""
    sources = {"embed.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    sources["lm_head.weight"] = ["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    for i in range(config.n_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        sources[dst + "attn.wqkv.weight"] = [attn + p + "_proj.weight" for p in "qkv"]
        sources[dst + "attn.wo.weight"] = [attn + "o_proj.weight"]
        sources[dst + "mlp.w_gate_up.weight"] = [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
        sources[dst + "mlp.w_down.weight"] = [mlp + "down_proj.weight"]
        if config.qkv_bias:
            sources[dst + "attn.wqkv.bias"] = [attn + p + "_proj.bias" for p in "qkv"]
        if config.o_bias:
            sources[dst + "attn.wo.bias"] = [attn + "o_proj.bias"]
        if config.mlp_bias:
            sources[dst + "mlp.w_gate_up.bias"] = [mlp + "gate_proj.bias", mlp + "up_proj.bias"]
            sources[dst + "mlp.w_down.bias"] = [mlp + "down_proj.bias"]
        if config.qk_norm:
            sources[dst + "attn.q_norm.weight"] = [attn + "q_norm.weight"]
            sources[dst + "attn.k_norm.weight"] = [attn + "k_norm.weight"]
        sources[dst + "attn_norm.weight"] = [src + "input_layernorm.weight"]
        sources[dst + "mlp_norm.weight"] = [src + "post_attention_layernorm.weight"]
    return sources


# A copy goes through the file in blocks of about this size, each through a memory map of its own
# closed at once: the file pages a block touched leave the process with the map, so loading holds
# the model plus one block, not the model plus the file.
COPY_BLOCK_BYTES = 16 << 20
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def read_copy(located: dict[str, Path], parts: list[Part], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, column_major: bool) -> torch.Tensor:
    """The checkpoint tensors' `parts`, concatenated along rows, cast, in a tensor of the engine's own."""
    if column_major:  # the same [out, in] tensor, its memory laid out as [in, out]
        out = torch.empty(shape[::-1], dtype=dtype, device=device).t()
    else:
        out = torch.empty(shape, dtype=dtype, device=device)
    row = 0
    for part in parts:
        path = located[part.name]
        with open_safetensors(path) as f:
            first, end = part.rows or (0, f.get_slice(part.name).get_shape()[0])
        block = max(1, COPY_BLOCK_BYTES // max(1, out[0].numel() * out.element_size()))
        for start in range(first, end, block):
            stop = min(end, start + block)
            with open_safetensors(path) as f:
                rows = f.get_slice(part.name)
                out[row + start - first : row + stop - first].copy_(rows[start:stop] if part.columns is None else rows[start:stop, slice(*part.columns)])
        row += end - first
    return out


def read_state(
    located: dict[str, Path], config: ModelConfig, dtype: torch.dtype, device: torch.device, quant: str = "none", group_size: int = 32,
    parallel: TensorParallel | None = None,
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every engine tensor, a copy of its own, except an embedding table that is not the LM head:
    on CPU, in the file's dtype, that one stays a view of the memory-mapped file, so only the rows
    the model looks up become resident (as with transformers' loading). Weights read in full at
    every step gain nothing from the map, and read from the page cache's small pages they were
    slower (docs/performance.md). With `quant` int8 or int4, or from a checkpoint saved quantized,
    the linear weights come as QuantizedWeight. With `parallel`, only this rank's parts of them
    (weights/sharding.py)."""
    expected = expected_shapes(config)
    quantized = quant != "none" or any(name.endswith(QUANT_SUFFIXES) for name in located)
    if quant == "int4":
        check_int4_fits(linear_shapes(config), group_size)
    state = {}
    for name, sources in engine_sources(config).items():
        if name == "embed.weight" and config.tie_word_embeddings:
            continue  # the LM head's copy serves both (two copies would meet at the loading peak)
        if name == "embed.weight" and quantized:
            state[name] = _read_quantized(located, name, sources, expected[sources[0]], "int8", group_size, as_view=device.type == "cpu")
            continue
        parts = rank_parts(name, sources, config, parallel)
        if parts is None:  # a bias another rank adds
            state[name] = torch.zeros(expected[sources[0]], dtype=dtype, device=device)
            continue
        if name == "embed.weight" and device.type == "cpu":
            with open_safetensors(located[sources[0]]) as f:
                if SAFETENSORS_DTYPES.get(f.get_slice(sources[0]).get_dtype()) == dtype:
                    first, end = parts[0].rows or (0, config.vocab_size)
                    state[name] = f.get_tensor(sources[0])[first:end]  # a view: the map stays open as long as the tensor lives
                    continue
        shape = parts_shape(parts, expected)
        if quantized and name.endswith(LINEARS):
            mode = LM_HEAD_MODE if name == "lm_head.weight" else quant
            state[name] = _read_quantized(located, name, sources, shape, mode, group_size)
            continue
        column_major = name.endswith(LINEARS) and column_major_on_cpu(shape, dtype, device)
        state[name] = read_copy(located, parts, shape, dtype, device, column_major)
    if config.tie_word_embeddings and not quantized:
        state["embed.weight"] = state["lm_head.weight"]
    return state


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


def stored_entries(name: str, shape: tuple[int, int], groups: int, with_zeros: bool) -> list[Entry]:
    """How a quantized checkpoint stores the weight `name` [N, K]: int8 values, float32 `.scales`
    [N, groups] and, for int4, `.zeros` [N, groups] (what _read_stored reads back)."""
    stem = name.removesuffix(".weight")
    entries = [(name, torch.int8, shape), (stem + ".scales", torch.float32, (shape[0], groups))]
    return entries + [(stem + ".zeros", torch.float32, (shape[0], groups))] if with_zeros else entries


def stored_tensors(weight: QuantizedWeight) -> list[torch.Tensor]:
    """The tensors of stored_entries, in its order."""
    return [weight.values, weight.scales] + ([] if weight.zeros is None else [weight.zeros])


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


def load_model(
    checkpoint: Path, dtype: torch.dtype, device: torch.device, quant: str = "none", group_size: int = 32, parallel: TensorParallel | None = None
) -> Transformer:
    """The model of a checkpoint folder; `quant` int8 or int4 quantizes its linear weights as they are read.
    A checkpoint saved quantized runs as stored. With `parallel`, this rank's part of the model."""
    config = read_config(checkpoint)
    if quant != "none" and stored_quantized(checkpoint):
        raise UserError(f"{checkpoint} is already quantized and runs as stored; leave out --quant (it is for 16/32-bit checkpoints)")
    if parallel is not None and quant != "none":
        raise UserError(f"tensor parallelism runs 16/32-bit weights only; drop --quant {quant}, or run without torchrun")
    if parallel is not None and stored_quantized(checkpoint):
        raise UserError(f"{checkpoint} is stored quantized and tensor parallelism runs 16/32-bit weights only; run it without torchrun, or give a 16/32-bit checkpoint")
    if quant == "int4":
        check_int4_activations(device, dtype)  # before anything is read
    # Built first, so that a rank's part that cannot be cut fails on every rank at once, before the reading.
    with torch.device("meta"):  # no memory and no random init for weights that are replaced at once
        model = Transformer(config, parallel)
    state = read_state(locate_tensors(checkpoint, config), config, dtype, device, quant, group_size, parallel)
    quantized = {name: state.pop(name) for name in list(state) if isinstance(state[name], QuantizedWeight)}
    if quantized:
        _place_quantized(model, quantized, state, dtype, device)
        del quantized  # the portable copies too, before the memory goes back
        _return_freed_memory()
    model.load_state_dict(state, assign=True, strict=True)
    if isinstance(model.lm_head, nn.Linear) and config.tie_word_embeddings:
        model.embed.weight = model.lm_head.weight  # one tensor, in the LM head's layout
    return model.to(device).requires_grad_(False).eval()


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
