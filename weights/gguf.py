"""Import a GGUF file (llama.cpp's format) as a Hugging Face checkpoint folder.

    python -m weights.gguf model.gguf OUT_DIR [--dtype float32|bfloat16|float16]

The folder holds what the engine (and transformers) read: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json and generation_config.json. Quantized tensors are
dequantized with gguf-py, so the weights are exactly the ones llama.cpp computes with (and the
ones transformers gets from `from_pretrained(..., gguf_file=...)`). The default float32 keeps them
exact; bfloat16 and float16 halve the folder but round every weight once more.
"""

from __future__ import annotations

import argparse
import json
import os
import reprlib
import shutil
import sys
import tempfile
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, BinaryIO, Sequence, get_args, get_origin

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import _type_traits as _QUANT_TYPES
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tqdm import tqdm

from models.config import ModelConfig
from errors import UserError, run_command
from weights.loader import expected_shapes

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The files an import writes; a folder with all of them is a finished import.
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
# What to do about a damaged GGUF file.
_FETCH_AGAIN = "download, copy or convert it again"

# The type of each metadata value the import reads; GGUF's integers and floats of every width read as int and float.
_METADATA_KINDS: dict[str, Any] = {
    "general.architecture": str,
    "tokenizer.ggml.model": str,
    "tokenizer.ggml.pre": str,
    "tokenizer.ggml.tokens": list[str],
    "tokenizer.ggml.merges": list[str],
    "tokenizer.ggml.token_type": list[int],
    "tokenizer.ggml.bos_token_id": int,
    "tokenizer.ggml.eos_token_id": int,
    "tokenizer.ggml.eot_token_id": int,
    "tokenizer.ggml.eom_token_id": int,
    "tokenizer.ggml.padding_token_id": int,
    "tokenizer.ggml.unknown_token_id": int,
    "tokenizer.ggml.add_bos_token": bool,
    "tokenizer.ggml.add_eos_token": bool,
    "tokenizer.chat_template": str,
}
# The same for the keys under "<architecture>.".
_ARCH_METADATA_KINDS: dict[str, Any] = {
    "block_count": int,
    "context_length": int,
    "embedding_length": int,
    "feed_forward_length": int,
    "attention.head_count": int,
    "attention.head_count_kv": int,
    "attention.layer_norm_rms_epsilon": float,
    "rope.freq_base": float,
    "rope.scaling.type": str,
}
_KIND_CHECKS = {
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),  # a whole number is a number too
    str: lambda v: isinstance(v, str),
    bool: lambda v: isinstance(v, bool),
}
_KIND_NAMES = {
    int: "an integer", float: "a number", str: "text", bool: "a boolean", list[str]: "an array of text", list[int]: "an array of integers"
}

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

# llama.cpp's token types (enum llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# How llama.cpp splits text for each `tokenizer.ggml.pre` (llama-vocab.cpp), spelled as the original
# model's tokenizer.json spells it. Unknown names are refused: a wrong split gives plausible but wrong ids.
_GPT2_SPLIT = None  # ByteLevel's own regex
_DIGITS_THEN_GPT2 = "digits"  # every \p{N} character alone, then GPT-2's regex (StarCoder, SmolLM)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS: dict[str, str | None] = {
    "gpt-2": _GPT2_SPLIT,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# llama.cpp lets a word that is itself a token skip the merges for these (`ignore_merges`).
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe"}
# Besides the declared EOS, llama.cpp ends generation on any of these tokens (its end-of-generation set).
_END_OF_GENERATION = {
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>", "<end_of_turn>", "<EOT>", "_<EOT>"
}


def import_gguf(
    path: str | Path, out_dir: str | Path, dtype: str = "float32", *, progress: bool = True
) -> Path:
    """Convert the GGUF file at `path` into the checkpoint folder `out_dir` (which must not exist yet).

    Everything is written into a temporary sibling folder that is renamed at the end, so an
    interrupted import leaves no half-written checkpoint behind.
    """
    path, out_dir = Path(path), Path(out_dir)
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir} already exists; remove it or choose another output folder")
    reader = _open(path)
    meta = _Metadata(reader, path)
    arch = meta.architecture
    config = _model_config(meta, reader, arch, dtype)
    plan = _tensor_plan(reader, arch, config)
    tokenizer = _tokenizer(meta)

    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    except OSError as e:
        raise UserError(f"cannot create the checkpoint folder {out_dir} ({e}); choose a writable place") from e
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the checkpoint is an ordinary folder
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", _generation_config(meta))
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config(meta))
        tokenizer.save(str(tmp / "tokenizer.json"))
        with open(tmp / "model.safetensors", "wb") as f:
            _write_safetensors(f, plan, DTYPES[dtype], progress)
        os.replace(tmp, out_dir)  # atomic; replaces an empty out_dir
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # disk full, or another process put out_dir in place first
            raise UserError(f"cannot write the checkpoint {out_dir} ({e}); check free space and that nothing else writes there") from e
        raise
    return out_dir


