"""Load a Hugging Face checkpoint folder (config.json + safetensors) into models.Transformer.

Strict by design: every tensor the architecture needs must be present with the right shape,
and every tensor in the files must be used. The q/k/v and gate/up projections are fused here,
once, so that a decode step runs one matmul where transformers runs three. Weights are copied
in blocks, each through a memory map closed at once; an untied embedding table stays mapped.
"""

import json
from pathlib import Path

import torch
from torch import nn

from collections.abc import Callable
from dataclasses import dataclass

from errors import UserError
from models.config import ModelConfig
from models.linear import column_major_on_cpu
from models.transformer import Transformer
from weights.safetensors_files import INDEX, open_safetensors, read_weight_map, safetensors_files

# Buffers some exporters save alongside the weights; the engine computes them itself.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# config.json's mark of a checkpoint saved quantized (weights/quantize.py, python -m weights.gguf --quantized),
# which weights/quantized_loading.py reads.
QUANTIZED_KEY = "weight_quantization"
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


Span = tuple[int, int]  # [first, end)


@dataclass(frozen=True)
class Part:
    """The rows and columns of one checkpoint tensor that go into an engine tensor (None: all of them)."""

    name: str
    rows: Span | None = None
    columns: Span | None = None


def whole(sources: list[str]) -> list[Part]:
    return [Part(name) for name in sources]


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


def locate_tensors(checkpoint: Path, config: ModelConfig, expected: dict[str, tuple[int, ...]] | None = None) -> dict[str, Path]:
    """The file of every tensor the model takes, by HF name, after checking names and shapes
    (expected: every name and shape the files must hold; default, the architecture's)."""
    expected = expected_shapes(config) if expected is None else expected
    weight_map = read_weight_map(checkpoint)
    located = {name: path for path in safetensors_files(checkpoint, weight_map) for name in _checked_names(path, config, expected, weight_map)}
    missing = [name for name in expected if name not in located]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(f"tensor {missing[0]}{more} missing from {checkpoint}; shape expected {list(expected[missing[0]])}")
    return located


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
    located: dict[str, Path], config: ModelConfig, dtype: torch.dtype, device: torch.device,
    parts_of: Callable[[str, list[str]], list[Part] | None] | None = None,
) -> dict[str, torch.Tensor]:
    """Every engine tensor, a copy of its own, except an embedding table that is not the LM head:
    on CPU, in the file's dtype, that one stays a view of the memory-mapped file, so only the rows
    the model looks up become resident (as with transformers' loading). Weights read in full at
    every step gain nothing from the map, and read from the page cache's small pages they were
    slower (docs/performance.md). parts_of(engine name, its sources): the parts to read (None: a
    tensor held as zeros); default, all of them (a tensor-parallel rank reads its own,
    weights/sharding.py)."""
    expected = expected_shapes(config)
    state = {}
    for name, sources in engine_sources(config).items():
        if name == "embed.weight" and config.tie_word_embeddings:
            continue  # the LM head's copy serves both (two copies would meet at the loading peak)
        parts = whole(sources) if parts_of is None else parts_of(name, sources)
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
        column_major = name.endswith(LINEARS) and column_major_on_cpu(shape, dtype, device)
        state[name] = read_copy(located, parts, shape, dtype, device, column_major)
    if config.tie_word_embeddings:
        state["embed.weight"] = state["lm_head.weight"]
    return state


def parts_shape(parts: list[Part], shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of the engine tensor `parts` make, given each checkpoint tensor's whole shape."""
    rows = sum(_extent(p.rows, shapes[p.name][0]) for p in parts)
    first = parts[0]
    if len(shapes[first.name]) == 1:
        return (rows,)
    return (rows, _extent(first.columns, shapes[first.name][1]))


def _extent(span: Span | None, size: int) -> int:
    return size if span is None else span[1] - span[0]


def load_model(checkpoint: Path, dtype: torch.dtype, device: torch.device) -> Transformer:
    """The model of a checkpoint folder of 16/32-bit weights, in `dtype` (weights/forms.py loads
    the other forms: quantized, or a tensor-parallel rank's part)."""
    config = read_config(checkpoint)
    if stored_quantized(checkpoint):
        raise UserError(f"{checkpoint} is stored quantized; load it with weights.forms.load_model")
    with torch.device("meta"):  # no memory and no random init for weights that are replaced at once
        model = Transformer(config)
    return place_state(model, read_state(locate_tensors(checkpoint, config), config, dtype, device), device)


def place_state(model: Transformer, state: dict[str, torch.Tensor], device: torch.device) -> Transformer:
    """The model built on the meta device, its tensors put in place."""
    model.load_state_dict(state, assign=True, strict=True)
    if isinstance(model.lm_head, nn.Linear) and model.config.tie_word_embeddings:
        model.embed.weight = model.lm_head.weight  # one tensor, in the LM head's layout
    return model.to(device).requires_grad_(False).eval()
