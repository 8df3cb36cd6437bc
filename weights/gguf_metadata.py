"""Open a GGUF file and read its key/value metadata as plain Python values, checking each value's
type. A damaged file (cut short, or holding metadata of the wrong type) is refused here with a
message that names the file and the problem, so the rest of the import can trust what it reads.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any, get_args, get_origin

from gguf import GGUFReader

from errors import UserError

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


def open_gguf(path: Path) -> GGUFReader:
    if not path.is_file():
        raise UserError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserError(f"{path} is not a GGUF file (it does not start with the 'GGUF' magic bytes)")
    try:
        return GGUFReader(path)
    except Exception as e:  # on a damaged file gguf-py fails with whatever its code or numpy raise: ValueError, IndexError, KeyError...
        raise damaged(path, f"gguf-py cannot read it: {str(e).rstrip('.')}; most likely it is truncated, cut off during a copy or download") from e


def damaged(path: Path, problem: str) -> UserError:
    return UserError(f"{path.name} in {path.parent} is damaged ({problem}); {_FETCH_AGAIN}")


class Metadata:
    """The key/value metadata of a GGUF file, as plain Python values of the types the import expects."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self.path = path
        self._fields = reader.fields
        self._cache: dict[str, Any] = {}  # contents() rebuilds a list of 150k tokens on every call
        self.architecture: str = self.get("general.architecture")

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
            raise damaged(self.path, f"its metadata tokenizer.ggml.{key} is {token_id}, but it has {n_tokens} tokens")
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
            raise damaged(self.path, f"its metadata {key} is not UTF-8 text") from e
        if not _has_kind(value, kind):
            raise damaged(self.path, f"its metadata {key} is {_describe(value)}, not {_KIND_NAMES[kind]}")
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