def _open(path: Path) -> GGUFReader:
    if not path.is_file():
        raise UserError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserError(f"{path} is not a GGUF file (it does not start with the 'GGUF' magic bytes)")
    try:
        return GGUFReader(path)
    except Exception as e:  # on a damaged file gguf-py fails with whatever its code or numpy raise: ValueError, IndexError, KeyError...
        raise _damaged(path, f"gguf-py cannot read it: {str(e).rstrip('.')}; most likely it is truncated, cut off during a copy or download") from e


def _damaged(path: Path, problem: str) -> UserError:
    return UserError(f"{path.name} in {path.parent} is damaged ({problem}); {_FETCH_AGAIN}")


class _Metadata:
    """The key/value metadata of a GGUF file, as plain Python values of the types the import expects."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self.path = path
        self._fields = reader.fields
        self._cache: dict[str, Any] = {}  # contents() rebuilds a list of 150k tokens on every call
        self.architecture: str = self.get("general.architecture")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UserError(
                f"GGUF architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

    def get(self, key: str, default: Any = None) -> Any:
        return self._value(key, _METADATA_KINDS[key], default)

    def arch(self, key: str, default: Any = None) -> Any:
        return self._value(f"{self.architecture}.{key}", _ARCH_METADATA_KINDS[key], default)

    def need(self, key: str) -> Any:
        value = self.arch(key)
        if value is None:
            raise UserError(f"the GGUF file has no {self.architecture}.{key} metadata, which a {self.architecture} model needs")
        return value

    def token_id(self, key: str) -> int | None:
        """tokenizer.ggml.<key> (bos_token_id, ...), checked to be the id of one of the file's tokens."""
        token_id = self.get(f"tokenizer.ggml.{key}")
        n_tokens = len(self.get("tokenizer.ggml.tokens", []))
        if token_id is not None and not 0 <= token_id < n_tokens:
            raise _damaged(self.path, f"its metadata tokenizer.ggml.{key} is {token_id}, but it has {n_tokens} tokens")
        return token_id

    def _value(self, key: str, kind: Any, default: Any) -> Any:
        if key not in self._cache:
            self._cache[key] = self._read(key, kind)
        value = self._cache[key]
        return default if value is None else value

    def _read(self, key: str, kind: Any) -> Any:
        field = self._fields.get(key)
        if field is None:
            return None
        try:
            value = field.contents()
        except UnicodeDecodeError as e:
            raise _damaged(self.path, f"its metadata {key} is not UTF-8 text") from e
        if not _has_kind(value, kind):
            raise _damaged(self.path, f"its metadata {key} is {_describe(value)}, not {_KIND_NAMES[kind]}")
        return value


def _has_kind(value: Any, kind: Any) -> bool:
    if get_origin(kind) is list:
        check = _KIND_CHECKS[get_args(kind)[0]]
        return isinstance(value, list) and all(check(v) for v in value)
    return _KIND_CHECKS[kind](value)


def _describe(value: Any) -> str:
    if isinstance(value, list):
        return f"an array of {type(value[0]).__name__}" if value else "an empty array"
    return f"{reprlib.repr(value)} ({type(value).__name__})"


def _float32(value: float) -> float:
    # GGUF stores float32; its shortest repr gives back the value the config was written with (1e-05, not 9.99999974e-06).
    return float(str(np.float32(value)))


def _model_config(meta: _Metadata, reader: GGUFReader, arch: str, dtype: str) -> dict[str, Any]:
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


def _load(p: _Planned, dtype: torch.dtype) -> torch.Tensor:
    try:
        w = dequantize(p.source.data, p.source.tensor_type)
    except NotImplementedError as e:
        raise UserError(f"GGUF tensor {p.source.name}: {e}; use a file quantized with a common type") from e
    w = np.asarray(w, dtype=np.float32).reshape(p.shape)
    if not w.flags.writeable:  # F32 tensors come back as views of the read-only memory map
        w = w.copy()
    if p.unpermute_heads:
        w = _unpermute(w, p.unpermute_heads)
    return torch.from_numpy(np.ascontiguousarray(w)).to(dtype)


