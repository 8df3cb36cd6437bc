"""Import a GGUF file (llama.cpp's format) as a Hugging Face checkpoint folder.

    python -m weights.gguf model.gguf OUT_DIR [--dtype float32|bfloat16|float16] [--quantized]

The folder holds what the engine (and transformers) read: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json and generation_config.json. Quantized tensors are
dequantized with gguf-py, so the weights are exactly the ones llama.cpp computes with (and the
ones transformers gets from `from_pretrained(..., gguf_file=...)`). The default float32 keeps them
exact; bfloat16 and float16 halve the folder but round every weight once more.

With --quantized the folder is one only the engine reads, and runs quantized (weights/loader.py):
Q4_0, Q4_1 and Q4_K matrices become int4 groups of 32 exactly (weights/gguf_blocks.py); every other
matrix (Q5_0, Q6_K, Q8_0, F16...), and the embedding and LM head, becomes int8 per output channel,
the nearest form the engine's kernels take. Norms and biases keep --dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import _type_traits as _QUANT_TYPES
from gguf.quants import dequantize
from tqdm import tqdm

from models.config import ModelConfig
from errors import UserError, run_command
from models.quantized import QuantizedWeight, quantize_int8
from weights.gguf_blocks import GROUP, INT4_TYPES, int4_weight
from weights.gguf_metadata import Metadata, open_gguf
from weights.gguf_tokenizer import generation_config, tokenizer, tokenizer_config
from weights.safetensors_files import SAVED_DTYPES as DTYPES
from weights.loader import QUANTIZED_KEY, expected_shapes
from weights.safetensors_writer import Entry, stored_entries, stored_tensors, write_folder, write_safetensors

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# The files an import writes; a folder with all of them is a finished import.

# GGUF leaf name -> Hugging Face name inside model.layers.N.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def import_gguf(
    path: str | Path, out_dir: str | Path, dtype: str = "float32", *, quantized: bool = False, progress: bool = True
) -> Path:
    """Convert the GGUF file at `path` into the checkpoint folder `out_dir` (which must not exist yet);
    `quantized`: a quantized checkpoint (the module's docstring).

    Everything is written into a temporary sibling folder that is renamed at the end, so an
    interrupted import leaves no half-written checkpoint behind.
    """
    path, out_dir = Path(path), Path(out_dir)
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir} already exists; remove it or choose another output folder")
    reader = open_gguf(path)
    meta = Metadata(reader, path)
    arch = meta.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    config = _model_config(meta, reader, arch, dtype)
    plan = _tensor_plan(reader, arch, config)
    if quantized:
        config[QUANTIZED_KEY] = {"from": "gguf", "int4": "Q4_0, Q4_1 and Q4_K matrices, groups of 32", "int8": "other matrices, per output channel"}
    tok = tokenizer(meta)

    def fill(folder: Path) -> None:
        _write_json(folder / "config.json", config)
        _write_json(folder / "generation_config.json", generation_config(meta))
        _write_json(folder / "tokenizer_config.json", tokenizer_config(meta))
        tok.save(str(folder / "tokenizer.json"))
        with open(folder / "model.safetensors", "wb") as f:
            _write_safetensors(f, plan, DTYPES[dtype], quantized, progress)

    return write_folder(out_dir, fill)


def _float32(value: float) -> float:
    # GGUF stores float32; its shortest repr gives back the value the config was written with (1e-05, not 9.99999974e-06).
    return float(str(np.float32(value)))


def _model_config(meta: Metadata, reader: GGUFReader, arch: str, dtype: str) -> dict[str, Any]:
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise UserError(
            "this GGUF carries Llama-3.1-style RoPE frequency factors (rope_freqs.weight), which the GGUF import "
            "does not convert; download the original checkpoint instead: python -m weights.download REPO_ID"
        )
    scaling = meta.arch("rope.scaling.type", "none")
    if scaling != "none":
        raise UserError(f"this GGUF uses RoPE scaling {scaling!r}, which the GGUF import does not convert; use the original checkpoint")
    n_heads = meta.need("attention.head_count")
    n_kv_heads = meta.arch("attention.head_count_kv", n_heads)
    for name in ("token_embd.weight", "blk.0.attn_k.weight"):
        if name not in tensors:
            raise UserError(f"the GGUF file has no {name} tensor; it is not a complete {arch} model")
    # Shapes rather than metadata: the K projection has n_kv_heads * head_dim rows (Qwen3's head_dim is not
    # hidden / heads), and the embedding may have more rows than the tokenizer has tokens.
    head_dim = int(tensors["blk.0.attn_k.weight"].shape[1]) // n_kv_heads
    vocab_size = int(tensors["token_embd.weight"].shape[1])
    if len(meta.get("tokenizer.ggml.tokens") or []) > vocab_size:
        raise UserError(f"the GGUF tokenizer has more tokens than the model's {vocab_size} embeddings; the file is inconsistent")
    config: dict[str, Any] = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": meta.need("embedding_length"),
        "intermediate_size": meta.need("feed_forward_length"),
        "num_hidden_layers": meta.need("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32(meta.need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(meta.arch("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": meta.arch("context_length", 4096),
        # llama.cpp writes output.weight only when the model does not reuse the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.token_id("bos_token_id"),
        "eos_token_id": meta.token_id("eos_token_id"),
        "pad_token_id": meta.token_id("padding_token_id"),
        "dtype": dtype,
        "torch_dtype": dtype,  # the name transformers < 4.56 reads
    }
    if arch in ("llama", "qwen3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "llama":
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    else:
        config["use_sliding_window"] = False
    return config


@dataclass(frozen=True)
class _Planned:
    """One tensor to write: its HF name and shape, the GGUF tensor it comes from, and the heads to unpermute (0: none)."""

    name: str
    source: ReaderTensor
    shape: tuple[int, ...]
    unpermute_heads: int = 0


def _hf_name(gguf_name: str) -> str | None:
    stem, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    return None


def _tensor_plan(reader: GGUFReader, arch: str, config: dict[str, Any]) -> list[_Planned]:
    """Map every tensor of the file to its HF name, checking names, shapes and types before writing anything."""
    expected = expected_shapes(ModelConfig.from_dict(config))
    plan = []
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None or name not in expected:
            raise UserError(f"unexpected tensor {t.name} in the GGUF file: it has no place in a {arch} model")
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        want = expected.pop(name)
        if shape != want:
            raise UserError(f"GGUF tensor {t.name} has shape {list(shape)}, the metadata implies {list(want)}")
        if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) and t.tensor_type not in _QUANT_TYPES:
            raise UserError(
                f"GGUF tensor {t.name} has type {t.tensor_type.name}, which gguf {version('gguf')} cannot dequantize; "
                "use a file quantized with a common type (F16, Q8_0, Q4_K_M...)"
            )
        heads = 0
        # llama.cpp's converter interleaves the two rotary halves of each Llama Q/K head (it runs RoPE
        # GPT-J style); the HF layout keeps them as halves. Qwen files keep the HF layout (NeoX RoPE).
        if arch == "llama" and ".self_attn.q_proj." in name:
            heads = config["num_attention_heads"]
        elif arch == "llama" and ".self_attn.k_proj." in name:
            heads = config["num_key_value_heads"]
        plan.append(_Planned(name, t, shape, heads))
    if missing := list(expected):
        raise UserError(f"the GGUF file lacks the tensor for {missing[0]} ({len(missing)} missing); it is incomplete")
    return plan


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute`: per head, rows (pair, 2) back to (2, half)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _float_weight(p: _Planned) -> np.ndarray:
    try:
        w = dequantize(p.source.data, p.source.tensor_type)
    except NotImplementedError as e:
        raise UserError(f"GGUF tensor {p.source.name}: {e}; use a file quantized with a common type") from e
    w = np.asarray(w, dtype=np.float32).reshape(p.shape)
    if not w.flags.writeable:  # F32 tensors come back as views of the read-only memory map
        w = w.copy()
    return _unpermute(w, p.unpermute_heads) if p.unpermute_heads else w


def _stays_int4(p: _Planned, quantized: bool) -> bool:
    """Whether the tensor is written as the int4 groups it already is (the embedding and LM head are int8 always)."""
    return quantized and p.source.tensor_type in INT4_TYPES and ".layers." in p.name


def _entries(p: _Planned, dtype: torch.dtype, quantized: bool) -> list[Entry]:
    """What the tensor becomes in the file: itself in `dtype`, or, quantized, int8 values and their float32 scales (and zeros)."""
    if not quantized or len(p.shape) != 2:
        return [(p.name, dtype, p.shape)]
    int4 = _stays_int4(p, quantized)
    return stored_entries(p.name, p.shape, p.shape[1] // GROUP if int4 else 1, with_zeros=int4)


def _load(p: _Planned, dtype: torch.dtype, quantized: bool = False) -> list[torch.Tensor]:
    """The tensors of _entries(p, dtype, quantized), in its order."""
    if not quantized or len(p.shape) != 2:
        return [torch.from_numpy(np.ascontiguousarray(_float_weight(p))).to(dtype)]
    if _stays_int4(p, quantized):
        weight = int4_weight(p.source.data, p.source.tensor_type, p.shape)
        if p.unpermute_heads:  # the rows move; each row's groups stay as they are
            weight = QuantizedWeight(*(torch.from_numpy(_unpermute(t.numpy(), p.unpermute_heads)) for t in (weight.values, weight.scales, weight.zeros)))
        return stored_tensors(weight)
    return stored_tensors(quantize_int8(torch.from_numpy(_float_weight(p))))


def _write_safetensors(f: BinaryIO, plan: list[_Planned], dtype: torch.dtype, quantized: bool, progress: bool) -> None:
    entries = [entry for p in plan for entry in _entries(p, dtype, quantized)]
    tensors = (t for p in tqdm(plan, desc="importing tensors", unit="tensor", disable=not progress, file=sys.stderr) for t in _load(p, dtype, quantized))
    write_safetensors(f, entries, tensors)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weights.gguf", description="Import a GGUF file as a Hugging Face checkpoint folder.")
    p.add_argument("gguf", type=Path, help="the .gguf file (llama, qwen2 or qwen3 architecture)")
    p.add_argument("out_dir", type=Path, help="the checkpoint folder to create; it must not exist yet")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the saved weights (float32 keeps them exact)")
    p.add_argument("--quantized", action="store_true", help="a quantized checkpoint for the engine: 4-bit blocks as int4, other matrices int8")
    args = p.parse_args(argv)
    return run_command(lambda: print(import_gguf(args.gguf, args.out_dir, args.dtype, quantized=args.quantized)))


if __name__ == "__main__":
    sys.exit(main())