def _write_safetensors(f: BinaryIO, plan: list[_Planned], dtype: torch.dtype, progress: bool) -> None:
    """Write the safetensors format by hand, one tensor at a time, so memory holds one tensor, not the model."""
    st_dtype = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for p in plan:
        size = int(np.prod(p.shape)) * itemsize
        header[p.name] = {"dtype": st_dtype, "shape": list(p.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for p in tqdm(plan, desc="importing tensors", unit="tensor", disable=not progress, file=sys.stderr):
        f.write(_load(p, dtype).view(torch.uint8).numpy().data)


# --- tokenizer ---------------------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, in which byte-level BPE vocabularies are spelled."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _tokenizer(meta: _Metadata) -> Tokenizer:
    """tokenizer.json for the file's byte-level BPE vocabulary, split the way its `tokenizer.ggml.pre` says."""
    model_name = meta.get("tokenizer.ggml.model")
    if model_name != "gpt2":
        raise UserError(
            f"the GGUF tokenizer is {model_name!r}; the import supports byte-level BPE ('gpt2': Llama 3, SmolLM, Qwen) only"
        )
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in _PRE_TOKENIZERS:
        raise UserError(
            f"the GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; supported: {', '.join(_PRE_TOKENIZERS)}. "
            "Use the original checkpoint instead: python -m weights.download REPO_ID"
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    merges: list[str] | None = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise UserError("the GGUF file has no tokenizer.ggml.tokens / tokenizer.ggml.merges; it carries no usable tokenizer")
    types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise _damaged(meta.path, f"its metadata tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")

    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, (token, token_type) in enumerate(zip(tokens, types)):
        # Control and user-defined tokens are matched in the raw text, so they keep their own spelling.
        if token_type not in (_CONTROL, _USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = i
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        bpe = models.BPE(vocab, pairs, ignore_merges=pre in _IGNORE_MERGES)  # type: ignore[arg-type]
    except Exception as e:  # tokenizers raises a bare Exception, e.g. for a merge of tokens the vocabulary lacks
        raise _damaged(meta.path, f"its tokenizer metadata does not hold together: {e}") from e
    tok = Tokenizer(bpe)

    split = _PRE_TOKENIZERS[pre]
    if split is _GPT2_SPLIT:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    if split is _QWEN2_SPLIT:
        # Qwen's own tokenizer.json (and transformers' Qwen2Tokenizer) compose text to NFC first; llama.cpp
        # does not, and neither does transformers' GGUF loader. The model was trained with it, so keep it.
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])
    for i, (token, token_type) in enumerate(zip(tokens, types)):
        if token_type in (_CONTROL, _USER_DEFINED) and tok.token_to_id(token) != i:
            raise UserError(f"the GGUF tokenizer lists the special token {token!r} twice; the file's tokenizer is inconsistent")

    byte_level = processors.ByteLevel(trim_offsets=False)
    template = _bos_eos_template(meta, tokens)
    tok.post_processor = processors.Sequence([byte_level, template]) if template else byte_level
    return tok


def _bos_eos_template(meta: _Metadata, tokens: list[str]) -> processors.TemplateProcessing | None:
    """The post-processor that adds BOS/EOS to encode(), when the file says llama.cpp adds them."""
    single, special = "$A", []  # e.g. "<|begin_of_text|> $A"
    for flag, key, where in (("add_bos_token", "bos_token_id", "before"), ("add_eos_token", "eos_token_id", "after")):
        token_id = meta.token_id(key)
        if meta.get(f"tokenizer.ggml.{flag}", False) and token_id is not None:
            single = f"{tokens[token_id]} {single}" if where == "before" else f"{single} {tokens[token_id]}"
            special.append((tokens[token_id], token_id))
    if not special:
        return None
    second = " ".join(f"{piece}:1" for piece in single.replace("$A", "$B").split())  # as Llama 3's tokenizer.json
    return processors.TemplateProcessing(single=single, pair=f"{single} {second}", special_tokens=special)


def _token(meta: _Metadata, key: str) -> str | None:
    token_id = meta.token_id(key)
    return None if token_id is None else meta.get("tokenizer.ggml.tokens")[token_id]


def _tokenizer_config(meta: _Metadata) -> dict[str, Any]:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token(meta, "bos_token_id"),
        "eos_token": _token(meta, "eos_token_id"),
        "pad_token": _token(meta, "padding_token_id"),
        "unk_token": _token(meta, "unknown_token_id"),
        "add_bos_token": meta.get("tokenizer.ggml.add_bos_token", False),
        "add_eos_token": meta.get("tokenizer.ggml.add_eos_token", False),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.arch("context_length", 4096),
    }
    if (template := meta.get("tokenizer.chat_template")) is not None:
        config["chat_template"] = template
    return config


def _generation_config(meta: _Metadata) -> dict[str, Any]:
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    declared = [meta.token_id(k) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    # Like llama.cpp: a chat model ends its turn with e.g. <|im_end|> even when EOS is <|endoftext|>.
    named = [i for i, token in enumerate(tokens) if token in _END_OF_GENERATION]
    eos = list(dict.fromkeys(i for i in [*declared, *named] if i is not None))
    config: dict[str, Any] = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
    for key, name in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        if (value := meta.token_id(name)) is not None:
            config[key] = value
    return config


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weights.gguf", description="Import a GGUF file as a Hugging Face checkpoint folder.")
    p.add_argument("gguf", type=Path, help="the .gguf file (llama, qwen2 or qwen3 architecture)")
    p.add_argument("out_dir", type=Path, help="the checkpoint folder to create; it must not exist yet")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the saved weights (float32 keeps them exact)")
    args = p.parse_args(argv)
    return run_command(lambda: print(import_gguf(args.gguf, args.out_dir, args.dtype)))


if __name__ == "__main__":
    sys.exit(main())
